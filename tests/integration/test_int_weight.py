"""Integer weights (compressed-tensors W4A16 / W8A16 "pack-quantized" checkpoints and AutoAWQ
ones; engine/layers/int_weight.py): checkpoints written by compressed-tensors' own compressor
(services/tiny_int_weight.py) give transformers' greedy tokens (transformers decompresses
them to float weights), 4- and 8-bit, grouped and per channel, symmetric and asymmetric,
over the families whose loading reorders or splits rows (Phi-3's fused projections, GLM-4's
and DeepSeek's interleaved rope) or adds biases (Qwen2's q/k/v); the blocks' layers keep the
packed words; a mixture of experts whose experts are quantized too (dequantized as they
load) matches transformers on the weights compressed-tensors' unpacking gives; tensor
parallelism splits whole groups, and refuses parts that are not; LoRA adapters, weight
updates; the schemes it cannot run are refused with the reason."""

from __future__ import annotations

import os
import shutil

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
    tiny_int_weight_model,
)

NEW = 10
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
PROMPTS = mixed_prompts(1500, n=4, max_len=40, seed=5)


def _check_greedy(engine: Engine, path: str, reference: str | None = None) -> None:
    outs = engine.generate(input_ids=PROMPTS, sampling_params=[GREEDY] * len(PROMPTS))
    ref = reference or path
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert_greedy_match(ref, prompt, out["output_ids"], hf_greedy(ref, prompt, NEW))


@pytest.mark.parametrize(("arch", "bits", "group", "symmetric"), [
    ("llama", 4, 16, True), ("qwen3", 8, None, True), ("llama", 4, 16, False),
    ("phi3", 4, 16, True), ("glm4", 8, 16, False), ("gemma2", 4, 16, True),
    ("deepseek_v3", 4, 16, True), ("qwen2", 4, 16, True),
])  # fmt: skip
def test_greedy_tokens_equal_transformers(
    arch: str, bits: int, group, symmetric: bool, tmp_path
) -> None:
    """(the default loop: on CPU the overlap scheduler's device process loads the model.
    transformers 5.24 does not load the asymmetric checkpoints compressed-tensors 0.20
    writes, nor its DeepSeek-V3 ones, so those run on the weights compressed-tensors'
    unpacking gives. DeepSeek-V3: MLA's rope rows reordered on the packed words, kv_b_proj
    dequantized for the absorbed attention.)"""
    path = tiny_int_weight_model(arch, bits, group, symmetric)
    unpacked = not symmetric or arch == "deepseek_v3"
    reference = dequantized_copy(path, str(tmp_path / "reference")) if unpacked else None
    with Engine(model_path=path) as engine:
        _check_greedy(engine, path, reference)


