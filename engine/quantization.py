"""FP8 weights: which a model runs with, and the module swap that applies it.

* An FP8 checkpoint (config.json `quantization_config.quant_method: "fp8"`: Qwen3-*-FP8,
  DeepSeek-V3 style, transformers' FineGrainedFP8) loads its float8 weights as stored, with
  their `weight_scale_inv` block scales (`weight_block_size`, e.g. 128 x 128) or per-tensor
  `weight_scale`s (held per output channel, so stacked q/k/v keep their own). Activations are
  scaled per token (and block column) as they come: a checkpoint's static `input_scale`s are
  not used (`activation_scheme: static` runs as dynamic, as precise or more).
* `--quantization fp8` on a 16/32-bit checkpoint (vLLM's and SGLang's online FP8): once
  loaded, each linear layer of the transformer blocks is quantized per output channel.

Either way the quantized layers are the blocks' projections (`engine.layers.fp8.Fp8Linear`);
embeddings, the LM head, norms, MoE routers and experts stay in the model dtype (an FP8
checkpoint's expert weights are dequantized as they load), as do the modules the config's
`modules_to_not_convert` / `ignored_layers` name.

Integer weights (W4A16 / W8A16, `engine.layers.int_weight.IntWeightLinear`): a
compressed-tensors checkpoint (`quant_method: "compressed-tensors"`, format
"pack-quantized": llm-compressor's W4A16 / W8A16 schemes) loads its packed 4- or 8-bit
weights as stored, with their group (or channel) scales and, asymmetric, zero points; the
blocks' linear layers run on them, and so do MoE experts that the checkpoint stores packed
(`engine.layers.int_experts.IntExpertWeights`, the grouped GEMMs' integer path); the rest
as for FP8 (routers and other quantized weights dequantized as they load, the config's
`ignore` list left in the model dtype). compressed-tensors' "int-quantized" W8A8 (int8 weights per
channel, activations per token) runs on `engine.layers.int8.Int8Linear`. compressed-tensors'
activation ordering (`actorder: group`, a `weight_g_idx` per column), FP8 activation schemes
and its other formats are refused. AutoAWQ (GEMM) and GPTQ checkpoints are repacked into the
same layers as they load (`pair_awq_weights`, `pair_gptq_weights`; GPTQ's activation
ordering too, its columns sorted by group and the layer's input permuted alike). The other
methods (bitsandbytes, MXFP4 but gpt-oss's experts...) are refused with their name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.layers.fp8 import QuantizedWeight

# The FP8 layer (and with it Triton) is imported where a model is quantized, not here: the
# CLI of every service reads QUANTIZATION_METHODS.
# `--quantization` of a checkpoint's own method (vLLM's flag names it): checked against it
CHECKPOINT_METHODS = ("awq", "gptq", "compressed-tensors")
QUANTIZATION_METHODS = ("fp8", *CHECKPOINT_METHODS)
_IN_BLOCK = re.compile(r"(^|\.)(layers|layer|h)\.\d+\.")  # a transformer block's module
_ROUTERS = ("gate", "shared_expert_gate")  # MoE routing logits: kept precise, as vLLM does
# static activation scales (unused: activations are scaled as they come); KV-cache scales never
# get here, the loader takes them first (engine/mem_cache/kv_quant.take_kv_scales)
_DROPPED = (".input_scale",)


@dataclass(frozen=True)
class Fp8Config:
    checkpoint: bool  # the weights are stored in float8 (else quantized once loaded)
    block: tuple[int, int] | None = None  # weight_block_size; None: per output channel
    skip: tuple[str, ...] = ()  # module names left unquantized

    def swap(self, model: nn.Module, checkpoint: str | None = None) -> int:
        """The quantized layers swapped in, empty, for a checkpoint to fill (meta model)."""
        return swap_in_fp8(model, self)

    def pair(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """A checkpoint's tensors with each quantized weight's parts joined."""
        return pair_fp8_scales(weights, self.block)


@dataclass(frozen=True)
class IntWeightConfig:
    """A compressed-tensors pack-quantized checkpoint: `bits`-bit weights, a scale per `group`
    input columns (None: per output channel), zero points unless `symmetric`."""

    bits: int
    group: int | None
    symmetric: bool
    skip: tuple[str, ...] = ()  # the config's `ignore`: module names, or "re:" patterns
    checkpoint: bool = True
    # "compressed-tensors"; "awq": AutoAWQ's GEMM tensors, "gptq" / "gptq_v2": GPTQ's (zero
    # points stored less one / as they are), both repacked as they load
    layout: str = "compressed-tensors"
    act_order: bool = False  # GPTQ's desc_act: the columns' groups in a g_idx

    def swap(self, model: nn.Module, checkpoint: str | None = None) -> int:
        """The integer layers swapped in, empty, for the checkpoint in `checkpoint` to fill
        (meta model); its experts too where it stores them packed."""
        from engine.layers.int_weight import IntWeightLinear

        names = quantized_linear_names(model, self)
        for name in names:
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            linear = getattr(owner, attr)
            setattr(owner, attr, IntWeightLinear.like(linear, self.bits, self.group,
                                                      self.symmetric, self.act_order))  # fmt: skip
        return len(names) + self._swap_experts(model, checkpoint)

    def _swap_experts(self, model: nn.Module, checkpoint: str | None) -> int:
        """The MoE layers' experts kept as integers too (`IntExpertWeights`) where the
        checkpoint stores them packed (a config's targets say Linear layers, and transformers'
        fused experts are none: their checkpoints hold them in 16 bits), unless the config
        leaves them out or orders their columns (GPTQ's desc_act: each expert's own order,
        which the grouped GEMM cannot take). Other quantized experts are dequantized as they
        load."""
        from engine.layers.int_experts import IntExpertWeights
        from engine.layers.moe import FusedMoE

        if self.act_order or checkpoint is None or not _packed_experts(checkpoint, self.parts):
            return 0
        layers = [(name, module) for name, module in model.named_modules()
                  if isinstance(module, FusedMoE) and _IN_BLOCK.search(name)]  # fmt: skip
        count = 0
        for name, module in layers:
            # (a checkpoint names expert e's matrices experts.{e}.gate_proj, or w1 / w3 / w2)
            parts = [f"{name}.0.{p}" for p in ("gate_proj", "up_proj", "down_proj", "w1")]
            if any(_skipped(part, s) for part in parts for s in self.skip):
                continue
            for attr in ("w13", "w2"):
                experts = getattr(module, attr)
                setattr(module, attr, IntExpertWeights.like(experts, self.bits, self.group,
                                                            self.symmetric))  # fmt: skip
            count += 1
        return count

    def pair(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
        if self.layout == "awq":
            return pair_awq_weights(weights, self)
        if self.layout in GPTQ_LAYOUTS:
            return pair_gptq_weights(weights, self)
        return pair_int_weights(weights, self)

    @property
    def parts(self) -> tuple[str, ...]:
        """The checkpoint tensors a quantized layer's weight is stored as."""
        if self.layout in GPTQ_LAYOUTS:
            return GPTQ_PARTS
        return AWQ_PARTS if self.layout == "awq" else INT_PARTS

    def describe(self) -> str:
        groups = f"groups of {self.group}" if self.group else "per channel"
        zero = "symmetric" if self.symmetric else "with zero points"
        order = ", activation order" if self.act_order else ""
        return f"{self.bits}-bit ({groups}, {zero}{order})"


