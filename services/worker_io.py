"""A worker's Redis I/O process: `python -m services.worker_io IN_FD OUT_FD`, started by
the worker (`services.worker_link.IoLink`), never by hand.

    receiver thread:  {p}:worker:{w}:in ──▶ ["in", ...] records ──▶ the scheduler process
    main thread:      records from the scheduler ──▶ step messages, errors ──▶ sender
    sender thread:    pipelined XADDs to {p}:detok and the routers' streams
    heartbeat thread: the worker's load (`WorkerLoadMsg`) under {p}:hb:worker:{w}

`Receiver` blocks on the worker's stream (group `worker`, consumer = the worker id) and
forwards the requests, aborts and cache flushes of each read as one record (and, between
reads, aborts of the requests of routers that are gone: services/worker_routers.py). It
acks what it forwarded at once: a worker's requests live in its memory only, and routers fail over
the requests of a worker that died (a worker restarted under the same id is a new worker
to them), so replaying old entries after a restart would only duplicate work. Entries of
the wrong type are dead-lettered.

The main thread keeps each running request's `ReqInfo` (from its "start" record) and turns
every "step" record into a `StepOutputMsg` (`step_message`; the windows of its plain rows
are its own, `Windows`), dropping a request's info with its final row (or a "forget"
record). `Sender` publishes everything queued in one pipeline per round trip; if Redis is
unreachable it keeps the messages and retries, so nothing is dropped by a blip.

The scheduler process closing its end (a clean stop, or its death) stops this process:
it sends what is queued and deletes the heartbeat. SIGTERM does the same; SIGINT (a
terminal's Ctrl-C, which reaches the whole process group) is left to the worker.
"""

from __future__ import annotations

import logging
import queue
import signal
import sys
import threading
import time
from typing import Any

import redis

from services.group_consumer import exit_process
from services.worker_link import RecordReader, write_record
from services.worker_load import LoadFigures, LoadReporter, WorkerFacts
from services.worker_requests import ReqInfo, Windows, step_message
from services.worker_routers import RouterWatch
from shared.bus import Bus
from shared.heartbeat import Heartbeat
from shared.keys import WORKER_GROUP, WORKER_KIND, detok_stream, heartbeat_key, worker_in_stream
from shared.logging import setup_logging
from shared.messages import (
    AbortReqMsg,
    DistributedWeightsReqMsg,
    FlushCacheReqMsg,
    GenerateReqMsg,
    LoraReqMsg,
    MemoryReqMsg,
    PauseReqMsg,
    ProfileReqMsg,
    UpdateWeightsReqMsg,
    WeightsGroupReqMsg,
    WeightsReadReqMsg,
)

logger = logging.getLogger(__name__)

_RETRY_S = 0.5
_TO_SCHEDULER = (
    GenerateReqMsg, AbortReqMsg, FlushCacheReqMsg, ProfileReqMsg, LoraReqMsg, UpdateWeightsReqMsg,
    PauseReqMsg, MemoryReqMsg, DistributedWeightsReqMsg, WeightsGroupReqMsg, WeightsReadReqMsg,
)  # fmt: skip


class Receiver(threading.Thread):
    def __init__(
        self,
        bus: Bus,
        stream: str,
        consumer: str,
        batch_size: int,
        block_ms: int,
        out_fd: int,
        routers: RouterWatch,
    ) -> None:
        super().__init__(name="worker-receiver", daemon=True)
        self.routers = routers
        self.bus = bus
        self.stream = stream
        self.consumer = consumer
        self.batch_size = batch_size
        self.block_ms = block_ms
        self.out_fd = out_fd
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
                aborts = self.routers.aborts()
                if aborts:
                    write_record(self.out_fd, ["in", [m.to_msg() for m in aborts]])
            except redis.RedisError as exc:
                logger.warning("receiving: %s; retrying", exc)
                self.stopping.wait(_RETRY_S)
            except OSError:  # the scheduler process is gone: the main thread stops too
                return

    def _receive(self) -> None:
        entries = self.bus.read_group(
            self.stream, WORKER_GROUP, self.consumer, self.batch_size, self.block_ms
        )
        batch = []
        for entry_id, msg in entries:
            if isinstance(msg, _TO_SCHEDULER):
                batch.append(msg.to_msg())
            else:
                reason = f"unexpected {type(msg).__name__} on {self.stream}"
                self.bus.dead_letter(self.stream, entry_id, msg.to_msg(), reason, WORKER_GROUP)
        if batch:
            write_record(self.out_fd, ["in", batch])  # one record per read: seen whole
        if entries:
            self.bus.ack(self.stream, WORKER_GROUP, *(eid for eid, _ in entries))

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=self.block_ms / 1000 + 5)


