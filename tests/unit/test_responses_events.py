"""EventWriter (services/responses_events.py) against a fake Redis whose round trips take a
while: events land in order, pipelined; `flush` returns once every event added before it is
written, and raises what writing raised."""

from __future__ import annotations

import asyncio

import pytest

from services.responses_events import EVENT_FIELD, EventWriter, event_head
from services.responses_items import sse_event


class FakeRedis:
    def __init__(self, fail: bool = False) -> None:
        self.entries: list[bytes] = []
        self.round_trips = 0
        self.fail = fail

    def pipeline(self, transaction: bool = False) -> FakeRedis.Pipe:
        return FakeRedis.Pipe(self)

    class Pipe:
        def __init__(self, redis: FakeRedis) -> None:
            self.redis, self.ops = redis, []

        def xadd(self, key: str, fields: dict) -> None:
            self.ops.append(fields[EVENT_FIELD])

        def pexpire(self, key: str, ttl_ms: int) -> None:
            pass

        async def execute(self) -> None:
            await asyncio.sleep(0.02)
            if self.redis.fail:
                raise ConnectionError("redis went away")
            self.redis.round_trips += 1
            self.redis.entries.extend(self.ops)


def events(n: int, start: int = 0) -> list[bytes]:
    return [sse_event("response.output_text.delta", start + i, delta="x") for i in range(n)]


def test_flush_waits_for_what_was_added_before_it() -> None:
    async def run() -> tuple[list[bytes], int, list[bytes]]:
        redis = FakeRedis()
        writer = EventWriter(redis, "k", 1000)
        for event in events(3):
            writer.add(event)
        await writer.flush()
        after_flush = list(redis.entries)
        for event in events(4, start=3):
            writer.add(event)
        await writer.close()
        return after_flush, redis.round_trips, redis.entries

    after_flush, round_trips, entries = asyncio.run(run())
    assert [event_head(e) for e in after_flush] == [(b"response.output_text.delta", i)
                                                    for i in range(3)]  # fmt: skip
    assert [event_head(e)[1] for e in entries] == list(range(7))
    assert round_trips == 2  # (pipelined: one round trip per burst)


def test_flush_raises_what_writing_raised() -> None:
    async def run() -> None:
        writer = EventWriter(FakeRedis(fail=True), "k", 1000)
        writer.add(events(1)[0])
        await writer.flush()

    with pytest.raises(ConnectionError, match="went away"):
        asyncio.run(run())
