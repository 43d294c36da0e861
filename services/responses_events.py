"""A background response's events in Redis (services/responses_background.py): each SSE
event's bytes are one entry of the stream `{p}:response-events:{id}`, appended in order by an
`EventWriter`; `event_head` reads an entry's type and sequence number back."""

from __future__ import annotations

import asyncio
import re
from typing import Any

EVENT_FIELD = b"e"  # the event stream's one field: the SSE event's bytes
_SEQ = re.compile(rb'"sequence_number":(\d+)')  # (the data's second key, before any nested)


def event_head(event: bytes) -> tuple[bytes, int]:
    """The type and sequence number of an SSE event `event: <type>\ndata: {"type": ...,
    "sequence_number": N, ...}` (the shaper's), without parsing the rest."""
    end = event.index(b"\n")
    match = _SEQ.search(event, end, end + 200)
    assert match is not None, event[:200]
    return event[7:end], int(match.group(1))


class EventWriter:
    """Appends a response's events to its Redis stream in order, pipelined: the events that
    came within `linger_s` of the first, or while one round trip was on its way, go together
    in the next (a round trip per event would cost the router more than shaping it)."""

    def __init__(self, redis: Any, key: str, ttl_ms: int, linger_s: float = 0.005) -> None:
        self.redis, self.key, self.ttl_ms, self.linger_s = redis, key, ttl_ms, linger_s
        self.pending: list[bytes] = []
        self.closed = False
        self.added = self.written = 0
        self._flushes: list[tuple[int, asyncio.Future]] = []  # (events written, then done)
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop())

    def add(self, event: bytes) -> None:
        self.pending.append(event)
        self.added += 1
        self._wake.set()

    async def flush(self) -> None:
        """Once every event added so far is in Redis (raises what writing them raised)."""
        done = asyncio.get_running_loop().create_future()
        self._flushes.append((self.added, done))
        self._wake.set()
        await asyncio.wait({done, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            self._task.result()

    async def close(self) -> None:
        """Once every event added is in Redis (raises what writing them raised)."""
        self.closed = True
        self._wake.set()
        await self._task

    async def _loop(self) -> None:
        first = True
        while not (self.closed and not self.pending):
            await self._wake.wait()
            if not self.closed:
                await asyncio.sleep(self.linger_s)
            self._wake.clear()
            batch, self.pending = self.pending, []
            if batch:
                pipe = self.redis.pipeline(transaction=False)
                for event in batch:
                    pipe.xadd(self.key, {EVENT_FIELD: event})
                if first:
                    pipe.pexpire(self.key, self.ttl_ms)
                    first = False
                await pipe.execute()
                self.written += len(batch)
            for flush in [f for f in self._flushes if f[0] <= self.written]:
                self._flushes.remove(flush)
                if not flush[1].done():
                    flush[1].set_result(None)
