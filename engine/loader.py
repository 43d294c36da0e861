"""Build a model from a Hugging Face folder and fill it from `*.safetensors`.

Steps: pick the class by architecture (`engine.models.registry`), construct it on the meta
device in the target dtype (no random init, no double memory), materialise it empty on the
target device, stream checkpoint tensors into it (each model's `load_weights` maps HF names
to its own, stacking q/k/v and gate/up into fused projections), check nothing is missing,
then let modules with derived buffers (rotary tables) build them with `init_buffers()`.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
from collections import defaultdict
from collections.abc import Callable, Container, Hashable, Iterable, Iterator, Sequence

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed import SINGLE, TensorParallel, building_with
from engine.layers.fp8 import Fp8Linear, QuantizedWeight
from engine.layers.fp8_experts import Fp8ExpertWeights
from engine.layers.int8 import Int8Linear, Int8Weight
from engine.layers.int_experts import IntExpertWeights
from engine.layers.int_weight import IntWeightLinear, PackedIntWeight
from engine.mem_cache.kv_quant import take_kv_scales
from engine.models.registry import get_model_class
from engine.quantization import QuantConfig, swap_in_fp8

TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Ministral3ForCausalLM",
                    "Mistral3ForConditionalGeneration", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                    "Phi3ForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM",
                    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")  # fmt: skip

# (name, tensor), (name, tensor, shard id) for a shard of a stacked parameter, or None to skip.
WeightTransform = Callable[
    [str, torch.Tensor], "tuple[str, torch.Tensor] | tuple[str, torch.Tensor, Hashable] | None"
]


def load_model(
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    quantization: QuantConfig | None = None,
    tp: TensorParallel = SINGLE,
) -> nn.Module:
    """The model of `model_config.path` with its checkpoint weights, in eval mode, no grads;
    its blocks' linear layers in FP8 with `quantization` (engine/quantization.py).

    Call it as `model(input_ids, positions, forward_batch) -> float32 logits`. The
    checkpoint's KV-cache scales, if any, are left in `model.kv_cache_scales`
    ({layer: (k_scale, v_scale)}, engine/mem_cache/kv_quant.py) for an FP8 KV cache. With a
    tensor-parallel group `tp`, the part of every weight that rank `tp.rank` holds
    (engine/layers/parallel.py).
    """
    model = build_model(model_config, dtype, device, quantization, tp)
    names = tensors_to_read(model, model_config)
    kv_cache_scales = fill_model(model, iter_safetensors(model_config.path, names),
                                 model_config.path, quantization)  # fmt: skip
    for module in model.modules():
        init_buffers = getattr(module, "init_buffers", None)
        if callable(init_buffers):
            init_buffers()
    if quantization is not None and not quantization.checkpoint:
        swap_in_fp8(model, quantization)
    model.kv_cache_scales = kv_cache_scales
    return model.eval().requires_grad_(False)


def tensors_to_read(model: nn.Module, model_config: ModelConfig) -> Container[str] | None:
    """The checkpoint tensors a model reads (None: all of them): a class with a
    `reads_tensors(hf_config)` reads part of a larger checkpoint (an MTP head,
    engine/models/mtp.py)."""
    names = getattr(type(model), "reads_tensors", None)
    return None if names is None else names(model_config.hf_config)


def checkpoint_bytes(model_config: ModelConfig) -> int:
    """The bytes of the checkpoint tensors the model of `model_config` reads (as stored:
    an upper bound where they are stored wider than they run), from the files' headers."""
    from safetensors import safe_open

    reads = getattr(get_model_class(model_config.architecture), "reads_tensors", None)
    if reads is None:
        return sum(os.path.getsize(file) for file in safetensors_files(model_config.path))
    names = reads(model_config.hf_config)
    total = 0
    for file in safetensors_files(model_config.path, names):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in names:
                    piece = f.get_slice(name)
                    item = SAFETENSORS_DTYPES[piece.get_dtype()].itemsize
                    total += math.prod(piece.get_shape()) * item
    return total


# a checkpoint's quantized weights (their parts joined), and the layers that keep them so
QUANTIZED_TENSORS = (QuantizedWeight, PackedIntWeight, Int8Weight)
QUANTIZED_LINEARS = (Fp8Linear, IntWeightLinear, IntExpertWeights, Fp8ExpertWeights, Int8Linear)

# safetensors' dtype names -> torch's
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def build_model(
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device,
    quantization: QuantConfig | None = None,
    tp: TensorParallel = SINGLE,
) -> nn.Module:
    """The model's class built on the meta device (rank `tp.rank`'s part of it), then (unless
    `device` is "meta") materialised there, uninitialised."""
    cls = get_model_class(model_config.architecture)
    if tp.size > 1 and not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(
            f"tensor parallelism (tp_size {tp.size}) is not supported for "
            f"{model_config.architecture} yet; it is for {', '.join(TP_ARCHITECTURES)}"
        )
    with torch.device("meta"), _default_dtype(dtype), building_with(tp):
        model = cls(model_config.hf_config, max_position=model_config.context_len)
        if quantization is not None and quantization.checkpoint:
            quantization.swap(model, model_config.path)
    return model if torch.device(device).type == "meta" else model.to_empty(device=device)


