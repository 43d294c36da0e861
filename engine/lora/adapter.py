"""LoRA adapters as PEFT saves them, and the names a server knows them by.

A PEFT folder holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `target_modules`)
and `adapter_model.safetensors`, whose tensors are named
`base_model.model.<module path>.lora_A.weight` ([r, in_features]) and `...lora_B.weight`
([out_features, r]). A LoRA adds `scaling * B @ A` to the module's weight, with scaling
`lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA); PEFT's `rank_pattern` and
`alpha_pattern` give some modules their own r and alpha (`module_rank_and_scaling`). What PEFT
can save but this engine does not serve (DoRA, biases, extra trained modules,
`fan_in_fan_out`) is refused when the adapter is loaded, with the setting named.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_UNSUPPORTED = {  # config key -> its value when the feature is off
    "use_dora": False,
    "bias": "none",
    "modules_to_save": None,
    "fan_in_fan_out": False,
    "lora_bias": False,
}


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter as the scheduler sees it: its id in batches (1..N; 0 is the base model),
    name, folder and rank (its largest module's, with a `rank_pattern`), read from the config
    alone; `scaling` is that of the modules without a pattern of their own."""

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
    rank = max([int(config["r"]), *(config.get("rank_pattern") or {}).values()])
    return AdapterSpec(adapter_id, name, path, rank, _scaling(config, None), config)


def module_rank_and_scaling(spec: AdapterSpec, module: str) -> tuple[int, float]:
    """(rank, scaling) of the adapter's module `module` (its path in the base model): those
    of the first `rank_pattern` / `alpha_pattern` key that matches the end of the path, as
    PEFT's `get_pattern_key` picks them, else the adapter's `r` and `lora_alpha`."""
    config = spec.config
    rank = pattern_value(config.get("rank_pattern"), module, config["r"])
    return int(rank), _scaling(config, module)


def pattern_value(patterns: dict | None, module: str | None, default: float) -> float:
    """The value of the first key of `patterns` (a `rank_pattern` or `alpha_pattern`) that
    matches the end of the module path `module` (PEFT's `get_pattern_key`), else `default`."""
    for pattern, value in (patterns or {}).items():
        if module is not None and re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _scaling(config: dict, module: str | None) -> float:
    rank = pattern_value(config.get("rank_pattern"), module, config["r"])
    alpha = pattern_value(config.get("alpha_pattern"), module,
                          config.get("lora_alpha", config["r"]))  # fmt: skip
    return float(alpha) / math.sqrt(rank) if config.get("use_rslora") else float(alpha) / rank


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
    for key, kind in (("rank_pattern", int), ("alpha_pattern", (int, float))):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict) or not all(
            isinstance(v, kind) and not isinstance(v, bool) and v > 0 for v in patterns.values()
        ):  # fmt: skip
            raise ValueError(f"LoRA adapter {name!r}: {key} must map module patterns to "
                             f"positive numbers, got {patterns!r}")  # fmt: skip
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"LoRA adapter {name!r}: {key} key {pattern!r} is not a "
                                 f"regular expression ({e})") from None  # fmt: skip
    return config


def load_adapter_weights(
    spec: AdapterSpec, dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{module path in the base model: (A [r, in], B [out, r])}` on the CPU in `dtype`; a
    module with a scaling of its own (`rank_pattern`, `alpha_pattern`) has it over the
    adapter's folded into B (the slots apply the adapter's)."""
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
        rank, scaling = module_rank_and_scaling(spec, module)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"LoRA adapter {spec.name!r}: {module} has A {tuple(a.shape)}, B "
                f"{tuple(b.shape)}; expected rank {rank}"
            )
        if scaling != spec.scaling:
            b = (b.float() * (scaling / spec.scaling)).to(dtype)
        out[module] = (a, b)
    if not out:
        raise ValueError(f"LoRA adapter {spec.name!r}: {WEIGHTS_FILE} has no LoRA tensors")
    return out
