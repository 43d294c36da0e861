"""W8A8 in integers (compressed-tensors "int-quantized" checkpoints of llm-compressor's W8A8
scheme; engine/layers/int8.py): the engine's teacher-forced logits are transformers' on the
weights compressed-tensors dequantizes, each quantized layer's input rounded to int8 per token
(vLLM's `scaled_int8_quant`: largest magnitude / 127, round half to even; written out in
tests/fp8_reference.py, not taken from the engine): Llama, Qwen2 (biases), Phi-3 (fused
projections), Qwen3-MoE (its router dequantized, its experts unquantized, or int8 and kept
so: W8A16 experts), over two ranks (each row-parallel rank quantizes its half of the input);
the layers hold int8; the schemes it cannot run are refused with the reason."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine.engine import Engine
from tests.factories import config_variant, packed_experts_served, tiny_w8a8_model
from tests.fp8_reference import hf_w8a8_logits
from tests.teacher_forcing import (
    CPU_DECODE,
    CPU_PROMPT_LENS,
    close_positions,
    cpu_sequences,
    cpu_teacher_forced,
    score_logits,
)


def assert_same_arithmetic(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    """The FP8 tests' comparison with int8's bar. An int8 step is a 127th of the row's largest
    magnitude, much finer than a float8 step near that magnitude, so float32 differences
    between the two stacks (their attention, their norms) push a value across a rounding
    boundary somewhere in the forward at about a fifth of the positions (Llama: 0.785 of them
    within 1e-3, mean |delta logprob| 0.0066), where float8's stay at 98 %. What a wrong
    arithmetic does is far from that: a scale of largest / 127.5, one scale per tensor, or
    truncation instead of rounding left no position within 1e-3 and a mean |delta logprob|
    of 0.13-0.24 (measured when this test was written)."""
    stats = score_logits(ours, ref)
    stats["close_positions"] = close_positions(ours, ref)
    assert stats["positions"] == sum(CPU_PROMPT_LENS) + len(CPU_PROMPT_LENS) * CPU_DECODE
    assert stats["close_positions"] >= 0.5, stats
    assert stats["mean_abs_dlogprob"] <= 0.03, stats
    assert stats["agreement_tie_aware"] >= 0.99, stats


def _dequantized(path: str, out: str) -> str:
    """A float checkpoint of the W8A8 one: each int8 weight dequantized by compressed-tensors
    (`dequantize`, with the config's weight arguments), no quantization_config."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file, save_file

    if os.path.exists(os.path.join(out, "config.json")):
        return out
    shutil.copytree(path, out)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    qc = config.pop("quantization_config")
    args = QuantizationArgs(**qc["config_groups"]["group_0"]["weights"])
    file = os.path.join(out, "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        base = name.removesuffix("_scale")
        scale = tensors.pop(name)
        tensors[base] = dequantize(tensors[base], scale, args=args, dtype=torch.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "qwen3_moe"])
def test_int8_w8a8_matches_transformers(arch: str, tmp_path) -> None:
    path = tiny_w8a8_model(arch)
    ref = hf_w8a8_logits(_dequantized(path, str(tmp_path / "ref")), cpu_sequences(), None,
                         int8=True)  # fmt: skip
    assert_same_arithmetic(cpu_teacher_forced(path), ref)


def test_int8_w8a8_over_two_ranks(tmp_path) -> None:
    path = tiny_w8a8_model("llama")
    ref = hf_w8a8_logits(_dequantized(path, str(tmp_path / "ref")), cpu_sequences(), None,
                         split=2, int8=True)  # fmt: skip
    assert_same_arithmetic(cpu_teacher_forced(path, tp_size=2), ref)


def test_the_layers_hold_int8() -> None:
    from engine.layers.int8 import Int8Linear

    with Engine(model_path=tiny_w8a8_model("llama"), disable_overlap_schedule=True) as engine:
        model = engine.scheduler.model_runner.model
        layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
        assert len(layers) == 4 * 2
        assert all(m.weight.dtype == torch.int8 and m.weight_scale.dtype == torch.float32
                   for m in layers)  # fmt: skip
        assert not isinstance(model.lm_head, Int8Linear)


def _activations(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]["input_activations"]


@pytest.mark.parametrize(("edit", "why"), [
    (lambda qc: _activations(qc).update(symmetric=False), "zero points"),
    (lambda qc: _activations(qc).update(num_bits=4), "W8A4"),
    (lambda qc: _activations(qc).update(type="float"), "FP8 schemes"),
    (lambda qc: _activations(qc).update(strategy="group"), "activation strategy 'group'"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="tensor"),
     "weight strategy 'tensor'"),
], ids=["asymmetric", "4-bit-activations", "float", "group", "tensor-weights"])  # fmt: skip
def test_what_it_cannot_run_is_refused(tmp_path, edit, why: str) -> None:
    path = config_variant(tiny_w8a8_model("llama"), str(tmp_path / "variant"), edit)
    with pytest.raises(ValueError, match=why):
        Engine(model_path=path, disable_overlap_schedule=True)


def _int8_experts_model(out: str) -> str:
    """`tiny_w8a8_model("qwen3_moe")` with its experts int8 too: each expert's matrix
    (`experts.{e}.gate_proj.weight`...) rounded per output channel, with its `weight_scale`,
    as llm-compressor writes the experts of a MoE whose experts are Linear layers
    (`quantize_experts`)."""
    from services.tiny_int_weight import quantize_experts

    shutil.copytree(tiny_w8a8_model("qwen3_moe"), out)
    assert quantize_experts(out, 8, None, int8=True) == 2 * 8 * 3
    return out


@pytest.mark.parametrize("parallel", [{}, {"tp_size": 2, "ep_size": 2}],
                         ids=["one-rank", "two-expert-groups"])  # fmt: skip
def test_int8_experts_stay_8_bit(tmp_path, parallel: dict) -> None:
    """A Qwen3-MoE W8A8 checkpoint whose experts are int8 too: they stay 8-bit
    (`IntExpertWeights`: four integers a word) and run as W8A16, their inputs unrounded
    (the grouped GEMMs have no int8-activation path). The reference is transformers on the
    weights compressed-tensors dequantizes, the attention projections' inputs rounded to
    int8 per token and the experts' not (transformers' fused experts are no Linear layers).
    Over two ranks in two expert groups each rank holds half of the experts, whole, and the
    attention projections in halves."""
    path = _int8_experts_model(str(tmp_path / "moe"))
    ref = hf_w8a8_logits(_dequantized(path, str(tmp_path / "ref")), cpu_sequences(), None,
                         split=parallel.get("tp_size", 1), int8=True)  # fmt: skip
    assert_same_arithmetic(cpu_teacher_forced(path, **parallel), ref)
    if parallel:
        return
    with Engine(model_path=path, disable_overlap_schedule=True) as engine:
        for m in packed_experts_served(engine, 8):
            assert (m.bits, m.group, m.weight_zero) == (8, m.in_features, None)