def fill_model(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    path: str,
    quantization: QuantConfig | None = None,
    partial: bool = False,
) -> dict[int, tuple[float, float]]:
    """Copy a checkpoint's tensors into `model` (ValueError if one does not fit or, unless
    `partial`, any parameter is left without one); its KV-cache scales, by layer."""
    kv_cache_scales: dict[int, tuple[float, float]] = {}
    weights = take_kv_scales(weights, kv_cache_scales)
    if quantization is not None and quantization.checkpoint:
        weights = quantization.pair(weights)
    loaded = model.load_weights(weights)
    for name, module in model.named_modules():  # (what the parts loaded must agree on)
        if isinstance(module, (IntWeightLinear, IntExpertWeights)):
            try:
                module.finish_loading()
            except ValueError as exc:
                raise ValueError(f"{path}: {name}: {exc}") from None
    if partial:
        return kv_cache_scales
    missing = sorted(set(dict(model.named_parameters())) - set(loaded))
    if missing:
        raise ValueError(
            f"{path}: checkpoint lacks {len(missing)} weight(s) of "
            f"{type(model).__name__}: {missing[:10]}{' ...' if len(missing) > 10 else ''}"
        )
    return kv_cache_scales


def iter_safetensors(
    path: str, names: Container[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of a single-file or sharded checkpoint (of those in
    `names` only, the others not read, when given)."""
    from safetensors import safe_open

    for file in safetensors_files(path, names):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if names is None or name in names:
                    yield name, f.get_tensor(name)


def safetensors_files(path: str, names: Container[str] | None = None) -> list[str]:
    """The checkpoint files of a model folder (one file, or the shards of its index); with
    `names`, of a sharded one only the shards its index says hold some of them (an MTP
    head's layer: the last shard or two of hundreds)."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        held = {file for name, file in weight_map.items() if names is None or name in names}
        files = [os.path.join(path, name) for name in sorted(held)]
        if names is not None:
            return files
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (other formats are not supported)")
    return files


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Sequence[tuple[str, str, Hashable]] = (),
    transform: WeightTransform | None = None,
) -> set[str]:
    """Copy checkpoint tensors into `model`'s parameters; return the fully loaded names.

    `transform(name, tensor)` renames/reshapes a checkpoint tensor or returns None to skip it;
    it may also return `(name, tensor, shard_id)`, loaded as that shard of the stacked
    parameter `name` (the experts of a mixture-of-experts layer). `stacked` rows
    `(ours, theirs, shard_id)` send a name containing `theirs` (e.g. ".q_proj.") to the
    `MergedLinear` parameter named with `ours` (".qkv_proj."), shard `shard_id`. A stacked
    parameter counts as loaded once all its shards are. A name that maps to no parameter is
    an error.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    shards_seen: dict[str, set[Hashable]] = defaultdict(set)
    for ckpt_name, ckpt_tensor in weights:
        mapped = transform(ckpt_name, ckpt_tensor) if transform else (ckpt_name, ckpt_tensor)
        if mapped is None:
            continue
        name, tensor = mapped[:2]
        shard = _stacked_shard(name, stacked) if len(mapped) == 2 else (name, mapped[2])
        if shard is not None:
            name, shard_id = shard
        param = _param(params, name, ckpt_name)
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(tensor, QUANTIZED_TENSORS) and not isinstance(module, QUANTIZED_LINEARS):
            tensor = tensor.dequantize(param.dtype)  # a quantized weight we keep 16-bit
        if shard is None and hasattr(module, "load_weight"):  # a tensor-parallel layer's part
            try:
                module.load_weight(param, tensor)
            except ValueError as exc:
                raise ValueError(f"weight {ckpt_name!r} ({name!r}): {exc}") from None
            loaded.add(name)
        elif shard is not None or isinstance(module, QUANTIZED_LINEARS):
            try:
                module.load_shard(param, tensor, shard_id if shard is not None else None)
            except ValueError as exc:
                raise ValueError(f"weight {ckpt_name!r} ({name!r}): {exc}") from None
            if shard is not None:
                shards_seen[name].add(shard_id)
            else:
                loaded.add(name)
        else:
            if param.shape != tensor.shape:
                raise ValueError(
                    f"weight {ckpt_name!r}: checkpoint shape {tuple(tensor.shape)} does not match "
                    f"parameter {name!r} shape {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add(name)
    for name, seen in shards_seen.items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if set(module.shard_ranges) <= seen:  # (expert parallelism: and other ranks' experts)
            loaded.add(name)
    return loaded


def _stacked_shard(
    name: str, stacked: Sequence[tuple[str, str, Hashable]]
) -> tuple[str, Hashable] | None:
    for ours, theirs, shard_id in stacked:
        if theirs in name:
            return name.replace(theirs, ours), shard_id
    return None


def _param(params: dict[str, nn.Parameter], name: str, ckpt_name: str) -> nn.Parameter:
    if name not in params:
        raise ValueError(f"unexpected weight {ckpt_name!r} in checkpoint (no parameter {name!r})")
    return params[name]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
