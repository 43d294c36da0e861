"""The asyncio twin of `shared.bus.Bus`, over `redis.asyncio.Redis` (used by the router).

Same methods, same semantics, awaited; the decoding and dead-lettering logic is shared
with the synchronous bus, so only the I/O differs.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

from shared.keys import DEFAULT_PREFIX, MSG_FIELD, is_router_out_stream
from shared.messages import Message
from shared.redis_clients import connect_async
from shared.stream_entries import (
    BadEntry,
    BusConfig,
    DeadLetter,
    Entry,
    as_text,
    dead_letter_fields,
    is_nogroup,
    parse_dead_letter,
    sort_claimed,
    split_entries,
    to_bytes,
)


class AsyncBus(BusConfig):
    """Asynchronous bus; see `shared.bus.Bus` for the meaning of every method."""

    @classmethod
    def from_url(cls, url: str, prefix: str = DEFAULT_PREFIX, **kwargs: int) -> AsyncBus:
        return cls(connect_async(url), prefix, **kwargs)

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def ensure_group(self, stream: str, group: str, start_id: str = "0") -> bool:
        try:
            await self.redis.xgroup_create(stream, group, id=start_id, mkstream=True)
            return True
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            return False

    async def publish(self, stream: str, msg: Message | bytes, maxlen: int | None = None) -> str:
        if is_router_out_stream(self.prefix, stream):  # its TTL renewed too
            return (await self.publish_many([(stream, msg)], maxlen))[0]
        limit = self.maxlen if maxlen is None else maxlen
        entry_id = await self.redis.xadd(stream, {MSG_FIELD: to_bytes(msg)}, maxlen=limit or None)
        return as_text(entry_id)

    async def publish_many(
        self, items: Iterable[tuple[str, Message | bytes]], maxlen: int | None = None
    ) -> list[str]:
        pipe = self.redis.pipeline(transaction=False)
        count = self.queue_publish(pipe, items, maxlen)
        return [as_text(eid) for eid in (await pipe.execute())[:count]]

    async def read_group(
        self,
        stream: str,
        group: str,
        consumer: str,
        count: int = 64,
        block_ms: int | None = None,
        start: str = ">",
    ) -> list[Entry]:
        streams = {stream: start}
        try:
            reply = await self.redis.xreadgroup(
                group, consumer, streams, count=count, block=block_ms
            )
        except redis.ResponseError as exc:
            if not is_nogroup(exc):
                raise
            await self.ensure_group(stream, group)
            reply = await self.redis.xreadgroup(
                group, consumer, streams, count=count, block=block_ms
            )
        if not reply:
            return []
        good, bad, gone = split_entries(reply[0][1])
        await self._drop(stream, group, consumer, bad, gone)
        return good

    async def ack(self, stream: str, group: str, *entry_ids: str) -> int:
        return await self.redis.xack(stream, group, *entry_ids) if entry_ids else 0

    async def autoclaim(
        self, stream: str, group: str, consumer: str, min_idle_ms: int, count: int = 64
    ) -> list[Entry]:
        reply = await self.redis.xautoclaim(
            stream, group, consumer, min_idle_ms, "0-0", count=count, justid=True
        )
        ids = [as_text(eid) for eid in reply]
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        pipe.xclaim(stream, group, consumer, 0, ids)
        for eid in ids:
            pipe.xpending_range(stream, group, eid, eid, 1)
        claimed, *pending = await pipe.execute()
        deliveries = [p[0]["times_delivered"] if p else 0 for p in pending]
        good, bad, gone = sort_claimed(ids, claimed, deliveries, self.max_deliveries)
        await self._drop(stream, group, consumer, bad, gone)
        return good

    async def read_plain(
        self, stream: str, last_id: str = "0", count: int = 256, block_ms: int | None = None
    ) -> tuple[str, list[Entry]]:
        reply = await self.redis.xread({stream: last_id}, count=count, block=block_ms)
        if not reply:
            return last_id, []
        raw_entries = reply[0][1]
        good, bad, _ = split_entries(raw_entries)
        if bad:
            await self._drop(stream, "", "", bad, [])
        return as_text(raw_entries[-1][0]), good

    async def dead_letter(
        self, stream: str, entry_id: str, raw: bytes, reason: str, group: str = ""
    ) -> None:
        fields = dead_letter_fields(stream, BadEntry(entry_id, raw, reason), group)
        await self.redis.xadd(self.dlq, fields, maxlen=self.dlq_maxlen or None)

    async def read_dlq(self, count: int = 100) -> list[DeadLetter]:
        entries = await self.redis.xrange(self.dlq, count=count)
        return [parse_dead_letter(eid, f) for eid, f in entries]

    async def _drop(
        self, stream: str, group: str, consumer: str, bad: list[BadEntry], gone: list[str]
    ) -> None:
        if not bad and not gone:
            return
        pipe = self.redis.pipeline(transaction=False)
        for entry in bad:
            fields = dead_letter_fields(stream, entry, group, consumer)
            pipe.xadd(self.dlq, fields, maxlen=self.dlq_maxlen or None)
        to_ack = [b.entry_id for b in bad] + gone
        if group and to_ack:
            pipe.xack(stream, group, *to_ack)
        await pipe.execute()
