"""A compressed-tensors W4A16 / W8A16 checkpoint made from a model folder, as llm-compressor
writes them (the "pack-quantized" format of the `*-quantized.w4a16` checkpoints on the Hub).

`sluice make-tiny-model DIR --quantization w4a16|w8a16 [--group-size N] [--asymmetric]`
writes a tiny model and then this (`--quantization awq`: 4 bits with zero points, rewritten
in AutoAWQ's GEMM layout, `to_awq`; `--quantization gptq|gptq-int8 [--act-order]`: rewritten
in GPTQ's layout, `to_gptq`): every linear layer of the model but the LM head (MoE
routers included, as llm-compressor's default recipe does unless told to ignore them) gets
round-to-nearest integer weights with one scale per N input columns (`--group-size 0`: per
output channel) and, `--asymmetric`, a zero point per group. The scales are set here
(max-abs, or min-max for asymmetric); the packing, the tensor names and the config are
compressed-tensors' own (`ModelCompressor`), and transformers loads the result (it
decompresses it to float weights), so tests compare the engine against it. Needs the
`compressed-tensors` package (in the test extra).
"""

from __future__ import annotations

import os

import torch

SCHEMES = {"w4a16": 4, "w8a16": 8, "gptq": 4, "gptq-int8": 8, "w8a8": 8}


def column_order(module: str, columns: int) -> torch.Tensor:
    """The order in which GPTQ's activation ordering takes the input columns of the linear
    layer `module` (`to_gptq`): a permutation seeded by the module's parent, so the layers
    reading the same input (q/k/v, gate/up) share it, as GPTQ's (from that input's
    statistics) do."""
    import zlib

    seed = zlib.crc32(f"{module.rpartition('.')[0]}:{columns}".encode())
    return torch.randperm(columns, generator=torch.Generator().manual_seed(seed))


