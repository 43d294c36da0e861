"""Running the batches of the Batch API (services/batches.py says what a batch goes through):
the router's supervisor takes batches whose lease is free, and each batch's task validates its
file, serves its lines through the router's own app (at most `concurrency` at once), stores
each answer as it comes, renews its lease and stores the progress every `poll_s`, and writes
the output and error files at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from services.batch_files import OUTPUT_PURPOSE, FileStore, expiry_seconds
from services.batch_lines import (
    Answer,
    Line,
    Usage,
    output_line,
    parse_input,
    refused,
    unanswered_line,
)
from services.batches import Batches
from services.router_fields import ApiError
from shared.keys import (
    batch_cancel_key,
    batch_key,
    batch_lease_key,
    batch_results_key,
    batches_running_key,
)

logger = logging.getLogger(__name__)

RETRIED = (502, 503, 504)
PRIORITY_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
_RENEW = """if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"""
_RELEASE = """if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1]) else return 0 end"""

Invoke = Callable[[str, bytes], Awaitable[Answer]]


@dataclass
class _Run:
    """What the router running one batch keeps of it."""

    batch: dict[str, Any]
    lines: list[Line] = field(default_factory=list)
    answered: set[int] = field(default_factory=set)
    completed: int = 0
    failed: int = 0
    usage: Usage = field(default_factory=Usage)
    stopping: bool = False
    inflight: set[asyncio.Task] = field(default_factory=set)
    fed: bool = False  # every line not answered before was sent
    drained: asyncio.Event = field(default_factory=asyncio.Event)  # ... and answered

    def landed(self, task: asyncio.Task) -> None:
        self.inflight.discard(task)
        if self.fed and not self.inflight:
            self.drained.set()

    def count(self, index: int, ok: bool, line: dict[str, Any]) -> None:
        self.answered.add(index)
        if ok:
            self.completed += 1
            self.usage.add(line["response"]["body"])
        else:
            self.failed += 1


class BatchRunner(Batches):
    def __init__(
        self, redis: Any, prefix: str, router_id: str, files: FileStore, concurrency: int = 256,
        max_requests: int = 50_000, poll_s: float = 0.5, lease_s: float = 10.0,
        keep_s: float = 0.0, priority: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(redis, prefix, router_id, files, max_requests, keep_s)
        self.priority = priority
        self.slots = asyncio.Semaphore(concurrency)
        self.poll_s, self.lease_s = poll_s, lease_s
        self.invoke: Invoke | None = None
        self.ready: Callable[[], bool] = lambda: True
        self.tasks: dict[str, asyncio.Task] = {}
        self._supervisor: asyncio.Task | None = None
        self.stopping = False  # (a cancel that a Redis call swallows stops the batch anyway)

    def start(self, invoke: Invoke, ready: Callable[[], bool] | None = None) -> None:
        """Run batches, each line through `invoke`; a line waits while `ready()` is false (no
        live worker: the model is not even known)."""
        self.invoke = invoke
        if ready is not None:
            self.ready = ready
        self._supervisor = asyncio.ensure_future(self._supervise())

    async def stop(self) -> None:
        """Stop running batches (their requests in flight are aborted) and give their leases
        back, so that another router goes on with them at once."""
        self.stopping = True
        tasks = [t for t in (self._supervisor, *self.tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _start(self, batch_id: str) -> None:
        if batch_id in self.tasks or self.stopping:  # (one task a batch)
            return
        task = asyncio.ensure_future(self._drive(batch_id))
        self.tasks[batch_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(batch_id, None))

    async def _supervise(self) -> None:
        """Take the batches no router runs."""
        while not self.stopping:
            try:
                for raw in await self.redis.smembers(batches_running_key(self.prefix)):
                    batch_id = raw.decode()
                    if batch_id not in self.tasks and await self._claim(batch_id):
                        logger.info("batch %s: this router goes on with it", batch_id)
                        self._start(batch_id)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("looking for batches to run failed")
            await asyncio.sleep(self.poll_s)

    async def _claim(self, batch_id: str) -> bool:
        """Take the batch's lease if it is free. (Not when it names this router: that may be
        the lease `create` has just taken; a killed router that comes back under its id waits
        for its old lease to lapse.)"""
        key, ms = batch_lease_key(self.prefix, batch_id), int(self.lease_s * 1000)
        return bool(await self.redis.set(key, self.router_id, px=ms, nx=True))

    async def _drive(self, batch_id: str) -> None:
        lease = batch_lease_key(self.prefix, batch_id)
        try:
            raw = await self.redis.get(batch_key(self.prefix, batch_id))
            if raw is None:  # its record expired
                await self.redis.srem(batches_running_key(self.prefix), batch_id)
                return
            await self._run(_Run(json.loads(raw)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("batch %s: running it failed", batch_id)
            with contextlib.suppress(Exception):
                batch = json.loads(await self.redis.get(batch_key(self.prefix, batch_id)))
                await self._fail(batch, [{"code": "internal_error", "message": "the router "
                                 f"running the batch failed: {exc!r}", "param": None,
                                 "line": None}])  # fmt: skip
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.redis.eval(_RELEASE, 1, lease, self.router_id))

    async def _run(self, run: _Run) -> None:
        batch = run.batch
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            await self.redis.srem(batches_running_key(self.prefix), batch["id"])
            return
        try:
            content = await self.files.content(batch["input_file_id"])
        except ApiError:
            await self._fail(batch, [{"code": "file_not_found", "message": "the input file "
                             f"{batch['input_file_id']} expired or was deleted before the batch "
                             "ended", "param": "input_file_id", "line": None}])  # fmt: skip
            return
        run.lines, errors = parse_input(content, batch["endpoint"], self.max_requests)
        if errors:
            await self._fail(batch, errors)
            return
        if batch["status"] == "validating":
            batch.update(status="in_progress", in_progress_at=int(time.time()))
            batch["request_counts"]["total"] = len(run.lines)
            await self._save(batch)
        results = batch_results_key(self.prefix, batch["id"])
        for index, value in (await self.redis.hgetall(results)).items():
            run.count(int(index), value[:1] == b"o", json.loads(value[1:]))
        ending = await self._serve(run, results)
        await self._finish(run, results, ending)

    async def _serve(self, run: _Run, results: str) -> str:
        """Serve the lines not answered yet; how the batch ends: completed, cancelled or
        expired."""
        ending = await self._check(run)  # (a batch taken over may be cancelled or expired)
        if ending != "completed":
            return ending
        feeder = asyncio.ensure_future(self._feed(run, results))
        drained = asyncio.ensure_future(run.drained.wait())
        waiting = {feeder, drained}
        try:
            while not drained.done():
                await asyncio.wait(waiting, timeout=self.poll_s,
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                if feeder in waiting and feeder.done():
                    feeder.result()  # (raises what stopped it)
                    waiting.discard(feeder)
                if not drained.done():
                    ending = await self._check(run)
                    if ending != "completed":
                        break
        finally:
            run.stopping = True
            for task in (feeder, drained, *run.inflight):
                task.cancel()
            await asyncio.gather(feeder, drained, *run.inflight, return_exceptions=True)
        if self.stopping:  # (not finished by a router that stops: another goes on with it)
            raise asyncio.CancelledError
        return ending

    async def _check(self, run: _Run) -> str:
        """Renew the lease, store the progress; whether the batch must end now."""
        if self.stopping:
            raise asyncio.CancelledError
        batch_id = run.batch["id"]
        ms = int(self.lease_s * 1000)
        if not await self.redis.eval(_RENEW, 1, batch_lease_key(self.prefix, batch_id),
                                     self.router_id, ms):  # fmt: skip
            logger.warning("batch %s: lease lost; leaving it to the router that took it",
                           batch_id)  # fmt: skip
            raise asyncio.CancelledError
        self._progress(run)
        await self._save(run.batch)
        if await self.redis.exists(batch_cancel_key(self.prefix, batch_id)):
            return "cancelled"
        if time.time() >= run.batch["expires_at"]:
            return "expired"
        return "completed"

    def _progress(self, run: _Run) -> None:
        run.batch["request_counts"].update(completed=run.completed, failed=run.failed)
        run.batch["usage"] = run.usage.as_dict()

    async def _feed(self, run: _Run, results: str) -> None:
        for index, line in enumerate(run.lines):
            if index in run.answered:
                continue
            await self.slots.acquire()
            if run.stopping or self.stopping:
                self.slots.release()
                return
            task = asyncio.ensure_future(self._answer(run, results, index, line))
            run.inflight.add(task)
            task.add_done_callback(run.landed)
        run.fed = True
        if not run.inflight:
            run.drained.set()

    def _body(self, run: _Run, line: Line) -> bytes:
        """A line's request body; with `priority` set, a generation request that names none
        gets it (behind interactive requests, where the workers schedule by priority)."""
        body = line.body
        if self.priority is not None and "priority" not in body and \
                run.batch["endpoint"] in PRIORITY_ENDPOINTS:  # fmt: skip
            body = {**body, "priority": self.priority}
        return json.dumps(body).encode()

    async def _answer(self, run: _Run, results: str, index: int, line: Line) -> None:
        try:
            out = refused(line)
            wait_s = 1.0
            while out is None:
                while not self.ready():
                    await asyncio.sleep(self.poll_s)
                assert self.invoke is not None
                answer = await self.invoke(run.batch["endpoint"], self._body(run, line))
                if answer.status in RETRIED and not run.stopping:
                    logger.info("batch %s line %s: %s; again in %g s", run.batch["id"],
                                line.custom_id, answer.status, wait_s)  # fmt: skip
                    await asyncio.sleep(wait_s)
                    wait_s = min(30.0, 2 * wait_s)
                    continue
                try:
                    body: Any = json.loads(answer.body)
                except ValueError:
                    body = answer.body.decode("utf-8", "replace")
                request_id = answer.headers.get("x-request-id") or f"req_{uuid.uuid4().hex}"
                out = output_line(line.custom_id, answer.status, request_id, body)
            ok = 200 <= out["response"]["status_code"] < 300
            await self.redis.hset(results, str(index), (b"o" if ok else b"e") +
                                  json.dumps(out).encode())  # fmt: skip
            run.count(index, ok, out)
        finally:
            self.slots.release()

    async def _finish(self, run: _Run, results: str, ending: str) -> None:
        batch, now = run.batch, int(time.time())
        if ending == "cancelled":
            mark = await self.redis.get(batch_cancel_key(self.prefix, batch["id"]))
            batch.update(status="cancelling",
                         cancelling_at=int(float(mark)) if mark is not None else now)  # fmt: skip
        else:
            batch.update(status="finalizing", finalizing_at=now)
        self._progress(run)
        await self._save(batch)
        stored = await self.redis.hgetall(results)
        good, bad = [], []
        reason = {"cancelled": "the batch was cancelled before this request was answered",
                  "expired": "the batch expired before this request was answered"}  # fmt: skip
        # counted again from what is stored: a line cancelled as its answer was being stored
        counted = _Run(batch)
        for index, line in enumerate(run.lines):
            value = stored.get(str(index).encode())
            if value is not None:
                out = json.loads(value[1:])
                (good if value[:1] == b"o" else bad).append(bytes(value[1:]))
                counted.count(index, value[:1] == b"o", out)
            else:
                out = unanswered_line(line.custom_id, f"batch_{ending}", reason[ending])
                bad.append(json.dumps(out).encode())
                counted.failed += 1
        run = counted
        seconds = expiry_seconds(batch.get("output_expires_after"), "output_expires_after")
        for lines, name, attr in ((good, "output", "output_file_id"),
                                  (bad, "error", "error_file_id")):  # fmt: skip
            if lines:
                meta = await self.files.create(b"\n".join(lines) + b"\n",
                                               f"{batch['id']}_{name}.jsonl", OUTPUT_PURPOSE,
                                               seconds)  # fmt: skip
                batch[attr] = meta["id"]
        self._progress(run)
        batch.update(status=ending, **{f"{ending}_at": int(time.time())})
        await self._end(batch)
        logger.info("batch %s %s: %d completed, %d failed", batch["id"], ending, run.completed,
                    run.failed)  # fmt: skip