_EXPERT_PART = re.compile(r"\.experts\.\d+\.[^.]+\.([^.]+)$")


def _packed_experts(checkpoint: str, parts: tuple[str, ...]) -> bool:
    """Whether the checkpoint folder stores some expert's matrix as quantized parts (the
    tensor names only: a sharded checkpoint's index, or the file's header)."""
    import json
    import os

    from safetensors import safe_open

    from engine.loader import safetensors_files

    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = list(json.load(f)["weight_map"])
    else:
        names = []
        for file in safetensors_files(checkpoint):
            with safe_open(file, framework="pt", device="cpu") as f:
                names.extend(f.keys())
    return any((m := _EXPERT_PART.search(n)) and m.group(1) in parts for n in names)


@dataclass(frozen=True)
class Int8Config:
    """A compressed-tensors "int-quantized" W8A8 checkpoint: int8 weights with a scale per
    output channel, activations quantized to int8 per token as they come (a checkpoint's
    static input scales are not used, as for FP8: per token is as precise or more)."""

    skip: tuple[str, ...] = ()
    checkpoint: bool = True
    layout: str = "w8a8"

    def swap(self, model: nn.Module, checkpoint: str | None = None) -> int:
        from engine.layers.int8 import Int8Linear

        names = quantized_linear_names(model, self)
        for name in names:
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, attr, Int8Linear.like(getattr(owner, attr)))
        return len(names)

    def pair(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
        return pair_int8_weights(weights)

    @property
    def parts(self) -> tuple[str, ...]:
        return ("weight_scale",)

    def describe(self) -> str:
        return "8-bit integer weights and activations (W8A8, per channel and per token)"


QuantConfig = Fp8Config | IntWeightConfig | Int8Config


def pair_int8_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, object]]:
    """A W8A8 checkpoint's tensors with each int8 weight joined to its `weight_scale` ([N] or
    [N, 1]; they may come in either order) as one `Int8Weight`; static input scales
    dropped."""
    from engine.layers.int8 import Int8Weight

    waiting: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(_DROPPED):
            continue
        if name.endswith(".weight_scale"):
            base = name.removesuffix("_scale")
            if base in waiting:
                yield base, Int8Weight(waiting.pop(base), tensor.reshape(-1).float())
            else:
                scales[base] = tensor
        elif tensor.dtype == torch.int8 and name.endswith(".weight"):
            if name in scales:
                yield name, Int8Weight(tensor, scales.pop(name).reshape(-1).float())
            else:
                waiting[name] = tensor
        else:
            yield name, tensor
    if waiting or scales:
        raise ValueError("W8A8 checkpoint: int8 weights without a scale or the reverse: "
                         f"{(sorted(waiting) + sorted(scales))[:5]}")  # fmt: skip


