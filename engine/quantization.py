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
`modules_to_not_convert` / `ignored_layers` name. Other methods (AWQ, GPTQ,
compressed-tensors, bitsandbytes, MXFP4) are refused at start with their name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.layers.fp8 import QuantizedWeight

# The FP8 layer (and with it Triton) is imported where a model is quantized, not here: the
# CLI of every service reads QUANTIZATION_METHODS.
QUANTIZATION_METHODS = ("fp8",)
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


def resolve_quantization(requested: str | None, hf_config: object) -> Fp8Config | None:
    """The FP8 setup of `--quantization requested` on a model of `hf_config` (None: none)."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: {requested!r} not in {QUANTIZATION_METHODS}")
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    if not qc:
        return Fp8Config(checkpoint=False) if requested == "fp8" else None
    method = qc.get("quant_method")
    if method == "mxfp4" and getattr(hf_config, "model_type", None) == "gpt_oss":
        # gpt-oss's published experts: dequantized as they load (GptOssForCausalLM), run
        # in the model's dtype
        if requested is not None:
            raise ValueError(f"--quantization {requested} on an MXFP4 checkpoint")
        return None
    if method != "fp8":
        raise ValueError(
            f"the checkpoint is quantized with {method!r}, which sluice does not run "
            f"(it runs FP8 checkpoints, quant_method 'fp8', and --quantization fp8 on "
            f"16-bit ones)"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 checkpoint format {qc['fmt']!r}: only e4m3 is supported")
    block = qc.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ValueError(f"quantization_config.weight_block_size {block!r}: expected [rows, cols]")
    skip = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ())
    return Fp8Config(checkpoint=True, block=tuple(block) if block else None, skip=skip)


def quantized_linear_names(model: nn.Module, config: Fp8Config) -> list[str]:
    """The linear layers to run in FP8: those of the transformer blocks, less MoE routers and
    the modules the checkpoint leaves alone."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not _IN_BLOCK.search(name):
            continue
        if name.rsplit(".", 1)[-1] in _ROUTERS + getattr(model, "unquantized_linears", ()):
            continue
        if any(
            name == s or name.startswith(s + ".") or name.endswith("." + s) for s in config.skip
        ):
            continue
        names.append(name)
    return names


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
