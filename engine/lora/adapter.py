"""LoRA adapters as PEFT saves them, and the names a server knows them by.

A PEFT folder holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `target_modules`)
and `adapter_model.safetensors`, whose tensors are named
`base_model.model.<module path>.lora_A.weight` ([r, in_features]) and `...lora_B.weight`
([out_features, r]). A LoRA adds `scaling * B @ A` to the module's weight, with scaling
`lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA). What PEFT can save but this engine does
not serve (DoRA, biases, extra trained modules, per-module ranks, `fan_in_fan_out`) is refused
when the adapter is loaded, with the setting named.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_UNSUPPORTED = {  # config key -> its value when the feature is off
    "use_dora": False,
    "bias": "none",
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "fan_in_fan_out": False,
    "lora_bias": False,
}


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter as the scheduler sees it: its id in batches (1..N; 0 is the base model),
    name, folder and rank, read from the config alone."""

    id: int
    name: str
    path: str
    rank: int
    scaling: float
    config: dict = field(repr=False, compare=False)


def parse_lora_paths(entries: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`name=path` or `path` (named by its last folder), as SGLang's `--lora-paths` and vLLM's
    `--lora-modules` take them, in order; a repeated name is an error."""
    out: dict[str, str] = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep:
            path, name = entry, os.path.basename(entry.rstrip("/"))
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise ValueError(f"lora_paths: {entry!r} is not NAME=PATH or PATH")
        if name in out:
            raise ValueError(f"lora_paths: the name {name!r} is given twice")
        out[name] = path
    return out


def read_adapter_specs(entries: tuple[str, ...] | list[str]) -> list[AdapterSpec]:
    """The adapters of `lora_paths`, ids in the order given; raises ValueError for a folder
    that is not a LoRA this engine can serve."""
    return [
        read_adapter_spec(i, name, path)
        for i, (name, path) in enumerate(parse_lora_paths(entries).items(), start=1)
    ]


def read_adapter_spec(adapter_id: int, name: str, path: str) -> AdapterSpec:
    """One adapter's spec from its folder's config; ValueError if the engine cannot serve it."""
    config = _read_config(name, path)
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterSpec(adapter_id, name, path, rank, scaling, config)


def _read_config(name: str, path: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {path}")
    with open(config_path) as f:
        config = json.load(f)
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {kind} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    for key, off in _UNSUPPORTED.items():
        value = config.get(key, off)
        if value != off and not (off is None and not value):
            raise ValueError(f"LoRA adapter {name!r}: {key}={value!r} is not supported")
    return config


def load_adapter_weights(
    spec: AdapterSpec, dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{module path in the base model: (A [r, in], B [out, r])}` on the CPU in `dtype`."""
    from safetensors.torch import load_file

    file = os.path.join(spec.path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {spec.name!r}: no {WEIGHTS_FILE} in {spec.path}")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(file).items():
        module, sep, rest = key.rpartition(".lora_")
        if not sep or rest not in ("A.weight", "B.weight"):
            raise ValueError(f"LoRA adapter {spec.name!r}: unexpected tensor {key!r}")
        module = module.removeprefix(_PREFIX)
        halves.setdefault(module, {})[rest[0]] = tensor.to(dtype)
    out = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {spec.name!r}: {module} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != spec.rank or b.shape[1] != spec.rank:
            raise ValueError(
                f"LoRA adapter {spec.name!r}: {module} has A {tuple(a.shape)}, B "
                f"{tuple(b.shape)}; expected rank {spec.rank}"
            )
        out[module] = (a, b)
    if not out:
        raise ValueError(f"LoRA adapter {spec.name!r}: {WEIGHTS_FILE} has no LoRA tensors")
    return out
