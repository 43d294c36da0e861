"""The load a worker reports in its heartbeat (`WorkerLoadMsg`), read by routers.

The scheduler's state is only touched on the scheduler thread: the loop calls `refresh()`
(cheap, rate-limited) and the heartbeat thread builds its payload from the last figures.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from shared.messages import WorkerLoadMsg

REFRESH_EVERY_S = 0.25


@dataclass(frozen=True)
class LoadFigures:
    num_running: int = 0
    num_waiting: int = 0
    num_used_tokens: int = 0
    num_cached_tokens: int = 0
    token_usage: float = 0.0
    generation_tokens: int = 0
    num_retracted: int = 0


class LoadReporter:
    def __init__(self, scheduler: Any, worker_id: str, model: str) -> None:
        self.scheduler = scheduler
        self.worker_id = worker_id
        self.model = model
        self._figures = LoadFigures()
        self._next_refresh = 0.0
        self._rate = (time.monotonic(), 0)  # (when, generation tokens) at the last beat

    def refresh(self) -> None:
        """Take the scheduler's figures (on the scheduler thread; at most every 0.25 s)."""
        now = time.monotonic()
        if now < self._next_refresh:
            return
        self._next_refresh = now + REFRESH_EVERY_S
        stats, pools = self.scheduler.stats, self.scheduler.pools
        cached = pools.tree_cache.evictable_size()
        used = pools.allocator.size - pools.allocator.available_size() - cached
        self._figures = LoadFigures(
            stats.num_running,
            stats.num_waiting,
            max(0, used),
            cached,
            stats.token_usage,
            stats.generation_tokens,
            stats.num_retractions,
        )

    def payload(self) -> WorkerLoadMsg:
        """The heartbeat payload (on the heartbeat thread); throughput since the last one."""
        f = self._figures
        now = time.monotonic()
        then, tokens = self._rate
        self._rate = (now, f.generation_tokens)
        return WorkerLoadMsg(
            worker_id=self.worker_id,
            model=self.model,
            num_running_reqs=f.num_running,
            num_waiting_reqs=f.num_waiting,
            num_used_tokens=f.num_used_tokens,
            num_cached_tokens=f.num_cached_tokens,
            max_total_num_tokens=self.scheduler.pools.allocator.size,
            max_running_requests=self.scheduler.max_running_requests,
            context_len=self.scheduler.context_len,
            token_usage=f.token_usage,
            gen_throughput=max(0, f.generation_tokens - tokens) / max(now - then, 1e-3),
            host=os.uname().nodename,
            pid=os.getpid(),
            updated_at=time.time(),
            num_retracted_reqs=f.num_retracted,
        )