def _w8a8_config(qc: dict, group: dict) -> Int8Config:
    """The W8A8 int scheme of a compressed-tensors config group that quantizes activations;
    ValueError, with the reason, for the ones it cannot run."""
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    if group.get("output_activations"):
        raise ValueError("compressed-tensors: quantized outputs are not supported")
    if a.get("type", "int") != "int" or w.get("type", "int") != "int":
        raise ValueError("compressed-tensors: quantized activations of type "
                         f"{a.get('type')!r} (FP8 schemes) are not supported; int8 W8A8 "
                         "and weight-only W4A16 / W8A16 are")  # fmt: skip
    if (w.get("num_bits"), a.get("num_bits")) != (8, 8):
        raise ValueError(f"compressed-tensors W{w.get('num_bits')}A{a.get('num_bits')}: "
                         "integer activations run with 8-bit weights and activations "
                         "(W8A8)")  # fmt: skip
    if not w.get("symmetric", True) or not a.get("symmetric", True):
        raise ValueError("compressed-tensors W8A8 with zero points (asymmetric weights or "
                         "activations) is not supported")  # fmt: skip
    if w.get("strategy") != "channel":
        raise ValueError(f"compressed-tensors W8A8 weight strategy {w.get('strategy')!r}: "
                         "'channel' is supported")  # fmt: skip
    if a.get("strategy", "token") not in ("token", "tensor"):
        raise ValueError(f"compressed-tensors W8A8 activation strategy {a.get('strategy')!r}: "
                         "per token (or a static tensor scale, run per token) is "
                         "supported")  # fmt: skip
    return Int8Config(tuple(qc.get("ignore") or ()))


