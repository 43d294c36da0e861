"""The Redis stream bus: publish messages, read them through consumer groups, recover.

A thin layer over redis-py. Each stream entry has one field, `m`, holding a msgpack
message (see shared.messages). Readers never see undecodable entries: those are copied to
the dead-letter stream `{p}:dlq` with the reason, acknowledged (for groups) and skipped.

Delivery is at least once. A consumer acks an entry after it has acted on it; if it dies
first, the entry stays pending and `autoclaim` lets a live consumer of the same group take
it after `min_idle_ms`. An entry delivered more than `max_deliveries` times (it kills every
consumer that takes it) goes to the dead-letter stream instead of a next victim.

`Bus` wraps a synchronous `redis.Redis`; `shared.async_bus.AsyncBus` has the same methods
for `redis.asyncio.Redis` (the router). Both need clients with `decode_responses=False`.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

from shared.keys import DEFAULT_PREFIX, MSG_FIELD, is_router_out_stream
from shared.messages import Message
from shared.redis_clients import connect
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

__all__ = ["Bus", "DeadLetter", "Entry"]


class Bus(BusConfig):
    """Synchronous bus. `maxlen` trims every stream published to (`MAXLEN ~`)."""

    @classmethod
    def from_url(cls, url: str, prefix: str = DEFAULT_PREFIX, **kwargs: int) -> Bus:
        return cls(connect(url), prefix, **kwargs)

    def ensure_group(self, stream: str, group: str, start_id: str = "0") -> bool:
        """Create `group` on `stream` (and the stream); False if it already existed.

        `start_id` "0" hands a new group every entry already in the stream, so nothing
        published before the first consumer started is lost.
        """
        try:
            self.redis.xgroup_create(stream, group, id=start_id, mkstream=True)
            return True
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            return False

    def publish(self, stream: str, msg: Message | bytes, maxlen: int | None = None) -> str:
        """Append one message; returns its entry id. `maxlen` 0 disables trimming."""
        if is_router_out_stream(self.prefix, stream):  # its TTL renewed too
            return self.publish_many([(stream, msg)], maxlen)[0]
        limit = self.maxlen if maxlen is None else maxlen
        entry_id = self.redis.xadd(stream, {MSG_FIELD: to_bytes(msg)}, maxlen=limit or None)
        return as_text(entry_id)

    def publish_many(
        self, items: Iterable[tuple[str, Message | bytes]], maxlen: int | None = None
    ) -> list[str]:
        """Append (stream, message) pairs in one round trip (a non-transactional pipeline)."""
        pipe = self.redis.pipeline(transaction=False)
        count = self.queue_publish(pipe, items, maxlen)
        return [as_text(eid) for eid in pipe.execute()[:count]]

    def read_group(
        self,
        stream: str,
        group: str,
        consumer: str,
        count: int = 64,
        block_ms: int | None = None,
        start: str = ">",
    ) -> list[Entry]:
        """Read up to `count` entries for `consumer`; `block_ms` None returns at once.

        `start` ">" reads new entries; "0" re-reads this consumer's own pending ones (after
        a restart under the same name). A group lost with the data (Redis restarted without
        persistence) is recreated.
        """
        streams = {stream: start}
        try:
            reply = self.redis.xreadgroup(group, consumer, streams, count=count, block=block_ms)
        except redis.ResponseError as exc:
            if not is_nogroup(exc):
                raise
            self.ensure_group(stream, group)
            reply = self.redis.xreadgroup(group, consumer, streams, count=count, block=block_ms)
        if not reply:
            return []
        good, bad, gone = split_entries(reply[0][1])
        self._drop(stream, group, consumer, bad, gone)
        return good

    def ack(self, stream: str, group: str, *entry_ids: str) -> int:
        return self.redis.xack(stream, group, *entry_ids) if entry_ids else 0

    def autoclaim(
        self, stream: str, group: str, consumer: str, min_idle_ms: int, count: int = 64
    ) -> list[Entry]:
        """Take over up to `count` entries pending for longer than `min_idle_ms` in `group`.

        Returns them decoded, now pending for `consumer`, which must ack them as if it had
        read them. Entries that were trimmed meanwhile are acked and dropped.
        """
        # JUSTID: the reply keeps the ids of entries trimmed while pending, which Redis 6.2
        # replaces by nil when it returns fields. One call scans enough of the pending list
        # for a periodic caller; the rest are taken next time.
        ids = [
            as_text(eid)
            for eid in self.redis.xautoclaim(
                stream, group, consumer, min_idle_ms, "0-0", count=count, justid=True
            )
        ]
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        pipe.xclaim(stream, group, consumer, 0, ids)  # counts a delivery, returns fields
        for eid in ids:
            pipe.xpending_range(stream, group, eid, eid, 1)
        claimed, *pending = pipe.execute()
        deliveries = [p[0]["times_delivered"] if p else 0 for p in pending]
        good, bad, gone = sort_claimed(ids, claimed, deliveries, self.max_deliveries)
        self._drop(stream, group, consumer, bad, gone)
        return good

    def read_plain(
        self, stream: str, last_id: str = "0", count: int = 256, block_ms: int | None = None
    ) -> tuple[str, list[Entry]]:
        """XREAD after `last_id`; returns (the id to pass next time, decoded entries).

        The returned id also moves past entries that failed to decode (dead-lettered).
        """
        reply = self.redis.xread({stream: last_id}, count=count, block=block_ms)
        if not reply:
            return last_id, []
        raw_entries = reply[0][1]
        good, bad, _ = split_entries(raw_entries)
        if bad:
            self._drop(stream, "", "", bad, [])
        return as_text(raw_entries[-1][0]), good

    def dead_letter(
        self, stream: str, entry_id: str, raw: bytes, reason: str, group: str = ""
    ) -> None:
        """Copy an entry a service could not handle to the dead-letter stream."""
        fields = dead_letter_fields(stream, BadEntry(entry_id, raw, reason), group)
        self.redis.xadd(self.dlq, fields, maxlen=self.dlq_maxlen or None)

    def read_dlq(self, count: int = 100) -> list[DeadLetter]:
        """The oldest `count` dead letters."""
        return [parse_dead_letter(eid, f) for eid, f in self.redis.xrange(self.dlq, count=count)]

    def _drop(
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
        pipe.execute()
