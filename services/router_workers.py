"""The live workers as one router sees them, and the choice of a worker for a request.

The table is refreshed from heartbeats (`WorkerLoadMsg`) a few times a second. A worker's
load is the requests this router has in flight on it, counted as they are sent and end,
plus those of the other routers, from its heartbeat (which counts them by router): a
heartbeat lags by up to a second, so the router's own requests are not taken from it. A
worker is identified by id and pid: a worker restarted under the same id has lost its
requests.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable

from services.router_fields import ApiError
from services.router_policy import Policy, ShortestQueue
from shared.messages import WorkerLoadMsg

logger = logging.getLogger(__name__)


class WorkerTable:
    def __init__(self, policy: Policy | None = None, router_id: str = "") -> None:
        self.router_id = router_id
        self.live: dict[str, WorkerLoadMsg] = {}
        self.inflight: Counter[str] = Counter()
        self.policy = policy or ShortestQueue()
        self.routed: Counter[tuple[str, str]] = Counter()  # (worker, why) -> requests sent

    def update(self, live: dict[str, WorkerLoadMsg]) -> None:
        gone = self.live.keys() - live.keys()
        new = live.keys() - self.live.keys()
        if gone or new:
            logger.info(
                "workers: %s live (joined %s, gone %s)", sorted(live), sorted(new), sorted(gone)
            )
        restarted = {w for w in live.keys() & self.live.keys() if live[w].pid != self.live[w].pid}
        for w in gone | restarted:  # what they cached is gone with them
            self.policy.forget(w)
        self.live = live

    def load(self, worker_id: str) -> int:
        others = self.live[worker_id].reqs_by_router
        return self.inflight[worker_id] + sum(n for r, n in others.items() if r != self.router_id)

    def choose(
        self,
        exclude: Iterable[str] = (),
        lora: str | None = None,
        embedding: bool = False,
        key: str | None = None,
    ) -> WorkerLoadMsg | None:
        """The live worker the routing policy picks for a request whose prompt is keyed `key`
        (`router_policy.routing_key`), of those not in `exclude`, serving the LoRA adapter
        `lora` if one is named, and of the kind asked for (an embedding model or a
        generative one); None if there is none."""
        skip = set(exclude)
        candidates = [
            w for w, hb in self.live.items()
            if w not in skip and (lora is None or lora in hb.lora_adapters)
            and hb.is_embedding == embedding
        ]  # fmt: skip
        if not candidates:
            return None
        chosen, reason = self.policy.pick([self.live[w] for w in candidates], key, self.load)
        self.routed[chosen, reason] += 1
        return self.live[chosen]

    def none_for(self, embedding: bool) -> ApiError:
        """The error when no worker can take a request: a 400 if live workers all serve the
        other kind of model (embedding or generative), else a 503."""
        kinds = {hb.is_embedding for hb in self.live.values()}
        if kinds and embedding not in kinds:
            msg = ("the model is a generative model: the pooling APIs (embeddings, classify, "
                   "score, rerank) need a worker run with --is-embedding or a classifier"
                   if embedding else "the model is a pooling model (an embedding model or a "
                   "classifier): use /v1/embeddings, /v1/classify, /v1/score or /v1/rerank"
                   )  # fmt: skip
            return ApiError(400, msg, None, "invalid_request")
        return ApiError(503, "no live worker can take the request", None, "no_worker")

    def pooling_labels(self) -> list[str] | None:
        """The label names of the deployment's pooling model (None: an embedding model); an
        error without a pooling worker, or with workers of both kinds."""
        kinds = {tuple(hb.labels or ()) for hb in self.live.values() if hb.is_embedding}
        if not kinds:
            raise self.none_for(True)
        if len(kinds) > 1:
            raise ApiError(400, "the pooling workers serve different models (a classifier "
                           "and an embedding model)", None, "invalid_request")  # fmt: skip
        (labels,) = kinds
        return list(labels) or None

    @property
    def embedding_only(self) -> bool:
        """Every live worker (at least one) serves an embedding model."""
        return bool(self.live) and all(hb.is_embedding for hb in self.live.values())

    def is_alive(self, worker_id: str, pid: int) -> bool:
        hb = self.live.get(worker_id)
        return hb is not None and hb.pid == pid

    def started(self, worker_id: str) -> None:
        self.inflight[worker_id] += 1

    def ended(self, worker_id: str) -> None:
        self.inflight[worker_id] -= 1
        if self.inflight[worker_id] <= 0:
            del self.inflight[worker_id]

    @property
    def context_len(self) -> int | None:
        """The smallest context length of the live workers (what any request must fit)."""
        return min((hb.context_len for hb in self.live.values()), default=None)

    def resolve_model(self, name: str, served_name: str) -> str | None:
        """The LoRA adapter a request's `model` names: None for the base model (its served
        name, path or folder name), the adapter for an adapter's name (vLLM) or for
        `base:adapter` (SGLang); KeyError for anything else."""
        bases = self.model_names() | {served_name}
        if name in bases:
            return None
        adapters = self.lora_adapters()
        if name in adapters:
            return name
        base, sep, adapter = name.rpartition(":")
        if sep and base in bases and adapter in adapters:
            return adapter
        raise KeyError(name)

    def lora_adapters(self) -> set[str]:
        """The LoRA adapters some live worker serves."""
        return {name for hb in self.live.values() for name in hb.lora_adapters}

    def model_names(self) -> set[str]:
        """Names the workers' models answer to: the path as given and its last component."""
        names = set()
        for hb in self.live.values():
            names |= {hb.model, os.path.basename(hb.model.rstrip("/"))}
        return names - {""}