def awq_config(qc: dict) -> IntWeightConfig:
    """The setup of an AutoAWQ checkpoint (`quant_method: "awq"`, its GEMM version: Qwen's
    and most `*-AWQ` models): 4-bit weights with a zero point per group, repacked as they
    load into the integer layers' layout; ValueError for the versions it cannot run."""
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r}: only the 'gemm' layout is supported")
    bits, group = qc.get("bits", qc.get("w_bit", 4)), qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"AWQ with {bits}-bit weights: 4-bit is supported")
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"AWQ group_size {group!r}: per-group checkpoints are supported")
    # (AutoAWQ leaves out every module whose name contains one of these)
    skip = tuple(f"re:.*{re.escape(m)}" for m in qc.get("modules_to_not_convert") or ())
    return IntWeightConfig(4, group, not qc.get("zero_point", True), skip, layout="awq")


GPTQ_LAYOUTS = ("gptq", "gptq_v2")


def gptq_config(qc: dict) -> IntWeightConfig:
    """The setup of a GPTQ checkpoint (`quant_method: "gptq"`: AutoGPTQ's and GPTQModel's,
    the `*-GPTQ-Int4` / `-Int8` models): 4- or 8-bit weights with a scale and zero point per
    group (or per channel, `group_size: -1`), `desc_act` (activation ordering: each column's
    group in a `g_idx`), repacked as they load; ValueError for what it cannot run."""
    bits, group = qc.get("bits"), qc.get("group_size", 128)
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with {bits}-bit weights: 4- and 8-bit are supported")
    layout = str(qc.get("checkpoint_format") or "gptq").lower()
    if layout not in GPTQ_LAYOUTS:
        raise ValueError(f"GPTQ checkpoint_format {layout!r}: {GPTQ_LAYOUTS} are supported "
                         "(repacked kernels' formats, Marlin and others, are not)")  # fmt: skip
    if not isinstance(group, int) or not (group == -1 or group >= 1):
        raise ValueError(f"GPTQ group_size {group!r}: a group size, or -1 (per channel)")
    if qc.get("lm_head"):
        raise ValueError("GPTQ with a quantized LM head (lm_head: true) is not supported")
    skip = []
    for pattern, override in (qc.get("dynamic") or {}).items():
        if not pattern.startswith("-:"):  # (GPTQModel's per-module settings)
            raise ValueError(f"GPTQ dynamic override {pattern!r}: {override!r}: only the "
                             "'-:' entries (modules left unquantized) are supported")  # fmt: skip
        skip.append("re:" + pattern[2:])
    return IntWeightConfig(bits, None if group == -1 else group, bool(qc.get("sym", True)),
                           tuple(skip), layout=layout,
                           act_order=bool(qc.get("desc_act", False)))  # fmt: skip


def checkpoint_scheme(qc: dict | None) -> IntWeightConfig | Int8Config | None:
    """The integer-weight scheme of a config.json's `quantization_config` (None: none)."""
    method = (qc or {}).get("quant_method")
    if method == "compressed-tensors":
        return int_weight_config(qc)  # type: ignore[arg-type]
    if method == "gptq":
        return gptq_config(qc)  # type: ignore[arg-type]
    return awq_config(qc) if method == "awq" else None  # type: ignore[arg-type]