class Sender(threading.Thread):
    def __init__(self, bus: Bus) -> None:
        super().__init__(name="worker-sender", daemon=True)
        self.bus = bus
        self.outbox: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self.num_sent = 0

    def send(self, stream: str, msg: Any) -> None:
        """Queue a `Message` or its encoded bytes for `stream`."""
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


class _Terminated(Exception):
    pass


class IoProcess:
    def __init__(self, hello: dict[str, Any], out_fd: int) -> None:
        self.worker_id = str(hello["worker_id"])
        self.bus = Bus.from_url(hello["redis_url"], hello["prefix"], maxlen=hello["stream_maxlen"])
        self.out_fd = out_fd
        self.infos: dict[str, ReqInfo] = {}
        self.windows = Windows()  # the plain rows' windows
        stream = worker_in_stream(self.bus.prefix, self.worker_id)
        routers = RouterWatch(self.bus, self.infos, hello["router_check_s"])
        self.receiver = Receiver(
            self.bus, stream, self.worker_id, hello["batch_size"], hello["block_ms"], out_fd,
            routers,
        )  # fmt: skip
        self.sender = Sender(self.bus)
        self.load = LoadReporter(WorkerFacts(*hello["facts"]))
        key = heartbeat_key(self.bus.prefix, WORKER_KIND, self.worker_id)
        self.heartbeat = Heartbeat(self.bus.redis, key, hello["heartbeat_ttl_s"], self.load.payload)
        self.detok_stream = detok_stream(self.bus.prefix)
        self._handlers = {
            "start": self._on_start,
            "forget": self._on_forget,
            "step": self._on_step,
            "msg": self._on_msg,
            "load": self._on_load,
            "facts": self._on_facts,
        }

    def run(self, reader: RecordReader) -> None:
        self.receiver.prepare()
        self.receiver.start()
        self.sender.start()
        self.heartbeat.start()
        write_record(self.out_fd, ["ready"])
        try:
            while True:
                for record in reader.read(timeout=None):
                    self._handlers[record[0]](*record[1:])
        except EOFError:
            logger.info("the scheduler closed its end: stopping")
        except _Terminated:
            logger.info("SIGTERM: stopping")
        finally:
            self.receiver.stop()
            self.sender.stop()
            self.heartbeat.stop()

    def _on_start(self, rid: str, *info: Any) -> None:
        self.infos[rid] = ReqInfo(*info)
        self.windows.drop(rid)

    def _on_forget(self, rid: str) -> None:
        self.infos.pop(rid, None)
        self.windows.drop(rid)

    def _on_step(self, step: int, records: list[list[Any]], plain: list[list[Any]]) -> None:
        msg = step_message(records, self.infos, self.worker_id, step, plain, self.windows)
        if msg is not None:
            self.sender.send(self.detok_stream, msg)

    def _on_msg(self, stream: str, data: bytes) -> None:
        self.sender.send(stream, data)

    def _on_load(self, figures: list[Any]) -> None:
        self.load.figures = LoadFigures(*figures)

    def _on_facts(self, changes: dict[str, Any]) -> None:
        self.load.facts = self.load.facts._replace(**changes)
        try:
            self.heartbeat.beat()  # now, before the reply that follows is sent
        except redis.RedisError as exc:  # the heartbeat thread retries; the router refreshes
            logger.warning("heartbeat after %s changed: %s", sorted(changes), exc)


def main(argv: list[str]) -> None:
    in_fd, out_fd = int(argv[0]), int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_term(signum: int, frame: object) -> None:
        raise _Terminated

    reader = RecordReader(in_fd)
    try:
        (kind, hello), *rest = reader.read(timeout=None)
    except EOFError:
        exit_process(1)
    assert kind == "hello" and not rest, f"expected one hello record, got {kind}"
    setup_logging(f"{WORKER_KIND}-io", str(hello["worker_id"]), hello["log_level"])
    io = IoProcess(hello, out_fd)
    signal.signal(signal.SIGTERM, on_term)
    io.run(reader)
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1:])
