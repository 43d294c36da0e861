"""One sub-request's side of the router: `RequestHandle`, from its submission to its last
delta, and `merged`, the deltas of a request's sub-requests as they come.

A handle's inbox takes what the broker (services/router_requests.py) hands it: the request's
`DetokRow`s, an `ErrorMsg`, or an `ApiError` from the broker's watchdog (timeout, dead worker).
`deltas()` turns the rows into `Delta`s in token order; `close()` before the end (client gone,
task cancelled, timeout, a stop string the router cut) aborts the request at its worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from services.router_protocol import ApiError, SubRequest
from services.router_stream import Delta, OutputAssembler
from shared.messages import DetokRow, ErrorMsg, WorkerLoadMsg

if TYPE_CHECKING:
    from services.router_requests import Broker


class RequestHandle:
    """One sub-request from submission to its last delta (see module doc)."""

    def __init__(self, broker: Broker, sub: SubRequest, arrived: float) -> None:
        self.broker, self.sub, self.arrived = broker, sub, arrived
        self.deadline = arrived + broker.request_timeout_s
        self.rid = ""
        self.worker: WorkerLoadMsg | None = None
        self.tried: list[str] = []
        self.assembler = OutputAssembler(sub.stop, sub.sampling_params.get("no_stop_trim", False))
        self.ttft: float | None = None
        self.observed = True  # in the metrics (a health check is not)
        self.cancelled = ""  # why, once /abort_request asked for its end
        self.failed = False
        self.closed = False
        self.waiting = False
        self._inbox: list[DetokRow | ErrorMsg | ApiError] = []
        self._wake = asyncio.Event()

    def deliver(self, item: DetokRow | ErrorMsg | ApiError) -> None:
        self._inbox.append(item)
        self._wake.set()

    async def deltas(self) -> AsyncIterator[Delta]:
        """The request's output in order; raises ApiError if it fails. Closes when done."""
        try:
            while not self.assembler.finished:
                items = await self._take()
                rows = [m for m in items if isinstance(m, DetokRow)]
                delta = self.assembler.add(rows) if rows else None
                if delta is not None:
                    self._observe(delta)
                    yield delta
                failure = next((m for m in items if not isinstance(m, DetokRow)), None)
                if failure is not None and not self.assembler.finished:
                    raise self._error(failure)
        finally:
            self.close()

    def close(self) -> None:
        """Forget the request; abort it at the worker unless it ended there."""
        if self.closed:
            return
        self.closed = True
        self.broker.forget(self)
        self.broker.named.discard(self)
        a = self.assembler
        if self.worker is not None and not self.failed and (a.stopped_here or not a.finished):
            self.broker.abort(self, "stop string" if a.stopped_here else "client gone")
        if self.observed and (not a.finished or self.cancelled):
            self.broker.metrics.observe_abort()

    @property
    def public_rid(self) -> str:
        """The request's id in responses: its client's rid, else the router's."""
        return self.sub.rid or self.rid

    async def _take(self) -> list[DetokRow | ErrorMsg | ApiError]:
        while not self._inbox:
            self._wake.clear()
            self.waiting = True  # the broker's watchdog checks on waiting handles only
            try:
                await self._wake.wait()
            finally:
                self.waiting = False
        items, self._inbox = self._inbox, []
        return items

    def _error(self, failure: ErrorMsg | ApiError) -> ApiError:
        if isinstance(failure, ErrorMsg):  # the request failed upstream: nothing to abort
            self.failed = True
            return ApiError(failure.status, failure.message, None, failure.code)
        return failure

    def _observe(self, delta: Delta) -> None:
        if not self.observed:
            return
        now = time.perf_counter()
        if self.ttft is None and delta.output_ids:
            self.ttft = now - self.arrived
            self.broker.metrics.observe_first_token(self.ttft)
        if delta.usage is not None:
            u = delta.usage
            reason = delta.finish_reason.type if delta.finish_reason is not None else "stop"
            tokens = (u.prompt_tokens, u.completion_tokens, u.cached_tokens)
            self.broker.metrics.observe_finish(now - self.arrived, self.ttft, *tokens, reason)


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) of several handles as they come; raises the first ApiError."""
    if len(handles) == 1:
        async for delta in handles[0].deltas():
            yield handles[0].sub.index, delta
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(h: RequestHandle) -> None:
        try:
            async for delta in h.deltas():
                queue.put_nowait((h.sub.index, delta))
            queue.put_nowait((h.sub.index, None))
        except Exception as exc:  # handed to the consumer below
            queue.put_nowait((h.sub.index, exc))

    tasks = [asyncio.ensure_future(pump(h)) for h in handles]
    try:
        remaining = len(handles)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for h in handles:
            h.close()
