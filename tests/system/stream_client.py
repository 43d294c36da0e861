"""Drive the services through their streams, as a router would, without HTTP.

`StreamClient` publishes `TokenizeReqMsg`s (or raw messages) and reads its own router
stream `{p}:router:{r}:out`, reassembling each request's rows the way the router does:
ordered by token index, a range already seen is ignored. It has a router's heartbeat (for
ten minutes; `vanish()` deletes it), since workers abort the requests of routers that have
none (services/worker_routers.py).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass, field

from shared.bus import Bus
from shared.heartbeat import Heartbeat
from shared.keys import (
    ROUTER_KIND,
    heartbeat_key,
    router_out_stream,
    tokenize_stream,
    worker_in_stream,
)
from shared.messages import (
    DetokOutputMsg,
    DetokRow,
    ErrorMsg,
    FlushCacheReqMsg,
    FlushCacheRespMsg,
    Message,
    ServiceStatusMsg,
    TokenizeReqMsg,
)


@dataclass
class Result:
    rid: str
    rows: dict[int, DetokRow] = field(default_factory=dict)  # by start; repeats dropped
    num_repeats: int = 0
    error: ErrorMsg | None = None

    @property
    def final(self) -> DetokRow | None:
        return next((r for r in self.rows.values() if r.finished), None)

    @property
    def done(self) -> bool:
        return self.error is not None or (self.final is not None and self.complete)

    @property
    def complete(self) -> bool:
        """Every range up to the final row's end has arrived."""
        final = self.final
        return final is not None and self._covered() == final.end

    def _covered(self) -> int:
        end = 0
        for start in sorted(self.rows):
            if start != end:
                break
            end = self.rows[start].end
        return end

    @property
    def text(self) -> str:
        return "".join(self.rows[s].text for s in sorted(self.rows))

    @property
    def output_ids(self) -> list[int]:
        return [t for s in sorted(self.rows) for t in self.rows[s].output_ids]


class StreamClient:
    def __init__(self, bus: Bus, worker_id: str, router_id: str | None = None) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.router_id = router_id or f"r{uuid.uuid4().hex[:8]}"
        self.out_stream = router_out_stream(bus.prefix, self.router_id)
        self.results: dict[str, Result] = {}
        self.flushes: dict[str, FlushCacheRespMsg] = {}
        self._last_id = "0"
        now, host = time.time(), socket.gethostname()
        beat = ServiceStatusMsg("router", self.router_id, host, os.getpid(), now, now)
        key = heartbeat_key(bus.prefix, ROUTER_KIND, self.router_id)
        self.heartbeat = Heartbeat(bus.redis, key, 600.0, lambda: beat)
        self.heartbeat.beat()  # once: it lives ten minutes

    def vanish(self) -> None:
        """Drop the heartbeat, as a router that died would."""
        self.heartbeat.stop()

    def request(self, rid: str | None = None, **fields: object) -> str:
        rid = rid or f"q{uuid.uuid4().hex[:10]}"
        msg = TokenizeReqMsg(rid, self.router_id, self.worker_id, **fields)  # type: ignore[arg-type]
        self.results[rid] = Result(rid)
        self.bus.publish(tokenize_stream(self.bus.prefix), msg)
        return rid

    def to_worker(self, msg: Message) -> None:
        self.bus.publish(worker_in_stream(self.bus.prefix, self.worker_id), msg)

    def poll(self, block_ms: int = 200) -> None:
        self._last_id, entries = self.bus.read_plain(self.out_stream, self._last_id, 512, block_ms)
        for _, msg in entries:
            if isinstance(msg, ErrorMsg):
                self.results.setdefault(msg.rid, Result(msg.rid)).error = msg
            elif isinstance(msg, FlushCacheRespMsg):
                self.flushes[msg.request_id] = msg
            elif isinstance(msg, DetokOutputMsg):
                for row in msg.rows():
                    result = self.results.setdefault(row.rid, Result(row.rid))
                    if row.start in result.rows:
                        result.num_repeats += 1
                    else:
                        result.rows[row.start] = row

    def flush(self, timeout_s: float = 30.0) -> FlushCacheRespMsg:
        """Ask the worker to flush its prefix cache; its answer."""
        request_id = f"f{uuid.uuid4().hex[:10]}"
        self.to_worker(FlushCacheReqMsg(request_id, self.router_id))
        deadline = time.monotonic() + timeout_s
        while request_id not in self.flushes:
            if time.monotonic() > deadline:
                raise AssertionError("no answer to the cache flush")
            self.poll()
        return self.flushes.pop(request_id)

    def wait(self, rids: list[str] | None = None, timeout_s: float = 120.0) -> dict[str, Result]:
        rids = list(self.results) if rids is None else rids
        for rid in rids:
            self.results.setdefault(rid, Result(rid))
        deadline = time.monotonic() + timeout_s
        while not all(self.results[r].done for r in rids):
            if time.monotonic() > deadline:
                pending = [r for r in rids if not self.results[r].done]
                raise AssertionError(f"{len(pending)} requests unfinished: {pending[:5]}")
            self.poll()
        return {r: self.results[r] for r in rids}
