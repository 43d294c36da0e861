"""The worker's Redis I/O threads, so no Redis round trip sits in the scheduler loop.

`Receiver` blocks on the worker's stream `{p}:worker:{w}:in` (group `worker`, consumer
= the worker id) and puts the requests and aborts of each read, as one list, on a local
queue, which the scheduler loop drains between steps. It acks what it has queued at
once: a worker's requests live in its memory only, and routers fail over the requests of
a worker that died (a worker restarted under the same id is a new worker to them), so
replaying old entries after a restart would only duplicate work. Entries of the wrong
type are dead-lettered.

`Sender` takes (stream, message) pairs from the scheduler loop and publishes everything
queued in one pipeline per round trip; encoding happens on its thread too, and so does
building a message given as a zero-argument callable. If Redis is
unreachable it keeps the messages and retries, so nothing is dropped by a blip.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from shared.bus import Bus
from shared.keys import WORKER_GROUP
from shared.messages import AbortReqMsg, GenerateReqMsg, Message

logger = logging.getLogger(__name__)

WAKE = None  # put on the inbox to wake a loop blocked on it (shutdown)
_RETRY_S = 0.5


class Receiver(threading.Thread):
    def __init__(
        self, bus: Bus, stream: str, consumer: str, batch_size: int, block_ms: int
    ) -> None:
        super().__init__(name="worker-receiver", daemon=True)
        self.bus = bus
        self.stream = stream
        self.consumer = consumer
        self.batch_size = batch_size
        self.block_ms = block_ms
        self.inbox: queue.Queue[list[GenerateReqMsg | AbortReqMsg] | None] = queue.Queue()
        self.stopping = threading.Event()

    def prepare(self) -> None:
        """Create the group; drop (ack) entries a previous run of this worker had taken."""
        self.bus.ensure_group(self.stream, WORKER_GROUP)
        stale = self.bus.read_group(self.stream, WORKER_GROUP, self.consumer, 10_000, start="0")
        if stale:
            logger.info("dropping %d entries taken by a previous run", len(stale))
            self.bus.ack(self.stream, WORKER_GROUP, *(eid for eid, _ in stale))

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._receive()
            except redis.RedisError as exc:
                logger.warning("receiving: %s; retrying", exc)
                self.stopping.wait(_RETRY_S)

    def _receive(self) -> None:
        entries = self.bus.read_group(
            self.stream, WORKER_GROUP, self.consumer, self.batch_size, self.block_ms
        )
        batch = []
        for entry_id, msg in entries:
            if isinstance(msg, (GenerateReqMsg, AbortReqMsg)):
                batch.append(msg)
            else:
                reason = f"unexpected {type(msg).__name__} on {self.stream}"
                self.bus.dead_letter(self.stream, entry_id, msg.to_msg(), reason, WORKER_GROUP)
        if batch:
            self.inbox.put(batch)  # one item per read: the loop sees a read whole
        if entries:
            self.bus.ack(self.stream, WORKER_GROUP, *(eid for eid, _ in entries))

    def stop(self) -> None:
        self.stopping.set()
        self.inbox.put(WAKE)
        self.join(timeout=self.block_ms / 1000 + 5)


class Sender(threading.Thread):
    def __init__(self, bus: Bus) -> None:
        super().__init__(name="worker-sender", daemon=True)
        self.bus = bus
        self.outbox: queue.Queue[tuple[str, Message | Callable[[], Message]] | None]
        self.outbox = queue.Queue()
        self.num_sent = 0

    def send(self, stream: str, msg: Message | Callable[[], Message]) -> None:
        self.outbox.put((stream, msg))

    def run(self) -> None:
        batch: list[tuple[str, Any]] = []
        done = False
        while True:
            if not done:
                done = self._take(batch, block=not batch)
            if not batch:
                if done:
                    return
                continue
            try:
                batch = [(s, m() if callable(m) else m) for s, m in batch]  # built once
                self.bus.publish_many(batch)
                self.num_sent += len(batch)
                batch = []
            except redis.RedisError as exc:
                if done:
                    logger.error("stopping with %d messages unsent: %s", len(batch), exc)
                    return
                logger.warning("sending %d messages: %s; retrying", len(batch), exc)
                time.sleep(_RETRY_S)

    def _take(self, batch: list[tuple[str, Any]], block: bool) -> bool:
        """Move queued messages into `batch`; True once the stop marker was seen."""
        try:
            item = self.outbox.get(block=block)
            while True:
                if item is None:
                    return True
                batch.append(item)
                item = self.outbox.get_nowait()
        except queue.Empty:
            return False

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (within `timeout_s`), then stop."""
        self.outbox.put(None)
        self.join(timeout=timeout_s)
