"""A fake back end for testing a real router process in isolation.

`FakeWorker` plays tokenizer + worker + detokenizer over a real Redis: it reads
`TokenizeReqMsg`s from `{p}:tokenize` (only those addressed to its worker id), "generates"
the text its `plan` function chooses, one character per token per step, and writes
`DetokOutputMsg` rows straight into the router's stream, the way detokenizers would,
optionally out of order and with duplicates. It heartbeats a `WorkerLoadMsg` whose
`num_running_reqs` is its real number of running requests (and, as the services it stands
for, a tokenizer's and a detokenizer's status under its id), and honours `AbortReqMsg`s
from `{p}:worker:{w}:in` with a final `abort` row. `start_router` runs `sluice router`.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx2 as httpx
import redis

from shared.heartbeat import Heartbeat
from shared.keys import (
    DETOKENIZER_KIND,
    TOKENIZER_KIND,
    WORKER_KIND,
    heartbeat_key,
    router_out_stream,
    tokenize_stream,
    worker_in_stream,
)
from shared.messages import (
    AbortReqMsg,
    DetokOutputMsg,
    DetokRow,
    ErrorMsg,
    FinishReason,
    ServiceStatusMsg,
    TokenizeReqMsg,
    WorkerLoadMsg,
    decode_message,
)
from shared.redis_server import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONTEXT_LEN = 4096


@dataclass
class Plan:
    """What the fake does with one request: emit `pieces` (one token each), then finish."""

    pieces: list[str] = field(default_factory=list)
    finish: FinishReason = field(default_factory=lambda: FinishReason("length"))
    error: tuple[int, str, str] | None = None  # (status, code, message) instead of output
    prompt_tokens: int = 3
    cached_tokens: int = 0


def default_plan(msg: TokenizeReqMsg) -> Plan:
    """Echo: the prompt text (or the last chat message) reversed, cut at max_new_tokens."""
    prompt = msg.text if msg.text is not None else ""
    if msg.messages:
        prompt = msg.messages[-1].content
    if msg.input_ids is not None:
        prompt = "".join(chr(ord("a") + t % 26) for t in msg.input_ids)
    text = prompt[::-1] or "x"
    limit = msg.sampling_params.get("max_new_tokens", 16)
    stops = msg.sampling_params.get("stop") or []
    pieces = list(text[:limit])
    finish = FinishReason("length") if len(text) >= limit else FinishReason("stop", 2)
    for i in range(1, len(pieces) + 1):  # stop early, as a worker would
        so_far = "".join(pieces[:i])
        hit = next((s for s in stops if s in so_far), None)
        if hit is not None:
            pieces, finish = pieces[:i], FinishReason("stop", hit)
            break
    return Plan(pieces, finish, prompt_tokens=max(1, len(prompt)))


@dataclass
class _Running:
    msg: TokenizeReqMsg
    plan: Plan
    pos: int = 0
    aborted: str = ""  # the abort's reason, once one came


class FakeWorker:
    def __init__(
        self,
        redis_url: str,
        prefix: str,
        worker_id: str = "w0",
        plan: Callable[[TokenizeReqMsg], Plan] = default_plan,
        step_s: float = 0.005,
        shuffle: bool = False,
        duplicate: bool = False,
        silent: bool = False,
        hb_ttl_s: float = 1.0,
    ) -> None:
        self.redis = redis.Redis.from_url(redis_url)
        self.prefix, self.worker_id, self.plan = prefix, worker_id, plan
        self.step_s, self.shuffle, self.duplicate, self.silent = step_s, shuffle, duplicate, silent
        self.running: dict[str, _Running] = {}
        self.received: list[TokenizeReqMsg] = []
        self.aborted: list[str] = []
        self._stop = threading.Event()
        self._rng = random.Random(0)
        key = heartbeat_key(prefix, WORKER_KIND, worker_id)
        self.heartbeat = Heartbeat(self.redis, key, hb_ttl_s, self._load)
        self.role_beats = [
            Heartbeat(self.redis, heartbeat_key(prefix, kind, worker_id), hb_ttl_s,
                      lambda kind=kind: self._status(kind))
            for kind in (TOKENIZER_KIND, DETOKENIZER_KIND)
        ]  # fmt: skip
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> FakeWorker:
        self.heartbeat.start()
        for beat in self.role_beats:
            beat.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop generating and beating (the heartbeat key is deleted: the worker is gone)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.heartbeat.stop()
        for beat in self.role_beats:
            beat.stop()

    def _status(self, kind: str) -> ServiceStatusMsg:
        now = time.time()
        return ServiceStatusMsg(kind, self.worker_id, "fake", os.getpid(), now, now, 0)

    def _load(self) -> WorkerLoadMsg:
        return WorkerLoadMsg(
            worker_id=self.worker_id,
            model="fake-model",
            num_running_reqs=len(self.running),
            num_waiting_reqs=0,
            num_used_tokens=0,
            num_cached_tokens=0,
            max_total_num_tokens=10_000,
            max_running_requests=64,
            context_len=CONTEXT_LEN,
            token_usage=0.0,
            gen_throughput=123.5,
            host="test",
            pid=os.getpid(),
            updated_at=time.time(),
            spec_accept_length=2.25,
        )

    def _loop(self) -> None:
        streams = {
            tokenize_stream(self.prefix): "0",
            worker_in_stream(self.prefix, self.worker_id): "0",
        }
        while not self._stop.is_set():
            block = None if self.running and not self.silent else 20
            reply = (
                self.redis.xread(streams, count=100, block=block)
                if block
                else self.redis.xread(streams, count=100)
            )
            for stream, entries in reply or []:
                streams[stream.decode()] = entries[-1][0].decode()
                for _, fields in entries:
                    self._take(decode_message(fields[b"m"]))
            if self.running and not self.silent:
                self._step()
                time.sleep(self.step_s)

    def _take(self, msg: object) -> None:
        if isinstance(msg, TokenizeReqMsg) and msg.worker_id == self.worker_id:
            self.received.append(msg)
            plan = self.plan(msg)
            if plan.error is not None:
                status, code, text = plan.error
                err = ErrorMsg(msg.rid, msg.router_id, code, text, status, "fake")
                self.redis.xadd(router_out_stream(self.prefix, msg.router_id), {"m": err.to_msg()})
            else:
                self.running[msg.rid] = _Running(msg, plan)
        elif isinstance(msg, AbortReqMsg):
            self.aborted.append(msg.rid)
            if msg.rid in self.running:
                self.running[msg.rid].aborted = msg.reason or "aborted"

    def _step(self) -> None:
        rows: dict[str, list[DetokRow]] = {}
        for rid, r in list(self.running.items()):
            done = r.aborted or r.pos + 1 >= len(r.plan.pieces)
            if r.aborted:
                finish, ids, text = FinishReason("abort", message=r.aborted), [], ""
            else:
                finish = r.plan.finish if done else None
                text = r.plan.pieces[r.pos] if r.plan.pieces else ""
                ids = [ord(text)] if text else []
            lps = tops = vals = None
            if r.msg.return_logprob:  # token t gets logprob -t/1000; its top list t, t+1, ...
                lps = [-t / 1000 for t in ids]
                k = r.msg.top_logprobs_num
                tops = [[t + j for j in range(k)] for t in ids]
                vals = [[-(t + j) / 1000 for j in range(k)] for t in ids]
            row = DetokRow(
                rid,
                r.pos,
                r.pos + len(ids),
                text,
                ids,
                finish,
                r.plan.prompt_tokens,
                r.pos + len(ids),
                r.plan.cached_tokens,
                lps,
                tops,
                vals,
            )
            r.pos += len(ids)
            rows.setdefault(r.msg.router_id, []).append(row)
            if done:
                del self.running[rid]
        for router_id, batch in rows.items():
            self._send(router_id, batch)

    def _send(self, router_id: str, rows: list[DetokRow]) -> None:
        stream = router_out_stream(self.prefix, router_id)
        # one message per step, as a detokenizer sends; one per row when they get shuffled
        groups = [[row] for row in rows] if self.shuffle or self.duplicate else [rows]
        msgs = [
            DetokOutputMsg.from_rows(g, router_id=router_id, worker_id=self.worker_id, step=0)
            for g in groups
        ]
        if self.duplicate:
            msgs += msgs[::2]
        if self.shuffle:
            self._pending = getattr(self, "_pending", []) + msgs
            if self._rng.random() < 0.5 and len(self.running) > 0:
                return  # hold this step back: it goes out after a later one
            msgs, self._pending = self._pending[::-1], []
        pipe = self.redis.pipeline()
        for m in msgs:
            pipe.xadd(stream, {"m": m.to_msg()})
        pipe.execute()


def metric(base: str, name: str) -> float:
    """The sum over its series (workers) of metric `name` from the router's /metrics."""
    lines = httpx.get(base + "/metrics").text.splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith((name + "{", name + " ")))


ROUTER_PROCS: dict[str, subprocess.Popen] = {}  # base URL → the process, for a test to kill


@contextmanager
def start_router(
    redis_url: str, prefix: str, *extra: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    """Run `sluice router` on a free port; yield its base URL (its process: ROUTER_PROCS)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "services.router",
        "--redis-url",
        redis_url,
        "--prefix",
        prefix,
        "--port",
        str(port),
        "--router-id",
        "r1",
        "--worker-check-s",
        "0.2",
        *extra,
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(base + "/metrics", timeout=1)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the router did not start") from None
                time.sleep(0.1)
        ROUTER_PROCS[base] = proc
        yield base
    finally:
        ROUTER_PROCS.pop(base, None)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
