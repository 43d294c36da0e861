"""The loop of a stateless service that reads a consumer group: the tokenizers, detokenizers.

    read (own new entries, plus entries of dead consumers taken over) → handle → publish
    what the handler returns in one pipeline → ack

Acks come after publishing, so an entry whose consumer dies midway is taken over by a
live one (`Bus.autoclaim` after `claim_idle_ms`) and handled again: output is at least
once, and its consumers ignore repeats. An entry whose handling raises is left pending;
it is retried by autoclaim and dead-lettered by the bus once it has been delivered too
often. The service is visible through a `ServiceStatusMsg` heartbeat, and SIGTERM or
SIGINT stops it after the batch in hand.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import redis

from shared.bus import Bus, Entry
from shared.heartbeat import Heartbeat
from shared.keys import heartbeat_key
from shared.messages import Message, ServiceStatusMsg
from shared.settings import CommonSettings

logger = logging.getLogger(__name__)

Handler = Callable[[Sequence[Entry]], list[tuple[str, Message]]]
"""Handles a batch of entries; returns (stream, message) pairs to publish before acking."""


@dataclass(frozen=True)
class GroupSpec:
    kind: str  # heartbeat kind: "tokenizer", "detokenizer"
    stream: str
    group: str
    consumer: str
    batch_size: int
    block_ms: int


def stop_on_signals(stop: threading.Event) -> None:
    """Make SIGTERM and SIGINT set `stop` (a clean shutdown) in this process."""

    def handler(signum: int, frame: object) -> None:
        logger.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def exit_process(code: int = 0) -> NoReturn:
    """Exit at once after a clean shutdown, skipping the interpreter's teardown.

    With torch and transformers loaded, the final garbage collection of their modules
    takes seconds of CPU (minutes under load), which only delays a stop that has already
    released everything: heartbeat deleted, messages sent, logs flushed below.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class GroupConsumer:
    def __init__(self, bus: Bus, spec: GroupSpec, common: CommonSettings, handle: Handler) -> None:
        self.bus = bus
        self.spec = spec
        self.handle = handle
        self.claim_idle_ms = common.claim_idle_ms
        # Look for abandoned entries a few times per idle timeout.
        self.claim_every_s = min(5.0, max(0.2, common.claim_idle_ms / 4000))
        self.num_handled = 0
        self.started_at = time.time()
        self.stop = threading.Event()
        key = heartbeat_key(bus.prefix, spec.kind, spec.consumer)
        self.heartbeat = Heartbeat(bus.redis, key, common.heartbeat_ttl_s, self.status)

    def status(self) -> ServiceStatusMsg:
        return ServiceStatusMsg(
            kind=self.spec.kind,
            service_id=self.spec.consumer,
            host=os.uname().nodename,
            pid=os.getpid(),
            started_at=self.started_at,
            updated_at=time.time(),
            num_handled=self.num_handled,
        )

    def run(self) -> None:
        """Serve until `stop` is set (by a signal, see `stop_on_signals`)."""
        spec = self.spec
        self.bus.ensure_group(spec.stream, spec.group)
        pending = self.bus.read_group(spec.stream, spec.group, spec.consumer, start="0")
        self.heartbeat.start()
        logger.info("%s %s reading %s", spec.kind, spec.consumer, spec.stream)
        next_claim = 0.0
        try:
            while not self.stop.is_set():
                entries, pending = pending, []
                try:
                    if time.monotonic() >= next_claim:
                        next_claim = time.monotonic() + self.claim_every_s
                        entries += self._claim()
                    if not entries:
                        entries = self.bus.read_group(
                            spec.stream, spec.group, spec.consumer, spec.batch_size, spec.block_ms
                        )
                    if entries:
                        self._handle(entries)
                except redis.RedisError as exc:
                    logger.warning("redis: %s; retrying in 1 s", exc)
                    self.stop.wait(1.0)
        finally:
            self.heartbeat.stop()

    def _claim(self) -> list[Entry]:
        spec = self.spec
        entries = self.bus.autoclaim(
            spec.stream, spec.group, spec.consumer, self.claim_idle_ms, spec.batch_size
        )
        if entries:
            logger.info("took over %d entries of a dead consumer", len(entries))
        return entries

    def _handle(self, entries: list[Entry]) -> None:
        try:
            out = self.handle(entries)
        except Exception:  # left pending: retried by autoclaim, dead-lettered if it persists
            logger.exception("handling %d entries failed", len(entries))
            return
        if out:
            self.bus.publish_many(out)
        self.bus.ack(self.spec.stream, self.spec.group, *(eid for eid, _ in entries))
        self.num_handled += len(entries)


def dead_letter_unexpected(bus: Bus, spec: GroupSpec, entry: Entry, expected: str) -> None:
    """Dead-letter an entry that decoded to the wrong message type for this stream."""
    entry_id, msg = entry
    reason = f"unexpected {type(msg).__name__} on {spec.stream} (expected {expected})"
    bus.dead_letter(spec.stream, entry_id, msg.to_msg(), reason, spec.group)
