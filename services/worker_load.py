"""The load a worker reports in its heartbeat (`WorkerLoadMsg`), read by routers.

The scheduler's state is only touched on the scheduler thread: the loop takes
`load_figures` (cheap; at most every `REFRESH_EVERY_S`) and sends them to the I/O process,
whose heartbeat builds its payload from the last figures (`LoadReporter`).
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

from engine.pooling import matryoshka_dimensions
from shared.messages import WorkerLoadMsg

REFRESH_EVERY_S = 0.25


class LoadFigures(NamedTuple):
    num_running: int = 0
    num_waiting: int = 0
    num_used_tokens: int = 0
    num_cached_tokens: int = 0
    token_usage: float = 0.0
    generation_tokens: int = 0
    num_retracted: int = 0
    spec_accept_length: float = 0.0
    reqs_by_router: dict[str, int] = {}  # noqa: RUF012 (a NamedTuple default, never mutated)
    host_cache_tokens: int = 0  # the hierarchical cache's host pool (engine/mem_cache/)
    host_cache_used_tokens: int = 0
    host_cache_hit_tokens: int = 0
    spec_num_drafts: int = 0  # speculative decoding's counts (engine/speculative/)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []  # noqa: RUF012 (a NamedTuple default, never mutated)


class WorkerFacts(NamedTuple):
    """What a worker's heartbeat says that changes only by request (LoRA adapters loaded,
    weights updated: services/worker.py sends the new facts)."""

    worker_id: str
    model: str
    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    pid: int
    lora_adapters: list[str] = []  # noqa: RUF012 (a NamedTuple default, never mutated)
    is_embedding: bool = False
    matryoshka_dimensions: list[int] | None = None  # (engine/pooling.py)
    labels: list[str] | None = None  # a sequence classifier's
    weights_path: str = ""  # where not `model`: the checkpoint of an update_weights_from_disk
    tp_size: int = 1  # the devices the model is split over

    @classmethod
    def of(cls, scheduler: Any, worker_id: str, model: str) -> WorkerFacts:
        embedding = scheduler.args.is_embedding
        config = scheduler.model_runner.model_config
        return cls(
            worker_id,
            model,
            scheduler.pools.allocator.size,
            scheduler.max_running_requests,
            scheduler.context_len,
            os.getpid(),
            sorted(scheduler.lora_ids),
            embedding,
            matryoshka_dimensions(config.hf_config) if embedding and not config.labels else None,
            list(config.labels) if config.labels else None,
            other_checkpoint(getattr(scheduler, "weights_path", ""), model),
            scheduler.args.tp_size,
        )


def other_checkpoint(weights_path: str, model: str) -> str:
    """`weights_path` if the weights are not `model`'s (a weights update), else ""."""
    same = not weights_path or os.path.realpath(weights_path) == os.path.realpath(model)
    return "" if same else weights_path


def load_figures(scheduler: Any) -> LoadFigures:
    """The scheduler's figures now (on the scheduler thread)."""
    stats, pools = scheduler.stats, scheduler.pools
    drafter = getattr(scheduler, "drafter", None)  # speculative decoding's
    cached = pools.tree_cache.evictable_size()
    used = pools.allocator.size - pools.allocator.available_size() - cached
    host = pools.tree_cache.host_stats()
    spec = drafter.stats if drafter is not None else None
    return LoadFigures(
        stats.num_running,
        stats.num_waiting,
        max(0, used),
        cached,
        stats.token_usage,
        stats.generation_tokens,
        stats.num_retractions,
        spec.accept_length if spec is not None else 0.0,
        host_cache_tokens=host.get("hicache_host_tokens", 0),
        host_cache_used_tokens=host.get("hicache_host_used_tokens", 0),
        host_cache_hit_tokens=host.get("hicache_host_hit_tokens", 0),
        spec_num_drafts=spec.num_drafts if spec is not None else 0,
        spec_draft_tokens=spec.draft_tokens if spec is not None else 0,
        spec_accepted_tokens=spec.accepted_tokens if spec is not None else 0,
        spec_accepted_per_pos=list(spec.accepted_per_pos) if spec is not None else [],
    )


class LoadReporter:
    """The heartbeat payload from the last figures (in the I/O process)."""

    def __init__(self, facts: WorkerFacts) -> None:
        self.facts = facts
        self.figures = LoadFigures()
        self._rate = (time.monotonic(), 0)  # (when, generation tokens) at the last beat

    def payload(self) -> WorkerLoadMsg:
        """The heartbeat payload; throughput since the last one."""
        f, facts = self.figures, self.facts
        now = time.monotonic()
        then, tokens = self._rate
        self._rate = (now, f.generation_tokens)
        return WorkerLoadMsg(
            worker_id=facts.worker_id,
            model=facts.model,
            num_running_reqs=f.num_running,
            num_waiting_reqs=f.num_waiting,
            num_used_tokens=f.num_used_tokens,
            num_cached_tokens=f.num_cached_tokens,
            max_total_num_tokens=facts.max_total_num_tokens,
            max_running_requests=facts.max_running_requests,
            context_len=facts.context_len,
            token_usage=f.token_usage,
            gen_throughput=max(0, f.generation_tokens - tokens) / max(now - then, 1e-3),
            host=os.uname().nodename,
            pid=facts.pid,
            updated_at=time.time(),
            num_retracted_reqs=f.num_retracted,
            lora_adapters=list(facts.lora_adapters),
            spec_accept_length=f.spec_accept_length,
            is_embedding=facts.is_embedding,
            matryoshka_dimensions=facts.matryoshka_dimensions,
            labels=facts.labels,
            weights_path=facts.weights_path,
            reqs_by_router=dict(f.reqs_by_router),
            host_cache_tokens=f.host_cache_tokens,
            host_cache_used_tokens=f.host_cache_used_tokens,
            host_cache_hit_tokens=f.host_cache_hit_tokens,
            tp_size=facts.tp_size,
            spec_num_drafts=f.spec_num_drafts,
            spec_draft_tokens=f.spec_draft_tokens,
            spec_accepted_tokens=f.spec_accepted_tokens,
            spec_accepted_per_pos=list(f.spec_accepted_per_pos),
        )
