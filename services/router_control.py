"""Control requests: `POST /flush_cache`, which a router fans out to every live worker and
waits on, and `POST /abort_request`, which ends requests the client named.

`CacheFlushes.flush()` sends a `FlushCacheReqMsg` to each live worker's stream and waits
(at most `timeout_s`) for their `FlushCacheRespMsg`s, which the broker's reader hands to
`deliver()`. A worker flushes only when idle, as in SGLang; a worker that does not answer
in time counts as not flushed.

`NamedRequests` finds the requests in flight by the `rid` their client gave (SGLang's field
of /generate and of the OpenAI bodies); a rid names one request in flight at a time. An
abort goes to the request's worker, which ends it as it would any request: the response
(or stream) finishes normally, with what was generated and finish_reason `abort`. Only the
requests of this router are found: behind several routers, send the abort to the one that
holds the request.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis

from services.router_fields import RequestId, _Strict
from services.router_protocol import ApiError
from services.router_workers import WorkerTable
from shared.async_bus import AsyncBus
from shared.keys import worker_in_stream
from shared.messages import FlushCacheReqMsg, FlushCacheRespMsg

if TYPE_CHECKING:
    from services.router_handle import RequestHandle

FLUSH_TIMEOUT_S = 10.0


@dataclass
class _Pending:
    workers: set[str]
    replies: dict[str, FlushCacheRespMsg] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class CacheFlushes:
    def __init__(self, bus: AsyncBus, router_id: str, workers: WorkerTable) -> None:
        self.bus, self.router_id, self.workers = bus, router_id, workers
        self._pending: dict[str, _Pending] = {}

    async def flush(
        self, timeout_s: float = FLUSH_TIMEOUT_S
    ) -> dict[str, FlushCacheRespMsg | None]:
        """Each live worker's answer (None: no answer in time)."""
        ids = sorted(self.workers.live)
        if not ids:
            raise ApiError(503, "no live worker", None, "no_worker")
        request_id = uuid.uuid4().hex
        pending = self._pending[request_id] = _Pending(set(ids))
        msg = FlushCacheReqMsg(request_id, self.router_id)
        try:
            await self.bus.publish_many([(worker_in_stream(self.bus.prefix, w), msg) for w in ids])
            await asyncio.wait_for(pending.done.wait(), timeout_s)
        except redis.RedisError as exc:
            raise ApiError(503, f"message bus unavailable: {exc}", None, "bus_unavailable") from exc
        except asyncio.TimeoutError:
            pass
        finally:
            del self._pending[request_id]
        return {w: pending.replies.get(w) for w in ids}

    def deliver(self, msg: FlushCacheRespMsg) -> None:
        pending = self._pending.get(msg.request_id)
        if pending is None:  # too late, or not ours
            return
        pending.replies[msg.worker_id] = msg
        if pending.workers <= pending.replies.keys():
            pending.done.set()


class AbortBody(_Strict):
    """SGLang's /abort_request: the requests with `rid`, or all of them (`abort_all`)."""

    rid: RequestId | None = None
    abort_all: bool = False


class NamedRequests:
    """The handles in flight whose client gave them a rid (see module doc)."""

    def __init__(self) -> None:
        self._by_rid: dict[str, list[RequestHandle]] = {}

    def add(self, handles: list[RequestHandle]) -> None:
        """Name the handles of a new request; 400 if its rid names one in flight."""
        taken = sorted({h.sub.rid for h in handles if h.sub.rid in self._by_rid})
        if taken:
            msg = f"rid {taken[0]!r} names a request in flight"
            raise ApiError(400, msg, "rid", "duplicate_rid")
        for h in handles:
            if h.sub.rid is not None:
                self._by_rid.setdefault(h.sub.rid, []).append(h)

    def discard(self, handle: RequestHandle) -> None:
        group = self._by_rid.get(handle.sub.rid or "")
        if group is not None and handle in group:
            group.remove(handle)
            if not group:
                del self._by_rid[handle.sub.rid or ""]

    def get(self, rid: str) -> list[RequestHandle]:
        return list(self._by_rid.get(rid, ()))