def int_weight_config(qc: dict) -> IntWeightConfig | Int8Config:
    """The W4A16 / W8A16 (or int8 W8A8) setup of a compressed-tensors `quantization_config`;
    ValueError, with the reason, for the schemes it cannot run."""
    groups = list((qc.get("config_groups") or {}).values())
    formats = {g.get("format") or qc.get("format") for g in groups}
    if len(groups) != 1 or "Linear" not in (groups[0].get("targets") or ()):
        raise ValueError("compressed-tensors: one config group targeting Linear layers is "
                         "supported (the W4A16 / W8A16 / W8A8 schemes)")  # fmt: skip
    group = groups[0]
    if formats == {"int-quantized"} and group.get("input_activations"):
        return _w8a8_config(qc, group)
    if formats != {"pack-quantized"}:
        raise ValueError(
            f"compressed-tensors format {sorted(map(str, formats))}: sluice runs "
            "'pack-quantized' checkpoints (W4A16 / W8A16 weights) and 'int-quantized' W8A8 "
            "ones"
        )
    w = group.get("weights") or {}
    if group.get("input_activations") or group.get("output_activations"):
        raise ValueError("compressed-tensors: quantized activations in a 'pack-quantized' "
                         "checkpoint are not supported; weight-only W4A16 / W8A16 are, and "
                         "int8 W8A8 in 'int-quantized' ones")  # fmt: skip
    if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8):
        raise ValueError(f"compressed-tensors weights of {w.get('num_bits')}-bit "
                         f"{w.get('type')}: 4- and 8-bit integers are supported")  # fmt: skip
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors weight strategy {strategy!r}: 'group' and "
                         "'channel' are supported")  # fmt: skip
    if w.get("actorder") == "group":
        raise ValueError("compressed-tensors activation ordering (actorder 'group': a group "
                         "index per column) is not supported")  # fmt: skip
    size = w.get("group_size") if strategy == "group" else None
    if strategy == "group" and (not isinstance(size, int) or size < 1):
        raise ValueError(f"compressed-tensors group strategy without a group_size ({size!r})")
    return IntWeightConfig(int(w["num_bits"]), size, bool(w.get("symmetric", True)),
                           tuple(qc.get("ignore") or ()))  # fmt: skip



# quantization settings in a file of their own, for checkpoints whose config.json has none
# (AutoGPTQ's and early AutoAWQ's): the file -> the method it implies
_SIDECARS = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


def sidecar_quantization_config(path: str) -> dict | None:
    """A model folder's quantization settings from AutoGPTQ's `quantize_config.json` or
    AutoAWQ's `quant_config.json` (None: neither), its `quant_method` filled in."""
    import json
    import os

    for name, method in _SIDECARS.items():
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as f:
                qc = json.load(f)
            return {"quant_method": method, **qc}
    return None


def resolve_quantization(requested: str | None, hf_config: object) -> QuantConfig | None:
    """The quantization of `--quantization requested` on a model of `hf_config` (None:
    none): FP8 (a checkpoint's, or online), or a checkpoint's integer weights."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: {requested!r} not in {QUANTIZATION_METHODS}")
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    method = (qc or {}).get("quant_method")
    if requested in CHECKPOINT_METHODS and requested != method:
        held = f"quantized with {method!r}" if method else "not quantized"
        raise ValueError(f"--quantization {requested}: the checkpoint is {held} (the flag "
                         "names the checkpoint's own method, or fp8 to quantize a 16-bit "
                         "one as it loads)")  # fmt: skip
    if not qc:
        return Fp8Config(checkpoint=False) if requested == "fp8" else None
    if method == "mxfp4" and getattr(hf_config, "model_type", None) == "gpt_oss":
        # gpt-oss's published experts: dequantized as they load (GptOssForCausalLM), run
        # in the model's dtype
        if requested is not None:
            raise ValueError(f"--quantization {requested} on an MXFP4 checkpoint")
        return None
    if method in CHECKPOINT_METHODS:
        if requested is not None and requested != method:
            raise ValueError(f"--quantization {requested} on a {method} checkpoint")
        return checkpoint_scheme(qc)
    if method != "fp8":
        raise ValueError(
            f"the checkpoint is quantized with {method!r}, which sluice does not run "
            f"(it runs FP8 checkpoints, quant_method 'fp8', --quantization fp8 on 16-bit "
            f"ones, compressed-tensors W4A16 / W8A16 ones, AWQ and GPTQ ones)"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 checkpoint format {qc['fmt']!r}: only e4m3 is supported")
    block = qc.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ValueError(f"quantization_config.weight_block_size {block!r}: expected [rows, cols]")
    skip = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ())
    return Fp8Config(checkpoint=True, block=tuple(block) if block else None, skip=skip)


def quantized_linear_names(model: nn.Module, config: QuantConfig) -> list[str]:
    """The linear layers to run quantized: those of the transformer blocks, less MoE routers
    and the modules the checkpoint leaves alone (names, suffixes, or "re:" patterns)."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not _IN_BLOCK.search(name):
            continue
        if name.rsplit(".", 1)[-1] in _ROUTERS + getattr(model, "unquantized_linears", ()):
            continue
        if any(_skipped(name, s) for s in config.skip):
            continue
        names.append(name)
    return names