def test_the_blocks_layers_keep_the_packed_words() -> None:
    """Every projection of the blocks is an IntWeightLinear holding int32 words (8 weights a
    word at 4 bits), its scales in the model's dtype; the embeddings and the LM head stay."""
    from engine.layers.int_weight import IntWeightLinear

    path = tiny_int_weight_model("llama", 4, 16, True)
    with Engine(model_path=path, disable_overlap_schedule=True) as engine:
        model = engine.scheduler.model_runner.model
        layers = [m for m in model.modules() if isinstance(m, IntWeightLinear)]
        config = engine.scheduler.model_runner.model_config
        assert len(layers) == 4 * config.num_layers  # qkv, o, gate_up, down
        for layer in layers:
            assert layer.weight.dtype == torch.int32
            assert layer.weight.numel() * 8 == layer.in_features * layer.out_features
            assert layer.weight_scale.shape == (layer.out_features, layer.in_features // 16)
            assert layer.weight_zero is None
        assert not isinstance(model.lm_head, IntWeightLinear)


@pytest.mark.parametrize("parallel", [{}, {"tp_size": 2}, {"tp_size": 2, "ep_size": 2}],
                         ids=["one-rank", "two-ranks", "two-expert-groups"])
def test_quantized_experts_stay_packed(tmp_path, parallel: dict) -> None:
    """A Qwen3-MoE checkpoint whose experts are quantized too (per-expert `weight_packed`,
    as checkpoints made before transformers fused its experts store them; packed per
    channel with compressed-tensors' `pack_to_int32` by `quantize_experts`) and whose
    attention is the compressor's: the experts stay packed (`IntExpertWeights`: 8 four-bit
    integers a word) and run through the grouped GEMMs' integer path (the torch path on the
    CPU), and the tokens are transformers' on the weights compressed-tensors unpacks; over
    two ranks each holds half of every expert's intermediate features (the down
    projection's columns: a per-channel scale holds for any part of a row), or half of the
    experts. (GPTQ's layout packs K in whole words: the tiny experts' 44 features are not.)"""
    from services.tiny_int_weight import quantize_experts

    path = str(tmp_path / "moe")  # (per channel: the experts' 44 features are not groups)
    shutil.copytree(tiny_int_weight_model("qwen3_moe", 4, None, True), path)
    assert quantize_experts(path, 4, None) == 2 * 8 * 3  # (layers x experts x matrices)
    reference = dequantized_copy(path, str(tmp_path / "reference"))
    if parallel:
        with Engine(model_path=path, **parallel) as engine:
            _check_greedy(engine, path, reference)
        return
    with Engine(model_path=path, disable_overlap_schedule=True) as engine:
        packed_experts_served(engine, 4)
        _check_greedy(engine, path, reference)


def test_awq_checkpoints_run_repacked(tmp_path) -> None:
    """An AutoAWQ GEMM checkpoint (`qweight` / `qzeros` / `scales`, output columns in AWQ's
    nibble order; written by services/tiny_int_weight.to_awq from the asymmetric W4A16 one,
    which compressed-tensors' own AWQ converter turns back into the same tensors) is
    repacked as it loads: the tokens are those of the weights compressed-tensors unpacks,
    and the same integer layers serve it."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from safetensors.torch import load_file

    from engine.layers.int_weight import IntWeightLinear
    from services.tiny_int_weight import to_awq

    source = tiny_int_weight_model("llama", 4, 16, False)
    path = str(tmp_path / "awq")
    shutil.copytree(source, path)
    assert to_awq(path) == 14
    original = load_file(os.path.join(source, "model.safetensors"))
    converted = AutoAWQConverter(bits=4, group_size=16, zero_point=True).process(
        load_file(os.path.join(path, "model.safetensors"))
    )
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name].to(tensor.dtype), tensor), name
    reference = dequantized_copy(source, str(tmp_path / "reference"))
    with Engine(model_path=path, disable_overlap_schedule=True) as engine:
        model = engine.scheduler.model_runner.model
        assert sum(isinstance(m, IntWeightLinear) for m in model.modules()) == 8
        _check_greedy(engine, path, reference)


def test_tensor_parallel_parts_are_whole_groups() -> None:
    """Over two ranks the row-parallel layers take whole groups of columns: groups of 8
    split Llama's 176 MLP features (88 a rank) and give transformers' tokens, as does a
    scale per channel (any part of a row shares its scale); groups of 16 do not, refused
    before any rank starts."""
    for path in (tiny_int_weight_model("llama", 4, 8, True),
                 tiny_int_weight_model("qwen3", 8, None, True)):  # fmt: skip
        with Engine(model_path=path, tp_size=2) as engine:
            _check_greedy(engine, path)
    with pytest.raises(ValueError, match="not whole 16-column quantization groups"):
        Engine(model_path=tiny_int_weight_model("llama", 4, 16, True), tp_size=2)


def test_weights_updated_from_another_quantized_checkpoint() -> None:
    """`update_weights_from_disk` with another W4A16 checkpoint of the model (checked on a
    meta model first, then read into the packed layers in place): its greedy tokens; a
    W8A16 one does not fit (the words and scales differ) and the old weights stay."""
    path = tiny_int_weight_model("llama", 4, 16, True)
    other = tiny_int_weight_model("llama", 4, 16, True, seed=1)
    with Engine(model_path=path, disable_overlap_schedule=True) as engine:
        engine.update_weights_from_disk(other)
        _check_greedy(engine, other)
        with pytest.raises(ValueError, match=r"holds 8-bit \(groups of 16, symmetric\) "
                           r"weights; the served model's are 4-bit"):
            engine.update_weights_from_disk(tiny_int_weight_model("llama", 8, 16, True))
        _check_greedy(engine, other)


def test_lora_adapters_over_integer_layers(tmp_path) -> None:
    """A LoRA adapter of the base model served over its W4A16 checkpoint (the adapter's delta
    beside the packed layer, as over FP8 ones): PEFT's greedy tokens over the weights
    compressed-tensors unpacks (PEFT does not wrap transformers' decompressed layers), for
    adapter and base requests in one batch."""
    from tests.factories import lora_greedy, tiny_lora, tiny_model

    path = tiny_int_weight_model("llama", 4, 16, True)
    reference = dequantized_copy(path, str(tmp_path / "reference"))
    adapter = tiny_lora(tiny_model("llama"), 1, 8, targets=("q_proj", "v_proj", "down_proj"))
    with Engine(model_path=path, lora_paths=(f"a={adapter}",),
                disable_overlap_schedule=True) as engine:  # fmt: skip
        outs = engine.generate(input_ids=PROMPTS[:2], sampling_params=[GREEDY] * 2,
                               lora_path=["a", None])  # fmt: skip
    for (prompt, out), lora in zip(zip(PROMPTS[:2], outs), [adapter, None], strict=True):
        assert out["output_ids"] == lora_greedy(reference, lora, prompt, NEW)
    base = lora_greedy(reference, None, PROMPTS[0], NEW)
    assert outs[0]["output_ids"] != base  # (the adapter changes the tokens)


def test_weights_read_back_by_name() -> None:
    """`get_weights_by_name` reads a weight the checkpoint stores as it is served (the
    embedding) and refuses a part of a packed weight with the reason."""
    from safetensors.torch import load_file

    path = tiny_int_weight_model("llama")
    stored = load_file(os.path.join(path, "model.safetensors"))["model.embed_tokens.weight"]
    with Engine(model_path=path, disable_overlap_schedule=True) as engine:
        got = engine.get_weights_by_name("model.embed_tokens.weight", truncate_size=200)
        assert torch.equal(torch.tensor(got, dtype=stored.dtype), stored.flatten()[:200])
        with pytest.raises(ValueError, match="part of a quantized weight"):
            engine.get_weights_by_name("model.layers.0.self_attn.q_proj.weight_packed")


def _weights(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(("edit", "why"), [
    (lambda qc: qc["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "dynamic": True}),
     "quantized activations"),
    (lambda qc: _weights(qc).update(actorder="group"), "activation ordering"),
    (lambda qc: _weights(qc).update(num_bits=2), "4- and 8-bit integers"),
    (lambda qc: _weights(qc).update(strategy="tensor"), "'group' and 'channel'"),
    (lambda qc: (qc["config_groups"]["group_0"].update(format="float-quantized"),
                 qc.update(format="float-quantized")), "'pack-quantized'"),
    (lambda qc: _weights(qc).update(group_size=8), "scales of shape"),
    (lambda qc: _weights(qc).update(group_size=32), "176 input features are not whole 32-col"),
    (lambda qc: _weights(qc).update(symmetric=False), "missing parts"),
], ids=["packed-activations", "actorder", "2-bit", "tensor", "format", "group-size",
        "uneven-groups", "zero-points"])  # fmt: skip
def test_what_it_cannot_run_is_refused(tmp_path, edit, why: str) -> None:
    path = config_variant(tiny_int_weight_model("llama", 4, 16, True), str(tmp_path / "v"), edit)
    with pytest.raises(ValueError, match=why):
        Engine(model_path=path, disable_overlap_schedule=True)


def test_online_fp8_on_an_integer_checkpoint_is_refused() -> None:
    with pytest.raises(ValueError, match="fp8 on a compressed-tensors checkpoint"):
        Engine(model_path=tiny_int_weight_model("llama"), quantization="fp8",
               disable_overlap_schedule=True)  # fmt: skip


def test_awq_configs_it_cannot_run_are_refused() -> None:
    """AutoAWQ's other layouts (GEMV, Marlin...), widths and per-channel scales are refused
    with the reason; `modules_to_not_convert` leaves out every module whose name contains
    one of its entries, as AutoAWQ does."""
    from types import SimpleNamespace

    from engine.quantization import quantized_linear_names, resolve_quantization

    base = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
            "version": "gemm"}  # fmt: skip

    def config(**kw: object) -> SimpleNamespace:
        return SimpleNamespace(quantization_config={**base, **kw})

    assert resolve_quantization(None, config()).layout == "awq"
    for kw, why in [({"version": "gemv"}, "only the 'gemm' layout"),
                    ({"bits": 8}, "4-bit is supported"), ({"group_size": -1}, "per-group")]:
        with pytest.raises(ValueError, match=why):
            resolve_quantization(None, config(**kw))
    with pytest.raises(ValueError, match="fp8 on a awq checkpoint"):
        resolve_quantization("fp8", config())
    from tests.factories import tiny_model

    with Engine(model_path=tiny_model("llama"), disable_overlap_schedule=True) as e:
        model = e.scheduler.model_runner.model  # (its plain layers: what a swap would take)
        skipped = resolve_quantization(None, config(modules_to_not_convert=["mlp"]))
        names = quantized_linear_names(model, skipped)
        assert names and not any(".mlp." in n for n in names)
