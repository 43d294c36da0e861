"""Stream entries: decoding them, and the dead letters of those that do not decode.

Pure functions shared by the synchronous and the asyncio bus; no I/O here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from shared.keys import (
    DEFAULT_DLQ_MAXLEN,
    DEFAULT_PREFIX,
    DEFAULT_STREAM_MAXLEN,
    MSG_FIELD,
    ROUTER_OUT_TTL_MS,
    dlq_stream,
    is_router_out_stream,
)
from shared.messages import Message, MessageError, decode_message

logger = logging.getLogger(__name__)

Entry = tuple[str, Message]
"""(stream entry id, decoded message)."""

DEFAULT_MAX_DELIVERIES = 5


@dataclass(frozen=True)
class DeadLetter:
    """An entry of `{p}:dlq`: what failed, where it came from and its raw bytes."""

    entry_id: str
    reason: str
    stream: str
    source_id: str
    raw: bytes
    group: str
    consumer: str
    at: float


@dataclass(frozen=True)
class BadEntry:
    entry_id: str
    raw: bytes
    reason: str


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def split_entries(raw_entries: Iterable[tuple]) -> tuple[list[Entry], list[BadEntry], list[str]]:
    """Decode raw (id, fields) pairs into good entries, bad entries, and ids of gone entries.

    A gone entry (fields None or empty) was deleted or trimmed while pending.
    """
    good: list[Entry] = []
    bad: list[BadEntry] = []
    gone: list[str] = []
    for entry_id, fields in raw_entries:
        if entry_id is None:
            continue
        eid = as_text(entry_id)
        if not fields:
            gone.append(eid)
            continue
        raw = fields.get(MSG_FIELD)
        if raw is None:
            bad.append(BadEntry(eid, b"", f"entry has no field {MSG_FIELD!r}"))
            continue
        try:
            good.append((eid, decode_message(raw)))
        except MessageError as exc:
            bad.append(BadEntry(eid, raw, exc.reason))
    return good, bad, gone


def dead_letter_fields(
    stream: str, bad: BadEntry, group: str = "", consumer: str = ""
) -> dict[bytes, bytes | str]:
    logger.warning("dead-lettering %s %s: %s", stream, bad.entry_id, bad.reason)
    return {
        b"reason": bad.reason,
        b"stream": stream,
        b"source_id": bad.entry_id,
        b"raw": bad.raw,
        b"group": group,
        b"consumer": consumer,
        b"at": repr(time.time()),
    }


def parse_dead_letter(entry_id: bytes, fields: dict[bytes, bytes]) -> DeadLetter:
    def get(name: str) -> str:
        return fields.get(name.encode(), b"").decode(errors="replace")

    return DeadLetter(
        entry_id=as_text(entry_id),
        reason=get("reason"),
        stream=get("stream"),
        source_id=get("source_id"),
        raw=fields.get(b"raw", b""),
        group=get("group"),
        consumer=get("consumer"),
        at=float(get("at") or 0.0),
    )


def to_bytes(msg: Message | bytes) -> bytes:
    return msg.to_msg() if isinstance(msg, Message) else bytes(msg)


def is_nogroup(exc: redis.ResponseError) -> bool:
    return str(exc).startswith("NOGROUP")


def sort_claimed(
    ids: Sequence[str], claimed: Iterable[tuple], deliveries: Sequence[int], max_deliveries: int
) -> tuple[list[Entry], list[BadEntry], list[str]]:
    """Sort what XCLAIM returned for `ids` (with their delivery counts) like split_entries.

    Entries missing from the reply were deleted or trimmed (Redis 6.2 answers nil for them,
    7.0 omits them); over-delivered entries become bad entries (poison messages).
    """
    by_id = {as_text(eid): fields for eid, fields in claimed if eid is not None}
    raw_entries, poison = [], []
    for eid, count in zip(ids, deliveries, strict=True):
        fields = by_id.get(eid)
        if fields and count > max_deliveries:
            raw = fields.get(MSG_FIELD, b"")
            poison.append(BadEntry(eid, raw, f"delivered {count} times; consumers keep dying"))
        else:
            raw_entries.append((eid, fields))
    good, bad, gone = split_entries(raw_entries)
    return good, bad + poison, gone


class BusConfig:
    """What both buses hold: a Redis client that returns bytes, the key prefix and limits."""

    def __init__(
        self,
        client: Any,
        prefix: str = DEFAULT_PREFIX,
        *,
        maxlen: int = DEFAULT_STREAM_MAXLEN,
        dlq_maxlen: int = DEFAULT_DLQ_MAXLEN,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
    ) -> None:
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError(
                f"{type(self).__name__} needs a Redis client with decode_responses=False"
            )
        self.redis = client
        self.prefix = prefix
        self.maxlen = maxlen
        self.dlq_maxlen = dlq_maxlen
        self.max_deliveries = max_deliveries

    @property
    def dlq(self) -> str:
        return dlq_stream(self.prefix)

    def queue_publish(
        self, pipe: Any, items: Iterable[tuple[str, Message | bytes]], maxlen: int | None
    ) -> int:
        """Queue an XADD per (stream, message) on `pipe`, then renew the TTL of each router
        stream among them (shared.keys), so rows that outlive their router expire with its
        stream. Returns the number of XADDs (their ids are the first results)."""
        limit = (self.maxlen if maxlen is None else maxlen) or None
        routers: set[str] = set()
        count = 0
        for stream, msg in items:
            pipe.xadd(stream, {MSG_FIELD: to_bytes(msg)}, maxlen=limit)
            if is_router_out_stream(self.prefix, stream):
                routers.add(stream)
            count += 1
        for stream in routers:
            pipe.pexpire(stream, ROUTER_OUT_TTL_MS)
        return count
