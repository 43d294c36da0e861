"""Multi-LoRA serving: PEFT adapters applied per request, several per batch (as SGLang's
`--lora-paths`, vLLM's `--lora-modules`). See adapter.py (the files), layers.py (the math),
manager.py (device slots and per-batch masks)."""

from __future__ import annotations

from engine.lora.adapter import AdapterSpec, parse_lora_paths, read_adapter_specs

__all__ = ["AdapterSpec", "lora_rank", "parse_lora_paths", "read_adapter_specs"]


def lora_rank(args, specs: list[AdapterSpec]) -> int:
    """The rank slots are sized for: `max_lora_rank`, else the largest adapter's."""
    return args.max_lora_rank or max(s.rank for s in specs)