def _skipped(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.startswith(pattern + ".") or name.endswith("." + pattern)


def swap_in_fp8(model: nn.Module, config: Fp8Config) -> int:
    """Replace the layers of `quantized_linear_names` by `Fp8Linear`s: empty ones for a
    checkpoint to fill (the model still on the meta device), or the loaded weights quantized.
    Returns how many were replaced."""
    from engine.layers.fp8 import Fp8Linear

    names = quantized_linear_names(model, config)
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        linear = getattr(owner, attr)
        if config.checkpoint:
            layer = Fp8Linear.like(linear, config.block)
        else:
            layer = Fp8Linear.quantize(linear, config.block)
        setattr(owner, attr, layer)
    if not config.checkpoint and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the 16-bit weights' memory goes to the KV pool
    return len(names)


def pair_fp8_scales(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] | None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """An FP8 checkpoint's tensors with each float8 weight joined to its scale (they may come
    in either order) as one `QuantizedWeight`; static activation scales dropped."""
    from engine.layers.fp8 import FP8_DTYPE, QuantizedWeight

    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, tuple[torch.Tensor, tuple[int, int] | None]] = {}
    for name, tensor in weights:
        if name.endswith(_DROPPED):
            continue
        if name.endswith((".weight_scale_inv", ".weight_scale")):
            base = name.rsplit(".", 1)[0] + ".weight"
            scale_block = block if name.endswith("_inv") else None
            if scale_block is None and name.endswith("_inv"):
                raise ValueError(f"{name}: block scales without weight_block_size in the config")
            if base in weights_waiting:
                yield base, QuantizedWeight(weights_waiting.pop(base), tensor, scale_block)
            else:
                scales_waiting[base] = (tensor, scale_block)
        elif tensor.dtype == FP8_DTYPE:
            if name in scales_waiting:
                scale, scale_block = scales_waiting.pop(name)
                yield name, QuantizedWeight(tensor, scale, scale_block)
            else:
                weights_waiting[name] = tensor
        else:
            yield name, tensor
    orphans = sorted(weights_waiting) + sorted(scales_waiting)
    if orphans:
        raise ValueError(
            f"FP8 checkpoint: float8 weights without a scale or the reverse: {orphans[:5]}"
        )


INT_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