def quantize_checkpoint(
    path: str,
    bits: int = 4,
    group_size: int | None = 16,
    symmetric: bool = True,
    act_order: bool = False,
    activations: bool = False,
) -> int:
    """Rewrite the model folder's weights as a pack-quantized checkpoint in place; returns how
    many linear layers were quantized. `act_order`: each layer's groups are of its columns in
    `column_order` (stored in that order, for `to_gptq` to put back with a g_idx).
    `activations`: llm-compressor's W8A8 scheme instead (8-bit weights per channel,
    activations quantized per token as they come; the "int-quantized" format)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="group" if group_size else "channel",
                            group_size=group_size or None)  # fmt: skip
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    if activations:
        bits, group_size, symmetric = 8, None, True
        args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        scheme = QuantizationScheme(
            targets=["Linear"], weights=args,
            input_activations=QuantizationArgs(num_bits=8, type="int", symmetric=True,
                                               dynamic=True, strategy="token"),
        )  # fmt: skip
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    count = 0
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale"):
            if act_order:
                order = column_order(name, module.weight.shape[1])
                module.weight.data = module.weight.data[:, order].contiguous()
            scale, zero = _scales(module.weight.data.float(), bits, group_size, symmetric)
            module.weight_scale.data = scale.to(module.weight_scale.dtype)
            if not symmetric:
                module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)
            count += 1
    compressor = ModelCompressor.from_pretrained_model(
        model, quantization_format="int-quantized" if activations else "pack-quantized"
    )
    compressor.compress_model(model)
    for name in os.listdir(path):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            os.remove(os.path.join(path, name))
    model.save_pretrained(path)
    compressor.update_config(path)
    return count


def quantize_experts(path: str, bits: int, group_size: int | None, act_order: bool = False,
                     int8: bool = False) -> int:  # fmt: skip
    """The MoE experts' matrices of a symmetric pack-quantized checkpoint
    (`quantize_checkpoint`; transformers' fused experts are no Linear layers, so they are
    left in 16 bits there) quantized in place alike: each expert's `weight_packed`,
    `weight_scale` and `weight_shape`, as checkpoints made before transformers fused its
    experts store them (`act_order`: the columns stored in `column_order`, as
    `quantize_checkpoint` stores a layer's, for `to_gptq`). `int8`: a W8A8 ("int-quantized")
    checkpoint's instead, each matrix int8 per output channel beside its `weight_scale`, as
    llm-compressor writes the experts of a MoE whose experts are Linear layers. Returns the
    matrices."""
    import re

    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    names = [n for n in tensors if re.search(r"\.experts\.\d+\.[^.]+\.weight$", n)]
    top = 1 << (bits - 1)
    for name in names:
        stored = tensors.pop(name)
        w = stored.float()
        if int8:
            scale = w.abs().amax(-1, keepdim=True) / 127
            tensors[name] = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
            tensors[name + "_scale"] = scale  # (float32, as the compressor's for this model)
            continue
        if act_order:
            w = w[:, column_order(name.removesuffix(".weight"), w.shape[1])]
        scale, _ = _scales(w, bits, group_size, True)
        q = torch.round(w / scale.repeat_interleave(group_size or w.shape[1], 1))
        tensors[name + "_packed"] = pack_to_int32(q.clamp(-top, top - 1).to(torch.int8), bits)
        tensors[name + "_scale"] = scale.to(stored.dtype)
        tensors[name + "_shape"] = torch.tensor(w.shape)
    save_file(tensors, file, metadata={"format": "pt"})
    return len(names)


def _quantize_experts_if_they_fit(path: str, bits: int, args, gptq: bool) -> None:  # noqa: ANN001
    """A MoE's experts quantized as the checkpoint's layers are (`quantize_experts`), as
    real quantized MoE checkpoints store them, where their sizes are whole groups (and, for
    GPTQ, whole words); else left in 16 bits, with a line saying why."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        trial = os.path.join(tmp, "trial")
        shutil.copytree(path, trial)
        try:
            count = quantize_experts(trial, bits, args.group_size or None,
                                     act_order=args.act_order,
                                     int8=args.quantization == "w8a8")  # fmt: skip
            if gptq:
                _check_whole_words(trial, bits)
        except (RuntimeError, ValueError) as exc:
            print(f"the MoE experts stay 16-bit ({exc}); for quantized experts choose "
                  "--moe-intermediate-size and --hidden-size multiples of the group size"
                  f"{' and of 8' if gptq and bits == 4 else ''}")  # fmt: skip
            return
        shutil.copy(os.path.join(trial, "model.safetensors"), path)
    print(f"{count} expert matrices quantized")


def _check_whole_words(path: str, bits: int) -> None:
    """ValueError unless every packed matrix's input columns are whole int32 words (GPTQ's
    layout packs them along K)."""
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if name.endswith(".weight_shape"):
                columns = int(f.get_tensor(name)[1])
                if columns % (32 // bits):
                    base = name.removesuffix(".weight_shape")
                    raise ValueError(f"{base}: {columns} input columns are not whole "
                                     f"{32 // bits}-integer words")  # fmt: skip


def to_awq(path: str) -> int:
    """Rewrite a 4-bit compressed-tensors checkpoint with zero points (`quantize_checkpoint(...,
    symmetric=False)`) in place as an AutoAWQ GEMM one: per layer `qweight` [in, out / 8],
    `qzeros` [groups, out / 8] (integers 0 .. 15, output columns packed in AWQ's nibble
    order) and `scales` [groups, out], config `quant_method: "awq"`; returns the layers."""
    import json

    from safetensors.torch import load_file, save_file

    from engine.checkpoint_parts import AWQ_NIBBLE
    from engine.layers.int_weight import unpack_zero_points
    from kernels.int_gemm import pack_int, unpack_int

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    if weights["num_bits"] != 4 or weights["symmetric"] or weights["strategy"] != "group":
        raise ValueError("to_awq: a 4-bit checkpoint with zero points per group")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    count = 0
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        base = name.removesuffix(".weight_packed")
        rows, cols = tensors.pop(base + ".weight_shape").tolist()
        q = unpack_int(tensors.pop(name), 4, cols)  # [out, in], 0 .. 15
        scale = tensors.pop(base + ".weight_scale")
        zero = unpack_zero_points(tensors.pop(base + ".weight_zero_point"), 4, rows) + 8
        tensors[base + ".qweight"] = pack_int(q.t(), 4, AWQ_NIBBLE)
        tensors[base + ".qzeros"] = pack_int(zero.t(), 4, AWQ_NIBBLE)  # [groups, out], 0 .. 15
        tensors[base + ".scales"] = scale.t().contiguous()
        count += 1
    save_file(tensors, file, metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": "awq", "bits": 4,
                                     "group_size": weights["group_size"], "zero_point": True,
                                     "version": "gemm", "modules_to_not_convert": None}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return count


def to_gptq(path: str, act_order: bool = False, layout: str = "gptq") -> int:
    """Rewrite a 4- or 8-bit compressed-tensors checkpoint (`quantize_checkpoint`, with the same
    `act_order`) in place as a GPTQ one (AutoGPTQ's / GPTQModel's layout): per layer `qweight`
    [in / w, out] (w integers of 0 .. 2^bits - 1 a word, input rows packed, low bits first),
    `qzeros` [groups, out / w] (output columns packed alike; zero points stored less one in
    the "gptq" layout, as they are in "gptq_v2"; 2^(bits-1) when symmetric), `scales`
    [groups, out] and `g_idx` [in] (each input row's group: i // group_size, or with
    `act_order` the group of its place in `column_order`); config `quant_method: "gptq"`.
    Returns the layers."""
    import json

    from safetensors.torch import load_file, save_file

    from engine.layers.int_weight import unpack_zero_points
    from kernels.int_gemm import pack_int, unpack_int

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    bits, symmetric = weights["num_bits"], weights["symmetric"]
    middle, file = 1 << (bits - 1), os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    count = 0
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        base = name.removesuffix(".weight_packed")
        rows, cols = tensors.pop(base + ".weight_shape").tolist()
        group = weights["group_size"] or cols
        q = unpack_int(tensors.pop(name), bits, cols)  # [out, in], 0 .. 2^bits - 1
        scale = tensors.pop(base + ".weight_scale")  # [out, groups]
        zero = torch.full_like(scale, middle, dtype=torch.int32)
        if not symmetric:
            zero = unpack_zero_points(tensors.pop(base + ".weight_zero_point"), bits, rows)
            zero = zero.to(torch.int32) + middle
        g_idx = torch.arange(cols, dtype=torch.int32) // group
        if act_order:  # (column j of q is the input's column order[j])
            order = column_order(base, cols)
            q, g_idx = q[:, torch.argsort(order)], g_idx[torch.argsort(order)]
        stored = zero - (1 if layout == "gptq" else 0)
        if bool((stored < 0).any()):
            raise ValueError(f"{base}: a zero point of 0 cannot be stored in the 'gptq' layout "
                             "(it stores them less one); use 'gptq_v2'")  # fmt: skip
        tensors[base + ".qweight"] = pack_int(q, bits).t().contiguous()
        tensors[base + ".qzeros"] = pack_int(stored.t().contiguous(), bits)
        tensors[base + ".scales"] = scale.t().contiguous()
        tensors[base + ".g_idx"] = g_idx
        count += 1
    save_file(tensors, file, metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": bits, "group_size": weights["group_size"] or -1,
        "desc_act": act_order, "sym": symmetric, "checkpoint_format": layout,
        "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return count


def _scales(
    w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest scales [out, groups] (and zero points) of a weight [out, in]."""
    rows, cols = w.shape
    g = w.view(rows, -1, group_size or cols)
    top = (1 << (bits - 1)) - 1  # 7 for 4 bits
    if symmetric:
        return g.abs().amax(-1).clamp_min(1e-8) / (top + 0.5), None
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / ((1 << bits) - 1)).clamp_min(1e-8)
    zero = (-(top + 1) - torch.round(lo / scale)).clamp(-(top + 1), top)
    return scale, zero


def add_args(parser) -> None:  # noqa: ANN001 - an argparse parser
    parser.add_argument(
        "--group-size", type=int, default=16,
        help="with --quantization w4a16 / w8a16: one scale per N input columns (0: per "
        "output channel)",
    )  # fmt: skip
    parser.add_argument(
        "--asymmetric", action="store_true",
        help="with --quantization w4a16 / w8a16 / gptq: a zero point per group",
    )  # fmt: skip
    parser.add_argument(
        "--act-order", action="store_true",
        help="with --quantization gptq / gptq-int8: activation ordering (desc_act; each "
        "layer's groups of columns in a g_idx)",
    )  # fmt: skip


def apply(args, path: str) -> None:  # noqa: ANN001 - the parsed arguments
    awq = args.quantization == "awq"  # (4 bits with zero points, then AutoAWQ's layout)
    gptq = (args.quantization or "").startswith("gptq")
    bits = 4 if awq else SCHEMES.get(args.quantization or "")
    if bits is None:
        return
    if awq and not args.group_size:
        raise SystemExit("--quantization awq: groups (--group-size N > 0)")
    if args.act_order and not gptq:
        raise SystemExit("--act-order is for --quantization gptq / gptq-int8")
    if args.arch in ("bert", "xlm-roberta"):
        raise SystemExit(f"--quantization {args.quantization}: decoder models only")
    if args.group_size < 0:
        raise SystemExit("--group-size must be >= 0")
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise SystemExit(f"--quantization {args.quantization} needs the compressed-tensors "
                         "package (pip install compressed-tensors)") from None  # fmt: skip
    quantize_checkpoint(path, bits, args.group_size or None, not (args.asymmetric or awq),
                        act_order=args.act_order,
                        activations=args.quantization == "w8a8")  # fmt: skip
    from services.tiny_model import MOE_ARCHS

    if args.arch in MOE_ARCHS and not (args.asymmetric or awq):  # (the experts too)
        _quantize_experts_if_they_fit(path, bits, args, gptq)
    if awq:
        to_awq(path)
    if gptq:  # (GPTQ's own layout stores zero points less one; one of 0 needs its v2)
        try:
            to_gptq(path, args.act_order)
        except ValueError as exc:
            print(f"{exc}: written as checkpoint_format 'gptq_v2'")
            to_gptq(path, args.act_order, "gptq_v2")
