"""GPTQ checkpoints (`quant_method: "gptq"`, AutoGPTQ's and GPTQModel's layout; repacked as
they load into the integer layers, engine/checkpoint_parts.pair_gptq_weights).

The checkpoints are written by services/tiny_int_weight.to_gptq from compressed-tensors ones.
That the tensors are GPTQ's layout is checked against another project's reading and writing
of it: auto-round's torch GPTQ layer (`auto_round_extension.torch`, `QuantLinear`: its
`pack` and its dequantizing `forward`, with and without `g_idx`) must give the same words
from the same weights and read back the weights compressed-tensors unpacks. The engine's
greedy tokens are transformers' on those weights: 4- and 8-bit, groups and channels,
symmetric and with zero points, both zero-point layouts ("gptq" stores them less one,
"gptq_v2" as they are), and activation ordering (desc_act: each layer's groups of columns in
a g_idx, the layer's columns sorted by group as they load); the settings in AutoGPTQ's
`quantize_config.json` beside a config.json without them; what it cannot run is refused
with the reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import sys
import types

import pytest
import torch

from engine.engine import Engine
from tests.factories import (
    assert_greedy_match,
    config_variant,
    dequantized_copy,
    hf_greedy,
    mixed_prompts,
    packed_experts_served,
    tiny_gptq_model,
    tiny_int_weight_model,
)

NEW = 10
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
PROMPTS = mixed_prompts(1500, n=3, max_len=40, seed=7)
CASES = {  # id: (arch, bits, group, symmetric, act_order, layout)
    "llama-4bit-g16": ("llama", 4, 16, True, False, "gptq"),
    "llama-4bit-g16-zero-points": ("llama", 4, 16, False, False, "gptq"),
    "qwen3-8bit-channel-v2": ("qwen3", 8, None, False, False, "gptq_v2"),
    "llama-4bit-g16-act-order": ("llama", 4, 16, True, True, "gptq"),
    "qwen2-4bit-g16-act-order-zero-points": ("qwen2", 4, 16, False, True, "gptq"),
}


def _reference(case: str, tmp_path) -> tuple[str, str]:
    """(the GPTQ checkpoint, a float one of the weights compressed-tensors unpacks from the
    checkpoint it was written from)."""
    arch, bits, group, symmetric, act_order, layout = CASES[case]
    path = tiny_gptq_model(arch, bits, group, symmetric, act_order, layout)
    source = tiny_int_weight_model(arch, bits, group, symmetric, act_order=act_order)
    return path, dequantized_copy(source, str(tmp_path / "reference"), act_order)


def _auto_round_layer(layout: str) -> type:
    """auto-round's torch GPTQ layer for `layout`: `qlinear_torch_zp` stores zero points less
    one (GPTQ's own layout), `qlinear_torch` as they are (v2). Imported without auto_round's
    package __init__, which imports `datasets` (not installed here): the layer takes from
    auto_round.utils only its bit_packing module (imported for real) and a device pick."""
    if "auto_round.utils" not in sys.modules:
        spec = importlib.util.find_spec("auto_round")
        if spec is None:
            pytest.skip("auto-round is not installed (pip install --no-deps auto-round==0.16.1)")
        root = os.path.dirname(spec.origin)
        package = types.ModuleType("auto_round")
        package.__path__ = [root]
        utils = types.ModuleType("auto_round.utils")
        utils.__path__ = [os.path.join(root, "utils")]
        utils.get_packing_device = lambda device=None: torch.device("cpu")
        sys.modules.update({"auto_round": package, "auto_round.utils": utils})
    name = "qlinear_torch_zp" if layout == "gptq" else "qlinear_torch"
    return importlib.import_module(f"auto_round_extension.torch.{name}").QuantLinear


@pytest.mark.parametrize("case", list(CASES))
def test_layout_is_gptq_as_auto_round_reads_and_writes_it(case: str, tmp_path) -> None:
    """Every quantized layer: auto-round's layer on the checkpoint's `qweight` / `qzeros` /
    `scales` / `g_idx` dequantizes to the reference weights exactly; and, without activation
    ordering (its `pack` ignores g_idx), packs those weights, scales and zero points into the
    same words (the layers with whole 32-column blocks, as its packing needs)."""
    from safetensors.torch import load_file

    _, bits, group, symmetric, act_order, layout = CASES[case]
    path, reference = _reference(case, tmp_path)
    layer_type = _auto_round_layer(layout)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    want = load_file(os.path.join(reference, "model.safetensors"))
    bases = [n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")]
    assert len(bases) == 7 * 2  # q, k, v, o, gate, up, down in each of two blocks
    checked = 0
    for base in bases:
        weight = want[base + ".weight"]
        rows, columns = weight.shape
        if act_order and rows > columns:  # (its g_idx path takes the first `columns` output
            continue  # columns' scales only: gate/up of the tiny model's 64 -> 176 features)
        checked += 1
        layer = layer_type(bits, group or -1, columns, rows, False, g_idx=act_order)
        layer.qweight, layer.qzeros = tensors[base + ".qweight"], tensors[base + ".qzeros"]
        layer.scales = tensors[base + ".scales"].float()
        if act_order:
            layer.g_idx = tensors[base + ".g_idx"]
        assert torch.equal(layer(torch.eye(columns)).t(), weight), base
        if act_order or columns % 32 or rows % 32:  # (its packing takes whole 32-column
            continue  # blocks: not the tiny model's 176 MLP features)
        scales = tensors[base + ".scales"].float().t()
        middle = 1 << (bits - 1)
        zeros = torch.full_like(scales, middle) if symmetric else None
        if zeros is None:  # (the checkpoint's, unpacked: z = (z - 1) + 1 in GPTQ's layout)
            zeros = _unpack_columns(tensors[base + ".qzeros"], bits).t().float()
            zeros += 1 if layout == "gptq" else 0
        packer = layer_type(bits, group or -1, columns, rows, False)
        packer.device = torch.device("cpu")  # (v2's pack reads it; its constructor sets none)
        packer.pack(_linear(weight), scales, zeros)
        assert torch.equal(packer.qweight, tensors[base + ".qweight"]), base
        assert torch.equal(packer.qzeros, tensors[base + ".qzeros"]), base
        checked += 1
    assert checked >= (10 if act_order else 14 + 8)  # (read all; packed q, k, v, o)


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return linear


def _unpack_columns(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C * bits / 32] int32 -> [R, C], low bits first (GPTQ's qzeros)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers(case: str, tmp_path) -> None:
    """(transformers does not load GPTQ checkpoints without gptqmodel: its tokens are those of
    the float reference.) With activation ordering the layers keep the order they sort the
    input by."""
    from engine.layers.int_weight import IntWeightLinear

    path, reference = _reference(case, tmp_path)
    with Engine(model_path=path, disable_overlap_schedule=True) as engine:
        layers = [m for m in engine.scheduler.model_runner.model.modules()
                  if isinstance(m, IntWeightLinear)]  # fmt: skip
        assert len(layers) == 4 * 2
        act_order = CASES[case][4]
        assert all((m.input_perm is not None) == act_order for m in layers)
        if act_order:
            assert not torch.equal(layers[0].input_perm.long(), torch.arange(layers[0].in_features))
        outs = engine.generate(input_ids=PROMPTS, sampling_params=[GREEDY] * len(PROMPTS))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert_greedy_match(reference, prompt, out["output_ids"],
                            hf_greedy(reference, prompt, NEW))  # fmt: skip


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][4]])
def test_activation_ordering_over_two_ranks(case: str, tmp_path) -> None:
    """Over two ranks a row-parallel layer (o_proj, down_proj) with activation ordering takes
    its half of the input's columns in the input's order, each column's group among all of
    the weight's (`PackedIntWeight.narrow`, `IntWeightLinear.weight_gidx`: no whole groups
    needed, 88 of Llama's 176 MLP features a rank in groups of 16); the column-parallel ones
    keep their input order as on one rank. The float reference's tokens."""
    path, reference = _reference(case, tmp_path)
    with Engine(model_path=path, tp_size=2) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=[GREEDY] * len(PROMPTS))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert_greedy_match(reference, prompt, out["output_ids"],
                            hf_greedy(reference, prompt, NEW))  # fmt: skip


