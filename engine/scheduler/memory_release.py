"""A scheduler's device memory given back while no request holds K/V, and taken again
(SGLang's `release_memory_occupation` / `resume_memory_occupation`, vLLM's `sleep` /
`wake_up`; what is released and how is engine/memory_occupation.py, on the model runner).

A release first brings the requests to rest (`Pausing.settle`) and is refused while any
holds K/V (pause in mode abort or retract first, or let them end); requests waiting are kept.
Releasing "kv_cache" empties the prefix cache. While weights or K/V are released nothing
runs (`asleep`: the worker does not step; `Engine.generate` refuses); requests may still be
added, and wait. A weights update meanwhile takes the weights back (its checkpoint in them).
A mixin of `Scheduler` (engine/scheduler/scheduler.py); the runner's calls go through
`_on_device`, which reaches the device process or the overlap executor's thread in order.
A draft model's runner (speculative decoding, engine/speculative/draft_model.py) releases and
takes back the same tags.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine.memory_occupation import check_tags


class MemoryRelease:
    tree_cache: Any
    settle: Any
    holds_kv: Any
    _on_device: Any
    drafter: Any
    released_memory: frozenset[str]
    weights_missing: int

    @property
    def asleep(self) -> bool:
        """Whether weights or K/V are released, or weights discarded at a release were not
        all sent again (nothing may run)."""
        return bool(self.released_memory & {"weights", "kv_cache"}) or self.weights_missing > 0

    def release_memory_occupation(
        self, tags: Iterable[str] | None = None, backup_weights: bool = False
    ) -> int:
        """Give back the memory of `tags` (None: all of MEMORY_TAGS); the bytes freed.
        ValueError, nothing released, for an unknown tag or while a request holds K/V."""
        tags = check_tags(tags)
        self.settle()
        if self.holds_kv():
            raise ValueError("requests are running: release the memory when none holds K/V "
                             "(pause generation in mode abort or retract first, or let them "
                             "end)")  # fmt: skip
        new = tuple(t for t in tags if t not in self.released_memory)
        freed = self._on_device("release_memory_occupation", new, backup_weights) if new else 0
        if new and self.drafter is not None:  # a draft model's memory goes too
            freed += self.drafter.release_memory_occupation(new, backup_weights)
        if "kv_cache" in new:
            self.tree_cache.reset()  # (its K/V are forgotten)
        self.released_memory |= set(new)
        return freed

    def resume_memory_occupation(self, tags: Iterable[str] | None = None) -> int:
        """Take the memory of `tags` (None: all) again; the bytes. ValueError for an unknown
        tag; one not released is left as it is."""
        tags = tuple(t for t in check_tags(tags) if t in self.released_memory)
        taken = self._on_device("resume_memory_occupation", tags) if tags else 0
        if tags and self.drafter is not None:
            taken += self.drafter.resume_memory_occupation(tags)
        self.released_memory -= set(tags)
        if "weights" in tags:
            self.weights_missing = self._on_device("missing_weights")
        return taken

    def memory_occupied(self) -> dict[str, int]:
        """The bytes the weights and the K/V buffers hold now (where the model is)."""
        return self._on_device("memory_occupied")

