"""Another checkpoint's weights into the running model, in place: SGLang's
`update_weights_from_disk` (what RL trainers call between rollouts).

The checkpoint must be of the same model: the same architecture and quantization method, and
tensors of the same names and shapes. That is checked first, without touching the served
weights: the checkpoint is loaded into a copy of the model on the meta device (no memory; the
loader's own name mapping, shape checks and missing-weight check run, on tensors that have a
shape but no data). Only then are the real tensors copied into the model's parameters, in
place, so CUDA graphs captured over them stay valid. A failure in that second pass (an
unreadable file) leaves a mix of weights: the caller reloads the old checkpoint then.
Config fields other than the shapes (rope settings, for example) are not applied: they are
logged where the new config differs. An FP8 model quantized while loading (`--quantization
fp8` over a 16-bit checkpoint) is refused: its weights would have to be quantized again.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator

import torch
from torch import nn

from engine.config import ModelConfig
from engine.loader import (
    SAFETENSORS_DTYPES,
    build_model,
    fill_model,
    iter_safetensors,
    safetensors_files,
    tensors_to_read,
)
from engine.quantization import QuantConfig, checkpoint_scheme, sidecar_quantization_config

logger = logging.getLogger(__name__)

_READ_BELOW = 64  # tensors this small are read for real in the dry run (scales, read by value)
_IGNORED = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures"}


def reload_weights(
    model: nn.Module,
    model_config: ModelConfig,
    path: str,
    dtype: torch.dtype,
    quantization: QuantConfig | None,
) -> dict[int, tuple[float, float]]:
    """Copy the checkpoint in `path` into `model` (built from `model_config`); its KV-cache
    scales. ValueError, with nothing changed, if it is not a checkpoint of this model."""
    check_checkpoint(model_config, path, dtype, quantization)
    names = tensors_to_read(model, model_config)  # (an MTP head's: its layer's only)
    return fill_model(model, iter_safetensors(path, names), path, quantization)


def check_checkpoint(
    model_config: ModelConfig, path: str, dtype: torch.dtype, quantization: QuantConfig | None
) -> None:
    """ValueError unless `path` holds a checkpoint of the model of `model_config` (its config,
    and its tensors loaded into a copy of the model on the meta device)."""
    _refuse_quantized_on_load(quantization)
    check_config(model_config, path)
    dry = build_model(model_config, dtype, "meta", quantization)
    try:
        fill_model(dry, meta_safetensors(path), path, quantization)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"{path} does not fit the served model: {exc}") from None


def load_tensors(
    model: nn.Module,
    model_config: ModelConfig,
    named: list[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    quantization: QuantConfig | None,
) -> dict[int, tuple[float, float]]:
    """Copy `named` (checkpoint names and shapes: any part of a checkpoint of this model, as
    SGLang's `update_weights_from_tensor` sends it) into `model`; the KV-cache scales among
    them. ValueError, with nothing changed, if a name is not the model's or a tensor does not
    fit (checked first on a meta copy of the model)."""
    check_tensors(model_config, named, dtype, quantization)
    return fill_model(model, iter(named), "the tensors", quantization, partial=True)


def check_tensors(
    model_config: ModelConfig,
    named: list[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    quantization: QuantConfig | None,
) -> None:
    """ValueError unless `named` fit the model of `model_config` (loaded into a copy of it on
    the meta device)."""
    _refuse_quantized_on_load(quantization)
    if not named:
        raise ValueError("no tensors given")
    dry = build_model(model_config, dtype, "meta", quantization)
    try:
        fill_model(dry, ((n, _shape_of(t)) for n, t in named), "the tensors", quantization,
                   partial=True)  # fmt: skip
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"the tensors do not fit the served model: {exc}") from None


def checkpoint_names(path: str) -> set[str]:
    """The tensor names of the checkpoint in `path` (no data read)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def checkpoint_spec(path: str, name: str) -> tuple[list[int], torch.dtype] | None:
    """The shape and dtype of tensor `name` in the checkpoint in `path` (no data read); None
    if it has none."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            if name in f.keys():
                piece = f.get_slice(name)
                dtype = SAFETENSORS_DTYPES.get(piece.get_dtype(), torch.float32)
                return list(piece.get_shape()), dtype
    return None


def _shape_of(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of `t`'s shape and dtype, or `t` if tiny (a scale is read by value)."""
    return t if t.numel() < _READ_BELOW else torch.empty(t.shape, dtype=t.dtype, device="meta")


def _refuse_quantized_on_load(quantization: QuantConfig | None) -> None:
    if quantization is not None and not quantization.checkpoint:
        raise ValueError("the model was quantized to FP8 as it loaded (--quantization fp8); "
                         "updating its weights is not supported")  # fmt: skip


def check_config(model_config: ModelConfig, path: str) -> None:
    """ValueError unless `path` holds a checkpoint with the served model's architecture and
    quantization; the other config fields that differ are logged (not applied)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"no config.json in {path}")
    with open(config_file) as f:
        new = json.load(f)
    ours = model_config.hf_config.to_dict()
    if new.get("architectures") != ours.get("architectures"):
        raise ValueError(f"{path} is a {new.get('architectures')} checkpoint; the served model "
                         f"is {ours.get('architectures')}")  # fmt: skip
    new_qc = new.get("quantization_config") or sidecar_quantization_config(path) or {}
    method = new_qc.get("quant_method")
    served = (ours.get("quantization_config") or {}).get("quant_method")
    if method != served:
        raise ValueError(f"{path} has quantization {method}; the served model's is {served}")
    # (integer weights: the words must be the served layers', stored alike)
    new_scheme = checkpoint_scheme(new_qc)
    scheme = checkpoint_scheme(ours.get("quantization_config"))
    if scheme is not None and new_scheme is not None and (
        (new_scheme.describe(), new_scheme.layout) != (scheme.describe(), scheme.layout)
    ):  # fmt: skip
        raise ValueError(f"{path} holds {new_scheme.describe()} weights; the served model's "
                         f"are {scheme.describe()}")  # fmt: skip
    differ = sorted(k for k in new if k not in _IGNORED and k in ours and new[k] != ours[k])
    if differ:
        logger.warning("weights from %s: its config differs in %s (not applied)", path, differ)


def meta_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors as meta tensors of their shapes and dtypes (no data read),
    except the tiny ones, read (a KV-cache scale is taken by value)."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                shape = piece.get_shape()
                if math.prod(shape) < _READ_BELOW or piece.get_dtype() not in SAFETENSORS_DTYPES:
                    yield name, f.get_tensor(name)
                else:
                    dtype = SAFETENSORS_DTYPES[piece.get_dtype()]
                    yield name, torch.empty(shape, dtype=dtype, device="meta")