def test_make_tiny_model_writes_it_and_quantize_config_json_is_read(tmp_path) -> None:
    """`make-tiny-model --quantization gptq --act-order` writes the checkpoint the tests
    use; moved from config.json to AutoGPTQ's `quantize_config.json` (no quant_method: its
    file says it), its settings are read from there, and it serves the same tokens."""
    from argparse import Namespace

    from safetensors.torch import load_file

    from services.tiny_int_weight import apply
    from tests.factories import tiny_model

    path = str(tmp_path / "cli")
    shutil.copytree(tiny_model("llama"), path)
    apply(Namespace(quantization="gptq", group_size=16, asymmetric=False, act_order=True,
                    arch="llama"), path)  # fmt: skip
    factory = tiny_gptq_model("llama", 4, 16, True, act_order=True)
    written, want = (load_file(os.path.join(p, "model.safetensors")) for p in (path, factory))
    assert sorted(written) == sorted(want)
    assert all(torch.equal(written[n], want[n]) for n in want)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    settings = config.pop("quantization_config")
    assert settings["desc_act"] and settings["checkpoint_format"] == "gptq"
    del settings["quant_method"]
    with open(config_file, "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "quantize_config.json"), "w") as f:
        json.dump(settings, f)
    reference = dequantized_copy(tiny_int_weight_model("llama", 4, 16, True, act_order=True),
                                 str(tmp_path / "reference"), act_order=True)  # fmt: skip
    with Engine(model_path=path, disable_overlap_schedule=True) as engine:
        scheme = engine.scheduler.model_runner.quantization
        assert (scheme.layout, scheme.act_order, scheme.bits) == ("gptq", True, 4)
        out = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert_greedy_match(reference, PROMPTS[0], out["output_ids"],
                        hf_greedy(reference, PROMPTS[0], NEW))  # fmt: skip


def test_experts_with_activation_ordering_stay_packed(tmp_path) -> None:
    """A Qwen3-MoE GPTQ checkpoint with activation ordering whose experts are quantized too
    (8-bit, groups of 4: the experts' 44 features are whole words; each expert's g_idx
    orders its columns, gate and up alike, as GPTQ orders columns by their input): the
    experts stay packed, each with its input order (`IntExpertWeights.input_perm`: the
    grouped GEMMs gather the input's columns in it, the torch path puts the dequantized
    columns back), and the tokens are those of the float weights; over two ranks too, each
    holding half of every expert's down projection's columns (22 of 44: not whole groups nor
    whole words) in the input's order with each column's group (`IntExperts.gidx`), or half
    of the experts, whole. An expert whose up projection orders its columns unlike its gate
    is refused. `make-tiny-model` writes the same checkpoint."""
    from argparse import Namespace

    from safetensors.torch import load_file, save_file

    from engine.layers.int_experts import IntExpertWeights
    from engine.layers.moe import ExpertWeights
    from services.tiny_int_weight import apply, quantize_experts, to_gptq
    from tests.factories import tiny_model

    source = str(tmp_path / "source")
    shutil.copytree(tiny_int_weight_model("qwen3_moe", 8, 4, True, act_order=True), source)
    assert quantize_experts(source, 8, 4, act_order=True) == 2 * 8 * 3
    path = str(tmp_path / "gptq")
    shutil.copytree(source, path)
    to_gptq(path, act_order=True)
    reference = dequantized_copy(source, str(tmp_path / "reference"), act_order=True)
    # (`make-tiny-model --arch qwen3_moe --quantization gptq-int8 --group-size 4 --act-order`
    # writes this checkpoint, experts included)
    cli = str(tmp_path / "cli")
    shutil.copytree(tiny_model("qwen3_moe"), cli)
    apply(Namespace(quantization="gptq-int8", group_size=4, asymmetric=False, act_order=True,
                    arch="qwen3_moe"), cli)  # fmt: skip
    written, want = (load_file(os.path.join(p, "model.safetensors")) for p in (cli, path))
    assert sorted(written) == sorted(want)
    assert all(torch.equal(written[n], want[n]) for n in want)
    with Engine(model_path=path, disable_overlap_schedule=True) as engine:
        for m in packed_experts_served(engine, 8):
            assert m.num_local == 8
            orders = m.input_perm.long()
            assert not torch.equal(orders[0], torch.arange(m.in_features))
            assert not torch.equal(orders[0], orders[1])  # (each expert its own)
        outs = engine.generate(input_ids=PROMPTS, sampling_params=[GREEDY] * len(PROMPTS))
    for parallel in ({"tp_size": 2}, {"tp_size": 2, "ep_size": 2}):
        with Engine(model_path=path, **parallel) as engine:
            outs += engine.generate(input_ids=PROMPTS, sampling_params=[GREEDY] * len(PROMPTS))
    for prompt, out in zip(PROMPTS * 3, outs, strict=True):
        assert_greedy_match(reference, prompt, out["output_ids"],
                            hf_greedy(reference, prompt, NEW))  # fmt: skip

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    up = "model.layers.1.mlp.experts.5.up_proj.g_idx"
    tensors[up] = tensors[up].flip(0).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"mlp.experts.* \(5, 'up'\): its columns' order "
                       r"\(g_idx\) differs from its 'gate' shard's"):  # fmt: skip
        Engine(model_path=path, disable_overlap_schedule=True)
    part = IntExpertWeights.like(ExpertWeights(8, 22, [("down", 64)], split=(1, 0, 22, 44)),
                                 8, 4, True, act_order=True)  # fmt: skip
    assert part.input_perm is None and part.weight_gidx.shape == (8, 22)
    assert part.weight_scale.shape == (8, 64, 44 // 4)


def _variant(tmp_path, case: str, edit=None, tensors=None) -> str:
    """The GPTQ checkpoint of `case` with its quantization_config edited by `edit(qc)` and
    its tensors by `tensors(dict)`."""
    from safetensors.torch import load_file, save_file

    path = config_variant(tiny_gptq_model(*CASES[case]), str(tmp_path / "variant"),
                          edit or (lambda qc: None))  # fmt: skip
    if tensors is not None:
        file = os.path.join(path, "model.safetensors")
        loaded = load_file(file)
        tensors(loaded)
        save_file(loaded, file, metadata={"format": "pt"})
    return path


def _swap_g_idx(tensors: dict) -> None:
    """k_proj's column order for q_proj's (they read the same input)."""
    k = tensors["model.layers.0.self_attn.k_proj.g_idx"]
    tensors["model.layers.0.self_attn.q_proj.g_idx"] = k.flip(0).contiguous()


@pytest.mark.parametrize(("case", "edit", "tensors", "why"), [
    ("llama-4bit-g16-zero-points", lambda qc: qc.update(sym=True), None,
     "symmetric GPTQ checkpoint .* zero points are not 8"),
    ("llama-4bit-g16-act-order", lambda qc: qc.update(desc_act=False), None,
     "ordered by group, but the config has no activation ordering"),
    ("llama-4bit-g16-act-order", None, _swap_g_idx,
     "self_attn.qkv_proj: the stacked parts .* order its input columns differently"),
    ("llama-4bit-g16-act-order", None,
     lambda t: t.update({"model.layers.1.mlp.down_proj.g_idx":
                         torch.zeros_like(t["model.layers.1.mlp.down_proj.g_idx"])}),
     "g_idx does not give each group 16 columns"),
    ("llama-4bit-g16", None, lambda t: t.pop("model.layers.0.self_attn.o_proj.qzeros"),
     "GPTQ checkpoint: quantized weights missing parts"),
], ids=["sym-with-zero-points", "g_idx-without-desc_act", "stacked-orders-differ",
        "uneven-groups", "missing-qzeros"])  # fmt: skip
def test_checkpoints_it_cannot_run_are_refused(tmp_path, case, edit, tensors, why) -> None:
    path = _variant(tmp_path, case, edit, tensors)
    with pytest.raises(ValueError, match=why):
        Engine(model_path=path, disable_overlap_schedule=True)


def test_configs_it_cannot_run_are_refused() -> None:
    """Other widths and checkpoint formats (repacked kernels' layouts), a quantized LM head and
    GPTQModel's per-module settings are refused with the reason, as is `--quantization`
    naming another method than the checkpoint's; GPTQModel's '-:' entries leave
    modules unquantized; under activation ordering a row-parallel layer split over ranks
    keeps every group's scales and each of its columns' group (its columns' groups are
    spread over all of them), in the input's order."""
    from types import SimpleNamespace

    from engine.distributed import TensorParallel
    from engine.layers.int_weight import IntWeightLinear
    from engine.layers.parallel import RowParallelLinear
    from engine.quantization import quantized_linear_names, resolve_quantization
    from tests.factories import tiny_model

    base = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
            "sym": True}  # fmt: skip

    def config(**kw: object) -> SimpleNamespace:
        return SimpleNamespace(quantization_config={**base, **kw})

    scheme = resolve_quantization(None, config(group_size=-1, checkpoint_format="gptq_v2"))
    assert (scheme.layout, scheme.group, scheme.bits) == ("gptq_v2", None, 4)
    for kw, why in [
        ({"bits": 3}, "3-bit weights: 4- and 8-bit"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"group_size": 0}, "group_size 0"),
        ({"lm_head": True}, "quantized LM head"),
        ({"dynamic": {r"+:.*\.mlp\..*": {"bits": 8}}}, "only the '-:' entries"),
    ]:
        with pytest.raises(ValueError, match=why):
            resolve_quantization(None, config(**kw))
    with pytest.raises(ValueError, match="fp8 on a gptq checkpoint"):
        resolve_quantization("fp8", config())
    # (`--quantization gptq`, as vLLM users pass it: the checkpoint's own method only)
    assert resolve_quantization("gptq", config()).layout == "gptq"
    with pytest.raises(ValueError, match="--quantization awq: the checkpoint is quantized "
                       "with 'gptq'"):  # fmt: skip
        resolve_quantization("awq", config())
    with pytest.raises(ValueError, match="--quantization gptq: the checkpoint is not quantized"):
        resolve_quantization("gptq", SimpleNamespace(quantization_config=None))
    with Engine(model_path=tiny_model("llama"), disable_overlap_schedule=True) as e:
        model = e.scheduler.model_runner.model
        skipping = resolve_quantization(None, config(dynamic={r"-:.*\.mlp\..*": {}}))
        names = quantized_linear_names(model, skipping)
    assert names and not any(".mlp." in n for n in names)
    assert any(".mlp." in n for n in quantized_linear_names(model, scheme))
    row = RowParallelLinear(64, 32, False, TensorParallel(0, 2))
    part = IntWeightLinear.like(row, 4, 16, True, act_order=True)
    assert part.input_perm is None and part.weight_gidx.shape == (32,)
    assert part.weight_scale.shape == (32, 64 // 16)
    assert IntWeightLinear.like(row, 4, 16, True).weight_scale.shape == (32, 32 // 16)
    with pytest.raises(ValueError, match="not whole 16-column quantization groups"):
        IntWeightLinear.like(RowParallelLinear(72, 32, False, TensorParallel(0, 2)), 4, 16, True)
