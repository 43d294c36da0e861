"""Control requests a router fans out to every live worker and waits on: `POST /flush_cache`.

`CacheFlushes.flush()` sends a `FlushCacheReqMsg` to each live worker's stream and waits
(at most `timeout_s`) for their `FlushCacheRespMsg`s, which the broker's reader hands to
`deliver()`. A worker flushes only when idle, as in SGLang; a worker that does not answer
in time counts as not flushed.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import redis

from services.router_protocol import ApiError
from services.router_workers import WorkerTable
from shared.async_bus import AsyncBus
from shared.keys import worker_in_stream
from shared.messages import FlushCacheReqMsg, FlushCacheRespMsg

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
