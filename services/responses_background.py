"""Background responses of the Responses API (`background: true`), as OpenAI and vLLM serve
them, shared by every router through Redis.

* `POST /v1/responses` with `background` true (it needs `store`, and the router's store on)
  sends the request to the workers, stores the response `queued` and answers it at once. The
  router that took it generates it in a task of its own, which outlives the client's
  connection: the stored record goes `in_progress` with the first output (once the events
  before it are in Redis), then `completed`, `incomplete`, `failed` or `cancelled`, so
  `GET /v1/responses/{id}` on any router polls it.
* Every event of its stream (`services/responses_stream.py`) is appended to the Redis stream
  `{p}:response-events:{id}`, which expires with the record. `stream: true` on the POST
  follows it from the start; `GET /v1/responses/{id}?stream=true&starting_after=N`, on any
  router, resumes it after the event with sequence number N (a lost connection loses nothing).
* `POST /v1/responses/{id}/cancel` sets `{p}:response-cancel:{id}`; the router generating the
  response looks at the marks of all its background responses at once (one MGET every `poll_s`)
  and aborts a marked one's request at the worker, so the response ends `cancelled` with what
  was generated. The cancel answers the stored response once it has ended (waiting at most
  `cancel_wait_s`). A response that is not a background one is a 400 (vLLM's "Cannot cancel a
  synchronous response."), as is one that has ended; deleting one still running is a 400 too
  (cancel it first).

A router that stops marks the background responses it was generating `failed`. One that dies
cannot: the record names the router generating it (`owner`), and a router that loads a
running record (to answer it, stream it, cancel or delete it) whose owner's heartbeat is gone,
or that names itself but is not generating it (an earlier run), stores it `failed`, with the
output its events add up to (the open item `incomplete`), and ends its events with
`response.failed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from services.responses_events import EVENT_FIELD, EventWriter, event_head
from services.responses_items import output_from_events, sse_event
from services.responses_store import ResponseStore, duplicate_id, not_found
from services.responses_stream import ResponseShaper
from services.router_fields import ApiError
from shared.heartbeat import is_live_async
from shared.keys import ROUTER_KIND, response_cancel_key, response_events_key

logger = logging.getLogger(__name__)

RUNNING = ("queued", "in_progress")
_ENDS = {b"response.completed", b"response.incomplete", b"response.failed",
         b"response.cancelled"}  # fmt: skip
class BackgroundResponses:
    def __init__(
        self,
        store: ResponseStore,
        router_id: str,
        poll_s: float = 0.2,
        cancel_wait_s: float = 10.0,
    ) -> None:
        self.store, self.redis, self.prefix = store, store.redis, store.prefix
        self.router_id, self.poll_s, self.cancel_wait_s = router_id, poll_s, cancel_wait_s
        self._starting: set[str] = set()  # stored queued, their tasks not made yet
        self._tasks: dict[str, asyncio.Task] = {}  # the responses this router generates
        self._cancels: dict[str, Callable[[str], None]] = {}  # their aborts, until they end
        self._watcher: asyncio.Task | None = None

    def not_stored(self, store: bool | None) -> ApiError:
        """The 400 of a background request whose response would not be stored."""
        why = "store is false" if self.store.enabled else "this server stores no responses"
        return ApiError(400, f"background needs a stored response ({why})", "background",
                        "invalid_value")  # fmt: skip

    async def start(self, shaper: ResponseShaper, cancel: Callable[[str], None]) -> dict:
        """Store `shaper`'s response queued and generate it in a task; the queued response.
        `cancel(why)` aborts its request at the worker."""
        assert shaper.save is not None, "a background response is stored"
        queued = shaper.envelope("queued", [])
        self._starting.add(shaper.id)
        try:
            if not await shaper.save(queued, owner=self.router_id):  # (a client's rid, raced)
                cancel("its response id is taken")
                raise duplicate_id(shaper.id)
        finally:
            self._starting.discard(shaper.id)
        shaper.save = partial(shaper.save, owner=self.router_id, new=False)  # (its own now)
        task = asyncio.create_task(self._run(shaper))
        self._tasks[shaper.id], self._cancels[shaper.id] = task, cancel
        task.add_done_callback(lambda _: self._ended(shaper.id))
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())
        return queued

    def _ended(self, response_id: str) -> None:
        self._tasks.pop(response_id, None)
        self._cancels.pop(response_id, None)

    async def stop(self) -> None:
        """Stop generating (the responses are stored `failed`)."""
        tasks = list(self._tasks.values()) + ([self._watcher] if self._watcher else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, shaper: ResponseShaper) -> None:
        assert shaper.save is not None
        key = response_events_key(self.prefix, shaper.id)
        writer = EventWriter(self.redis, key, self.store.ttl_ms)
        try:
            async for event in shaper.events():
                writer.add(event)
                if event.startswith(b"event: response.in_progress\n"):
                    await writer.flush()  # (one that reads it in_progress finds its events)
                    await shaper.save(shaper.envelope("in_progress", []))
            await writer.close()
        except asyncio.CancelledError:
            await self._failed(shaper, writer, "the router stopped before the response was "
                                               "complete")  # fmt: skip
            raise
        except ApiError as exc:  # e.g. a prompt too long: the response fails
            await self._failed(shaper, writer, exc.message, exc.code or "server_error")
        except Exception as exc:  # noqa: BLE001 - the same, with what went wrong
            await self._failed(shaper, writer, f"{type(exc).__name__}: {exc}")
        finally:
            with contextlib.suppress(Exception):  # (the events expire with the record)
                await self.redis.pexpire(key, self.store.ttl_ms)

    async def _failed(
        self, shaper: ResponseShaper, writer: EventWriter, message: str,
        code: str = "server_error",
    ) -> None:  # fmt: skip
        """Store the response failed, and end its events with `response.failed`."""
        failed = shaper.envelope("failed", shaper.output_so_far())
        failed["error"] = {"code": code, "message": message}
        with contextlib.suppress(Exception):  # (Redis may be gone: shutting down)
            await shaper.save(failed)  # type: ignore[misc]
            if not writer.closed:
                writer.add(shaper.event("response.failed", response=failed))
                await writer.close()
        logger.warning("background response %s failed: %s", shaper.id, message)

    async def _watch(self) -> None:
        """While this router generates background responses: one look every `poll_s` at
        all their cancel marks; a marked one is aborted at its worker."""
        while self._cancels:
            ids = list(self._cancels)
            try:
                marks = await self.redis.mget([response_cancel_key(self.prefix, i) for i in ids])
            except Exception:  # noqa: BLE001 - Redis away for a moment: look again
                logger.exception("looking for cancelled background responses")
                marks = []
            for response_id, mark in zip(ids, marks, strict=False):
                if mark is not None and response_id in self._cancels:
                    self._cancels.pop(response_id)(f"response {response_id} cancelled")
            await asyncio.sleep(self.poll_s)

    # -- orphans ---------------------------------------------------------------------------------
    async def load(self, response_id: str) -> dict[str, Any] | None:
        """The stored record (or None); a running one whose router died is stored failed
        first (see module doc)."""
        record = await self.store.load(response_id)
        if record is None or record["response"]["status"] not in RUNNING:
            return record
        owner = record.get("owner")
        if owner is None or await self._alive(owner, response_id):
            return record
        return await self._orphaned(record, owner)

    async def found(self, response_id: str) -> dict[str, Any]:
        """`load`, or a 404."""
        if (record := await self.load(response_id)) is None:
            raise not_found(response_id)
        return record

    async def _alive(self, owner: str, response_id: str) -> bool:
        if owner == self.router_id:
            return response_id in self._tasks or response_id in self._starting
        return await is_live_async(self.redis, self.prefix, ROUTER_KIND, owner)

    async def _orphaned(self, record: dict[str, Any], owner: str) -> dict[str, Any]:
        response = record["response"]
        error = {"code": "server_error",
                 "message": f"router {owner}, which was generating the response, stopped"}
        key = response_events_key(self.prefix, response["id"])
        events = [fields[EVENT_FIELD] for _, fields in await self.redis.xrange(key)]
        output = output_from_events(events)  # (the record's is the in_progress one's: none)
        failed = {**response, "status": "failed", "error": error, "output": output}
        await self.store.save(failed, record["input"])
        seq = event_head(events[-1])[1] + 1 if events else 0
        writer = EventWriter(self.redis, key, self.store.ttl_ms)
        writer.add(sse_event("response.failed", seq, response=failed))
        await writer.close()
        logger.warning("background response %s failed: %s", response["id"], error["message"])
        return {**record, "response": failed}

    # -- endpoints ------------------------------------------------------------------------------
    async def cancel(self, response_id: str) -> dict[str, Any]:
        """`POST /v1/responses/{id}/cancel`: the response once it has ended."""
        response = (await self.found(response_id))["response"]
        if response["status"] not in RUNNING:
            if not response.get("background"):
                raise ApiError(400, "Cannot cancel a synchronous response.", "response_id",
                               "invalid_request")  # fmt: skip
            status = response["status"]
            raise ApiError(400, f"Cannot cancel a response that is already {status}.",
                           "response_id", "invalid_request")  # fmt: skip
        key = response_cancel_key(self.prefix, response_id)
        await self.redis.set(key, b"1", px=self.store.ttl_ms)
        deadline = time.monotonic() + self.cancel_wait_s
        while response["status"] in RUNNING and time.monotonic() < deadline:
            await asyncio.sleep(min(self.poll_s, 0.05))
            record = await self.load(response_id)
            if record is None:
                break
            response = record["response"]
        return response

    async def check_deletable(self, response_id: str) -> None:
        record = await self.load(response_id)
        if record is not None and record["response"]["status"] in RUNNING:
            raise ApiError(400, f"response {response_id!r} is still {record['response']['status']}"
                                "; cancel it first", "response_id", "invalid_request")  # fmt: skip

    async def stream(self, response_id: str, starting_after: int | None) -> AsyncIterator[bytes]:
        """`GET /v1/responses/{id}?stream=true`: its events after `starting_after`; a 404 or
        400 (not a background response) before any is sent."""
        response = (await self.found(response_id))["response"]
        if not response.get("background"):
            raise ApiError(400, "only a background response can be streamed again", "stream",
                           "invalid_request")  # fmt: skip
        return self.follow(response_id, -1 if starting_after is None else starting_after)

    async def follow(self, response_id: str, starting_after: int) -> AsyncIterator[bytes]:
        """The response's events with a sequence number above `starting_after`, as they come,
        until its last one (or, with none coming, until its record says it ended or is gone)."""
        key, last, ended = response_events_key(self.prefix, response_id), b"0-0", False
        while True:
            got = await self.redis.xread({key: last}, count=256, block=int(self.poll_s * 5000))
            entries = got[0][1] if got else []
            for entry_id, fields in entries:
                last, event = entry_id, fields[EVENT_FIELD]
                kind, seq = event_head(event)
                if seq > starting_after:
                    yield event
                if kind in _ENDS:
                    return
            if not entries:  # nothing new: has the response ended without its last event?
                if ended:  # (a second look: the record is stored just before that event)
                    return
                record = await self.load(response_id)
                ended = record is None or record["response"]["status"] not in RUNNING