def _join_parts(
    weights: Iterable[tuple[str, torch.Tensor]],
    parts_of: tuple[str, ...],
    needed: set[str],
    make: Callable[[str, dict[str, torch.Tensor]], object],
    what: str,
) -> Iterator[tuple[str, object]]:
    """A checkpoint's tensors with each layer's quantized parts (`parts_of`, in any order)
    joined, once it has the `needed` ones, into `make(layer, parts)`, yielded as the layer's
    `weight`; the other tensors as they come. ValueError for parts left without the others."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        base, _, part = name.rpartition(".")
        if part not in parts_of:
            yield name, tensor
            continue
        parts = waiting.setdefault(base, {})
        parts[part] = tensor
        if needed <= set(parts):
            del waiting[base]
            yield base + ".weight", make(base, parts)
    if waiting:
        raise ValueError(f"{what}: quantized weights missing parts: {sorted(waiting)[:5]}")


def pair_int_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: IntWeightConfig
) -> Iterator[tuple[str, object]]:
    """A compressed-tensors checkpoint's tensors with each quantized weight's parts (packed
    words, scales, shape, zero points; in any order) joined into one `PackedIntWeight`,
    yielded as the module's `weight`. ValueError for a part without the others, or a
    `weight_g_idx` (activation ordering)."""
    from engine.layers.int_weight import PackedIntWeight, unpack_zero_points

    def make(base: str, parts: dict[str, torch.Tensor]) -> PackedIntWeight:
        rows, columns = (int(v) for v in parts["weight_shape"].tolist())
        scale = parts["weight_scale"]
        group = columns if config.group is None else config.group
        if scale.shape != (rows, -(-columns // group)):
            raise ValueError(f"{base}: scales of shape {tuple(scale.shape)} for a {rows} x "
                             f"{columns} weight in groups of {group}")  # fmt: skip
        zero = parts.get("weight_zero_point")
        if zero is not None:
            zero = unpack_zero_points(zero, config.bits, rows)
        return PackedIntWeight(parts["weight_packed"], scale, zero, config.bits, group, columns)

    needed = set(INT_PARTS[:3]) | (set() if config.symmetric else {"weight_zero_point"})
    return _join_parts(_no_group_index(weights), INT_PARTS, needed, make,
                       "compressed-tensors checkpoint")  # fmt: skip


def _no_group_index(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.endswith(".weight_g_idx"):
            raise ValueError(f"{name}: activation ordering (a group index per column) is not "
                             "supported")  # fmt: skip
        yield name, tensor


# AutoAWQ's GEMM layout packs output columns 8j .. 8j + 7 into word j, nibble i holding column
# (0, 2, 4, 6, 1, 3, 5, 7)[i] of the eight: column c's four bits sit at nibble AWQ_NIBBLE[c % 8]
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)
AWQ_PARTS = ("qweight", "qzeros", "scales")


def pair_awq_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: IntWeightConfig
) -> Iterator[tuple[str, object]]:
    """An AutoAWQ checkpoint's `qweight` [K, N / 8], `qzeros` [K / group, N / 8] and `scales`
    [K / group, N] of each layer (w = (q - z) * s, q and z in 0 .. 15) joined into one
    `PackedIntWeight` of the integer layers' layout: the integers transposed to [N, K] and
    packed along K, zero points signed (z - 8, as the words' offset)."""
    from engine.layers.int_weight import PackedIntWeight
    from kernels.int_gemm import pack_int, unpack_int

    def make(base: str, parts: dict[str, torch.Tensor]) -> PackedIntWeight:
        qweight, scales = parts["qweight"], parts["scales"]
        columns, rows = qweight.shape[0], qweight.shape[1] * 8
        group = config.group or columns
        if scales.shape != (columns // group, rows):
            raise ValueError(f"{base}: AWQ scales of shape {tuple(scales.shape)} for a "
                             f"{columns} x {rows} qweight in groups of {group}")  # fmt: skip
        if qweight.device.type == "meta":  # (a dry run: the shapes only)
            packed = torch.empty(rows, columns // 8, dtype=torch.int32, device="meta")
            zero = None if config.symmetric else torch.empty(rows, columns // group,
                                                             dtype=torch.int8, device="meta")
        else:
            packed = pack_int(unpack_int(qweight, 4, rows, AWQ_NIBBLE).t(), 4)
            zero = None
            if not config.symmetric:
                zero = unpack_int(parts["qzeros"], 4, rows, AWQ_NIBBLE) - 8
                zero = zero.to(torch.int8).t().contiguous()
        return PackedIntWeight(packed, scales.t().contiguous(), zero, 4, group, columns)

    needed = {"qweight", "scales"} | (set() if config.symmetric else {"qzeros"})
    return _join_parts(weights, AWQ_PARTS, needed, make, "AWQ checkpoint")


GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def pair_gptq_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: IntWeightConfig
) -> Iterator[tuple[str, object]]:
    """A GPTQ checkpoint's `qweight` [K / w, N] (input rows packed w to a word, lowest bits
    first), `qzeros` [groups, N / w] (output columns packed alike; stored less one in the
    "gptq" format, as they are in "gptq_v2"), `scales` [groups, N] and, with activation
    ordering, `g_idx` [K] (each input row's group) of each layer (w = (q - z) * s) joined
    into one `PackedIntWeight` of the integer layers' layout: the integers as [N, K] packed
    along K (GPTQ's words, transposed), zero points signed (z - 2^(bits-1)); with `g_idx`,
    the columns sorted by group and the order kept (`perm`). Without activation ordering a
    g_idx must be i // group_size, as AutoGPTQ writes it there."""
    from engine.layers.int_weight import PackedIntWeight
    from kernels.int_gemm import pack_int, unpack_int

    bits = config.bits
    per_word, middle = 32 // bits, 1 << (bits - 1)
    offset = 1 if config.layout == "gptq" else 0

    def make(base: str, parts: dict[str, torch.Tensor]) -> PackedIntWeight:
        qweight, scales = parts["qweight"], parts["scales"]
        columns, rows = qweight.shape[0] * per_word, qweight.shape[1]
        group = config.group or columns
        if scales.shape != (-(-columns // group), rows):
            raise ValueError(f"{base}: GPTQ scales of shape {tuple(scales.shape)} for a "
                             f"{columns} x {rows} weight in groups of {group}")  # fmt: skip
        g_idx = parts.get("g_idx")
        meta = qweight.device.type == "meta"  # (a dry run: the shapes only)
        perm = _group_order(base, g_idx, group) if g_idx is not None and not meta else None
        if meta:
            packed = torch.empty(rows, columns // per_word, dtype=torch.int32, device="meta")
            zero = None if config.symmetric else torch.empty(rows, scales.shape[0],
                                                             dtype=torch.int8, device="meta")
            perm = None if g_idx is None else torch.empty(columns, dtype=torch.int64,
                                                           device="meta")
            return PackedIntWeight(packed, scales.t(), zero, bits, group, columns, perm)
        packed = qweight.t().contiguous()  # (row n's words hold its columns, in order)
        if perm is not None:
            packed = pack_int(unpack_int(packed, bits, columns)[:, perm], bits)
        zero = unpack_int(parts["qzeros"], bits, rows).to(torch.int16) + offset - middle
        if config.symmetric:
            if bool((zero != 0).any()):
                raise ValueError(f"{base}: a symmetric GPTQ checkpoint (sym: true) whose zero "
                                 f"points are not {middle}")  # fmt: skip
            zero = None
        elif int(zero.max()) > 127:
            raise ValueError(f"{base}: GPTQ zero point {int(zero.max()) + middle} is out of "
                             f"the {bits}-bit range")  # fmt: skip
        else:
            zero = zero.to(torch.int8).t().contiguous()
        return PackedIntWeight(packed, scales.t().contiguous(), zero, bits, group, columns, perm)

    needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if config.act_order else set())
    if not config.act_order:
        weights = _groups_in_order(weights, config.group)
    return _join_parts(weights, GPTQ_PARTS, needed, make, "GPTQ checkpoint")


def _groups_in_order(
    weights: Iterable[tuple[str, torch.Tensor]], group: int | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """A GPTQ checkpoint without activation ordering: its g_idx dropped (AutoGPTQ writes i //
    group_size), after checking that it is that; ValueError where it orders the columns."""
    for name, tensor in weights:
        if not name.endswith(".g_idx"):
            yield name, tensor
        elif tensor.device.type != "meta":
            in_order = torch.arange(tensor.shape[0]) // (group or tensor.shape[0])
            if not torch.equal(tensor.to(torch.int64), in_order):
                raise ValueError(f"{name}: the columns are ordered by group, but the config "
                                 "has no activation ordering (desc_act: false)")  # fmt: skip


def _group_order(base: str, g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """The input columns sorted by their group (None: already in order); ValueError unless
    each group has `group` columns, as GPTQ's activation ordering makes them."""
    columns = g_idx.shape[0]
    in_order = torch.arange(columns) // group
    g_idx = g_idx.to(torch.int64)
    if torch.equal(g_idx, in_order):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], in_order):
        raise ValueError(f"{base}: g_idx does not give each group {group} columns")
    return perm
