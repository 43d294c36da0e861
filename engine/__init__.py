"""The sluice engine: scheduler, memory, prefix cache, model runner, and the offline API."""

from __future__ import annotations

from typing import Any

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import engine.config` does not load torch models.
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    raise AttributeError(name)
