"""Heartbeat payloads: the value of each service's liveness key (see shared.heartbeat)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages.base import Message


@dataclass(frozen=True, slots=True)
class WorkerLoadMsg(Message):
    """A worker's liveness and load, read by routers to choose a worker and to fail over.

    Token figures count KV-cache slots: `num_used_tokens` of `max_total_num_tokens` are
    held by running requests (`token_usage` is their ratio, 0..1); `num_cached_tokens` are
    held only by the prefix cache and can be evicted. `num_retracted_reqs` counts the
    requests the worker has retracted to its queue for lack of KV memory since it started.
    `updated_at` is `time.time()`. `lora_adapters`: the names of the LoRA adapters it serves.
    `spec_accept_length`: with speculative decoding, the tokens per request and verify step
    since it started (1 + accepted drafts; SGLang's avg_spec_accept_length), else 0.
    `is_embedding`: it serves an embedding model (embedding requests only);
    `matryoshka_dimensions`: the sizes its embeddings may be cut to (`dimensions`), [] for
    any, None if the model has no matryoshka representations. `labels`: a sequence
    classifier's label names by index (its pooling requests come back as one logit per
    label: `/v1/classify`, `/v1/score`, `/v1/rerank`); None for any other model.
    `weights_path`: the checkpoint its weights are from, where it is not `model` (after
    `POST /update_weights_from_disk`), else "". `reqs_by_router`: its running and waiting
    requests by the router that sent them (a router counts its own live, and adds the
    others' from here). With the hierarchical cache: `host_cache_tokens`, the host pool's
    slots (0 without it), `host_cache_used_tokens` of them holding K/V, and
    `host_cache_hit_tokens`, prompt tokens loaded back from it instead of computed since
    the worker started. `tp_size`: the devices its model is split over (tensor parallelism).
    With speculative decoding, since the worker started: `spec_num_drafts`, requests of
    verify steps that had drafts; `spec_draft_tokens`, drafts proposed; and
    `spec_accepted_tokens`, drafts accepted (vLLM's spec_decode counters); and
    `spec_accepted_per_pos`, drafts accepted at each position of a step's drafts.
    """

    TAG = "worker_load"
    VERSION = 11  # 3: lora_adapters; 4: spec_accept_length; 5: is_embedding; 6: labels;
    # 7: weights_path; 8: reqs_by_router; 9: host_cache_*; 10: tp_size; 11: spec_* counts

    worker_id: str
    model: str
    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    num_cached_tokens: int
    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    token_usage: float
    gen_throughput: float
    host: str
    pid: int
    updated_at: float
    num_retracted_reqs: int = 0
    lora_adapters: list[str] = field(default_factory=list)
    spec_accept_length: float = 0.0
    is_embedding: bool = False
    matryoshka_dimensions: list[int] | None = None
    labels: list[str] | None = None
    weights_path: str = ""
    reqs_by_router: dict[str, int] = field(default_factory=dict)
    host_cache_tokens: int = 0
    host_cache_used_tokens: int = 0
    host_cache_hit_tokens: int = 0
    tp_size: int = 1
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def spec_accept_rate(self) -> float:
        """Drafts accepted per draft proposed (0 without drafts)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0


@dataclass(frozen=True, slots=True)
class ServiceStatusMsg(Message):
    """Liveness of a tokenizer, detokenizer or router (`kind`), identified by `service_id`.

    `num_handled` counts messages the service has processed since `started_at`.
    """

    TAG = "service_status"
    VERSION = 1

    kind: str
    service_id: str
    host: str
    pid: int
    started_at: float
    updated_at: float
    num_handled: int = 0
