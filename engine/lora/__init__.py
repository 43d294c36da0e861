"""Multi-LoRA serving: PEFT adapters applied per request, several per batch (as SGLang's
`--lora-paths`, vLLM's `--lora-modules`), loaded at start or into a running engine. See
adapter.py (the files), layers.py (the math), manager.py (device slots and per-batch masks),
registry.py (the names requests use, and adapters loaded and unloaded at run time)."""

from __future__ import annotations

from engine.lora.adapter import AdapterSpec, parse_lora_paths, read_adapter_specs

__all__ = ["DEFAULT_MAX_LORA_RANK", "AdapterSpec", "lora_rank", "parse_lora_paths",
           "read_adapter_specs"]  # fmt: skip

# the slots' rank when neither `max_lora_rank` nor an adapter at start says (vLLM's default)
DEFAULT_MAX_LORA_RANK = 16


def lora_rank(args, specs: list[AdapterSpec]) -> int:
    """The rank slots are sized for: `max_lora_rank`, else the largest adapter's at start,
    else DEFAULT_MAX_LORA_RANK."""
    return args.max_lora_rank or max((s.rank for s in specs), default=DEFAULT_MAX_LORA_RANK)
