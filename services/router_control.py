"""Questions a router fans out to every live worker and waits on: `POST /flush_cache`
(a `FlushCacheReqMsg`), `POST /start_profile` and `/stop_profile` (a `ProfileReqMsg`,
services/router_profile.py), the LoRA adapter loads and unloads (a `LoraReqMsg`,
services/router_lora.py) and `POST /update_weights_from_disk` (an `UpdateWeightsReqMsg`,
services/router_weights.py). The aborts of `POST /abort_request` are in
services/router_named.py.

`WorkerQuestions.ask()` sends one message to each live worker's stream and waits (at most
`timeout_s`) for their answers (`FlushCacheRespMsg`, `ProfileRespMsg`), which the broker's
reader hands to `deliver()`; a worker that does not answer in time has None. A worker
flushes only when idle, as in SGLang. `Answers` keeps such questions, sent to several
services at once, until each has answered or the time is up.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

import redis

from services.router_protocol import ApiError
from services.router_workers import WorkerTable
from shared.async_bus import AsyncBus
from shared.keys import worker_in_stream
from shared.messages import (
    FlushCacheReqMsg,
    FlushCacheRespMsg,
    Message,
)

FLUSH_TIMEOUT_S = 10.0

T = TypeVar("T")


@dataclass
class _Pending(Generic[T]):
    senders: set[str]
    replies: dict[str, T] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Answers(Generic[T]):
    """Questions sent to several services at once, each waiting for one answer per service."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending[T]] = {}

    async def ask(
        self,
        bus: AsyncBus,
        request_id: str,
        sends: dict[str, tuple[str, Message]],
        timeout_s: float,
    ) -> dict[str, T]:
        """Send `sends` (service id → stream, message); the answers that came within
        `timeout_s`, by service id. Redis errors propagate."""
        pending = self._pending[request_id] = _Pending[T](set(sends))
        try:
            await bus.publish_many(list(sends.values()))
            await asyncio.wait_for(pending.done.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            del self._pending[request_id]
        return pending.replies

    def deliver(self, request_id: str, sender: str, answer: T) -> None:
        pending = self._pending.get(request_id)
        if pending is None:  # too late, or not ours
            return
        pending.replies[sender] = answer
        if pending.senders <= pending.replies.keys():
            pending.done.set()


class Outcome:
    """The answers to a question fanned out to workers (a worker -> answer or None map; each
    answer has `success` and `message`), sorted for the caller's reply."""

    def __init__(self, replies: dict[str, Any]) -> None:
        self.answers = {w: r for w, r in sorted(replies.items()) if r is not None}
        self.silent = sorted(w for w, r in replies.items() if r is None)
        self.refused = {w: r.message for w, r in self.answers.items() if not r.success}
        self.done = [w for w, r in self.answers.items() if r.success]

    def detail(self) -> str:
        """Each refusal with its worker, and which workers did it anyway."""
        text = "; ".join(f"{w}: {m}" for w, m in self.refused.items())
        return text + (f" (done on {', '.join(self.done)})" if self.done else "")

    def no_answer(self, what: str, timeout_s: float) -> ApiError:
        msg = f"{what}: no answer from {', '.join(self.silent)} within {timeout_s:g} s"
        return ApiError(503, msg, None, "worker_unavailable")


async def ask_all_workers(
    broker: Any,
    question: Callable[[str], Message],
    timeout_s: float,
    failure: str,
    code: str,
    none_live_ok: bool = False,
) -> dict[str, Any]:
    """`question` to every live worker (the table refreshed first); their answers, by worker.
    A refusal is a 400 (`failure`, the reasons, `code`), a worker silent past `timeout_s` a
    503; no live worker a 503 `no_worker`, or, `none_live_ok` (a change recorded in Redis,
    which workers starting later read), no answers."""
    await broker.refresh_workers()
    try:
        replies = await broker.to_workers.ask(question, timeout_s)
    except ApiError as exc:
        if none_live_ok and exc.code == "no_worker":
            return {}
        raise
    outcome = Outcome(replies)
    if outcome.refused:
        raise ApiError(400, f"{failure} ({outcome.detail()})", None, code)
    if outcome.silent:
        raise outcome.no_answer(failure, timeout_s)
    return outcome.answers


class WorkerQuestions:
    def __init__(self, bus: AsyncBus, router_id: str, workers: WorkerTable) -> None:
        self.bus, self.router_id, self.workers = bus, router_id, workers
        self._answers = Answers[Message]()

    async def ask(
        self, question: Callable[[str], Message], timeout_s: float = FLUSH_TIMEOUT_S
    ) -> dict[str, Any]:
        """`question(request_id)` to each live worker; each one's answer (None: no answer in
        time), by worker id."""
        ids = sorted(self.workers.live)
        if not ids:
            raise ApiError(503, "no live worker", None, "no_worker")
        request_id = uuid.uuid4().hex
        msg = question(request_id)
        sends = {w: (worker_in_stream(self.bus.prefix, w), msg) for w in ids}
        try:
            replies = await self._answers.ask(self.bus, request_id, sends, timeout_s)
        except redis.RedisError as exc:
            raise ApiError(503, f"message bus unavailable: {exc}", None, "bus_unavailable") from exc
        return {w: replies.get(w) for w in ids}

    async def flush(self) -> dict[str, FlushCacheRespMsg | None]:
        return await self.ask(partial(FlushCacheReqMsg, router_id=self.router_id))

    def deliver(self, msg: Message) -> None:
        """A worker's answer (FlushCacheRespMsg, ProfileRespMsg, LoraRespMsg,
        UpdateWeightsRespMsg)."""
        self._answers.deliver(msg.request_id, msg.worker_id, msg)  # type: ignore[attr-defined]
