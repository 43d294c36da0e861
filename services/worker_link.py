"""The pipes between a worker's scheduler process and its Redis I/O process.

The scheduler process runs one Python thread; everything that talks to Redis (reading the
worker's stream, publishing step messages, the heartbeat) runs in a child process,
`services.worker_io`. Threads for that I/O in the scheduler's own process would share its
GIL, and every torch op of the forward releases and retakes it. Measured at batch 64 on one
core (`benchmarks/worker_io_probe.py`, two runs): a sender thread made each decode step
0.7-0.9 ms longer (its own work is ~0.3 ms: the rest is GIL hand-offs), sending from the
scheduler thread itself 0.7-0.8 ms, and this pipe 0.17-0.29 ms (building the row records
included). Since then most rows go as columns (`step_records`): at batch 256 the record
costs the scheduler thread ~75 us a step instead of ~250 (`benchmarks/host_overhead.py
--loops worker`).

Records are msgpack arrays written back to back and read with a streaming unpacker; the
first item names the record:

    scheduler → I/O   ["hello", config]                                    once, first
                      ["start", rid, router_id, skip_special_tokens,
                                spaces_between_special_tokens, prompt_tokens,
                                prompt_ids or None]                        a request starts
                      ["forget", rid]                    a started request ends without rows
                      ["step", step, [row record, ...], plain rows]  see `step_records`
                      ["msg", stream, message bytes]                       publish as is
                      ["load", [figure, ...]]                              `LoadFigures`
                      ["facts", {field: value}]         `WorkerFacts` changed (beat now)
    I/O → scheduler   ["ready"]                                            once, when serving
                      ["in", [message bytes, ...]]                         one read of the stream

The scheduler's end (`IoLink`) never blocks on the I/O process except when the pipe is
full (the I/O process reads it continuously). Either side seeing the other's end closed
stops: the I/O process flushes what it has and deletes the heartbeat; the scheduler
process treats a lost I/O process as fatal (a worker that can neither hear nor answer).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import subprocess
import sys
import time
from typing import Any

import msgpack

from shared.messages import Message, MessageError, decode_message

logger = logging.getLogger(__name__)

READ_CHUNK = 1 << 16
PIPE_SIZE = 1 << 20  # F_SETPIPE_SZ: room for a burst of requests while a step runs
_F_SETPIPE_SZ = 1031
READY_TIMEOUT_S = 60.0


def write_record(fd: int, record: list[Any]) -> None:
    """Write one record (all of it: a pipe write can be partial)."""
    data = memoryview(msgpack.packb(record))
    while data:
        data = data[os.write(fd, data) :]


def widen_pipe(fd: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # Linux only; best effort
        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_SIZE)


class RecordReader:
    """Complete records from a pipe. `read(timeout)` returns those that arrived within
    `timeout` seconds (None: wait for at least one; 0: only what is there); EOFError once
    the writer has closed its end and every record was returned."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.unpacker = msgpack.Unpacker(raw=False)
        self.eof = False

    def read(self, timeout: float | None = 0.0) -> list[list[Any]]:
        records = list(self.unpacker)
        while not records and not self.eof:
            if timeout != 0.0 and not select.select([self.fd], [], [], timeout)[0]:
                break
            self._fill()
            records = list(self.unpacker)
            if timeout == 0.0:
                break
        if not records and self.eof:
            raise EOFError("the other end of the pipe was closed")
        return records

    def _fill(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, READ_CHUNK)
            except BlockingIOError:
                return
            if not chunk:
                self.eof = True
                return
            self.unpacker.feed(chunk)
            if len(chunk) < READ_CHUNK:
                return


class IoLink:
    """The scheduler process's end: starts the I/O process and talks to it."""

    def __init__(self, hello: dict[str, Any], ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        down_r, down_w = os.pipe()  # scheduler → I/O
        up_r, up_w = os.pipe()  # I/O → scheduler
        for fd in (down_w, up_w):
            widen_pipe(fd)
        cmd = [sys.executable, "-m", "services.worker_io", str(down_r), str(up_w)]
        self.proc = subprocess.Popen(cmd, pass_fds=(down_r, up_w), stdin=subprocess.DEVNULL)
        os.close(down_r)
        os.close(up_w)
        self._out: int | None = down_w
        self._in = RecordReader(up_r)
        self._pending: list[list[Any]] = []
        self._send(["hello", hello])
        self._wait_ready(ready_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise RuntimeError(f"the worker's I/O process was not ready in {timeout_s} s")
            try:
                records = self._in.read(timeout=min(left, 0.5))
            except EOFError:
                code = self.proc.wait()
                msg = f"the worker's I/O process exited at start (code {code})"
                raise RuntimeError(msg) from None
            for i, rec in enumerate(records):
                if rec[0] == "ready":
                    self._pending = records[i + 1 :]
                    return

    # -- to the I/O process -------------------------------------------------------------------
    def _send(self, record: list[Any]) -> None:
        if self._out is None:
            raise RuntimeError("the link to the worker's I/O process is closed")
        try:
            write_record(self._out, record)
        except BrokenPipeError:
            raise RuntimeError(
                f"the worker's I/O process exited (code {self.proc.poll()})"
            ) from None

    def start(self, rid: str, info: tuple[str, bool, bool, int]) -> None:
        self._send(["start", rid, *info])

    def forget(self, rid: str) -> None:
        """A started request that ended without a step row (its grammar did not compile)."""
        self._send(["forget", rid])

    def step(self, step: int, rows: list[tuple[Any, ...]], plain: list[list[Any]]) -> None:
        self._send(["step", step, rows, plain])

    def publish(self, stream: str, msg: Message) -> None:
        self._send(["msg", stream, msg.to_msg()])

    def load(self, figures: tuple[Any, ...]) -> None:
        self._send(["load", list(figures)])

    def facts(self, **changes: Any) -> None:
        """Facts of the heartbeat changed (the LoRA adapters served, the weights' checkpoint):
        it says so before any record sent after this one is handled (the routers that get a
        reply sent next then see them)."""
        self._send(["facts", changes])

    # -- from the I/O process -----------------------------------------------------------------
    def receive(self, timeout: float = 0.0) -> list[Message]:
        """The requests, aborts and flushes read since the last call (waiting up to `timeout` s for
        some); RuntimeError if the I/O process is gone."""
        records, self._pending = self._pending, []
        if not records:
            try:
                records = self._in.read(timeout)
            except EOFError:
                raise RuntimeError(
                    f"the worker's I/O process exited (code {self.proc.wait()})"
                ) from None
        out: list[Message] = []
        for rec in records:
            for data in rec[1] if rec[0] == "in" else ():
                try:
                    msg = decode_message(data)
                except MessageError as exc:  # the I/O process forwards checked messages only
                    logger.error("undecodable message from the I/O process: %s", exc.reason)
                    continue
                out.append(msg)
        return out

    def close(self, timeout_s: float = 10.0) -> None:
        """Close both pipes (the I/O process sends what it has, deletes the heartbeat and
        exits; a forward to us blocked on a full pipe fails at once); wait for it."""
        if self._out is None:
            return
        os.close(self._out)
        os.close(self._in.fd)
        self._out = None
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("the I/O process did not stop in %.0f s: killing it", timeout_s)
            self.proc.kill()
            self.proc.wait()
