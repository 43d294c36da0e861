"""Quantized MoE experts: which layers' experts a quantization config swaps for quantized
ones (`engine.layers.int_experts.IntExpertWeights`, `engine.layers.fp8_experts.
Fp8ExpertWeights`) and when. A checkpoint's experts stay quantized where it stores them so
(compressed-tensors', AWQ's and GPTQ's packed integers, W8A8's int8, FP8's float8);
`--quantization fp8` quantizes a 16-bit checkpoint's experts once they are loaded. The rest
are dequantized as they load (engine/loader.py)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from engine.checkpoint_parts import packed_experts
from engine.layers.fp8_experts import Fp8ExpertWeights
from engine.layers.int_experts import IntExpertWeights
from engine.layers.moe import ExpertWeights, FusedMoE
from engine.quantization import IN_BLOCK, Fp8Config, QuantConfig, skipped


def swap_experts(
    model: nn.Module,
    config: QuantConfig,
    checkpoint: str | None,
    make: Callable[[ExpertWeights], ExpertWeights],
) -> int:
    """The MoE layers' experts swapped for quantized ones, `make(experts)`, where the
    checkpoint stores them quantized (`config.parts` among an expert's tensors: a config's
    targets say Linear layers, and transformers' fused experts are none: their checkpoints
    hold them in 16 bits) and the config does not leave them out. Other quantized experts
    are dequantized as they load."""
    if checkpoint is None or not packed_experts(checkpoint, config.parts):
        return 0
    layers = moe_layers(model, config)
    for module in layers:
        module.w13, module.w2 = make(module.w13), make(module.w2)
    return len(layers)


def moe_layers(model: nn.Module, config: QuantConfig) -> list[nn.Module]:
    """The blocks' MoE layers (`FusedMoE`) whose experts the config does not leave out."""
    layers = []
    for name, module in model.named_modules():
        if not (isinstance(module, FusedMoE) and IN_BLOCK.search(name)):
            continue
        # (a checkpoint names expert e's matrices experts.{e}.gate_proj, or w1 / w3 / w2)
        parts = [f"{name}.0.{p}" for p in ("gate_proj", "up_proj", "down_proj", "w1")]
        if not any(skipped(part, s) for part in parts for s in config.skip):
            layers.append(module)
    return layers


def swap_int_experts(
    model: nn.Module,
    config: QuantConfig,
    checkpoint: str | None,
    bits: int,
    group: int | None,
    symmetric: bool,
    act_order: bool = False,
) -> int:
    """`swap_experts` for integer experts (`IntExpertWeights`: `bits`-bit, a scale per
    `group` columns or per channel, zero points unless `symmetric`; `act_order`: each
    expert's input columns in its own order, GPTQ's desc_act)."""
    def make(experts: ExpertWeights) -> ExpertWeights:
        return IntExpertWeights.like(experts, bits, group, symmetric, act_order)

    return swap_experts(model, config, checkpoint, make)


def swap_fp8_experts(model: nn.Module, config: Fp8Config, checkpoint: str | None) -> int:
    """`swap_experts` for an FP8 checkpoint's float8 experts (`Fp8ExpertWeights`; a rank's
    part of the down projection's columns may cut the checkpoint's blocks)."""
    def make(experts: ExpertWeights) -> ExpertWeights:
        return Fp8ExpertWeights.like(experts, config.block)

    return swap_experts(model, config, checkpoint, make)


def quantize_experts(model: nn.Module, config: Fp8Config) -> int:
    """`--quantization fp8`: the loaded MoE layers' experts quantized to float8, a scale per
    row (`Fp8ExpertWeights.quantize`), but those the config leaves out and experts of another
    layout (gpt-oss's, with biases). How many layers."""
    count = 0
    for module in moe_layers(model, config):
        if not all(type(getattr(module, attr, None)) is ExpertWeights for attr in ("w13", "w2")):
            continue
        module.w13, module.w2 = (Fp8ExpertWeights.quantize(module.w13),
                                 Fp8ExpertWeights.quantize(module.w2))  # fmt: skip
        count += 1
    return count
