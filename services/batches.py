"""OpenAI's Batch API (`/v1/batches`): a file of requests run in the background, the answers
written to an output file (services/batch_files.py holds the files), shared by every router
through Redis.

* `POST /v1/batches` (`input_file_id` of a `batch` file, `endpoint` one of
  services/batch_lines.ENDPOINTS, `completion_window` "24h", optional `metadata` and
  `output_expires_after`) answers the batch `validating`; the router that took it runs it.
* Validation reads the file: every line must be a JSON object with a unique `custom_id`,
  `method` POST, `url` the batch's endpoint and an object `body`, and there must be 1 to
  `--batch-max-requests` of them; else the batch is `failed` with `errors` (line numbers).
* `in_progress`: each line is served by the router's own HTTP app, in process
  (batch_lines.call_app), so it is answered as the same request over HTTP would be; at most
  `--batch-concurrency` lines at once over all the batches a router runs, which keeps the
  workers' batches full while the rest of a large file waits in the router. While the router
  sees no live worker, lines wait; a line answered 502/503/504 (the bus or a worker gone) is
  sent again after 1, 2, 4 ... 30 s until the batch ends, so a batch outlives a worker's
  restart. `request_counts` and `usage`
  (token counts summed) are stored every `poll_s`.
* Then `finalizing` and `completed`: the 2xx answers go to the output file, the others (with
  their status and error body) to the error file, in input order; `output_file_id` /
  `error_file_id` are null when there are none.
* `POST /v1/batches/{id}/cancel` marks it `cancelling` at once (on any router); the router
  running it aborts its requests in flight (at the workers too) and ends it `cancelled`.
  A batch not done 24 h after its creation ends `expired`. In both, the answers so far are
  in the output and error files, and each line never answered is in the error file with
  `"response": null` and `error.code` `batch_cancelled` / `batch_expired` (OpenAI's rule for
  expiry), counted as failed.
* `GET /v1/batches/{id}`, `GET /v1/batches` (`limit` 1..100, `after`), newest first.

Any router can finish a batch: the router running it renews a lease (`lease_s`) every
`poll_s`; every router looks at the batches that have not ended every `poll_s` and takes one
whose lease has lapsed (its router died) or was given back (it stopped), and goes on from the
answers stored so far (the lines in flight when the other stopped are sent again).
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

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from services.batch_files import OUTPUT_PURPOSE, FileStore, expiry_seconds
from services.batch_lines import (
    ENDPOINTS,
    Answer,
    Line,
    Usage,
    output_line,
    parse_input,
    refused,
    unanswered_line,
)
from services.router_fields import ApiError
from services.router_protocol import parse_body
from shared.keys import (
    batch_cancel_key,
    batch_key,
    batch_lease_key,
    batch_results_key,
    batches_index_key,
    batches_running_key,
)

logger = logging.getLogger(__name__)

WINDOW_S = {"24h": 86_400}
RUNNING = ("validating", "in_progress", "finalizing", "cancelling")
RETRIED = (502, 503, 504)
MAX_METADATA = 16
_RENEW = """if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"""
_RELEASE = """if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1]) else return 0 end"""

Invoke = Callable[[str, bytes], Awaitable[Answer]]


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None


def not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"No such Batch object: {batch_id}", "batch_id", "batch_not_found")


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA:
        raise ApiError(400, f"metadata holds at most {MAX_METADATA} pairs", "metadata",
                       "invalid_value")  # fmt: skip
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise ApiError(400, "metadata keys are at most 64 characters and values 512",
                           f"metadata.{key[:64]}", "invalid_value")  # fmt: skip


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


class BatchRunner:
    def __init__(
        self, redis: Any, prefix: str, router_id: str, files: FileStore, concurrency: int = 256,
        max_requests: int = 50_000, poll_s: float = 0.5, lease_s: float = 10.0,
        keep_s: float = 0.0,
    ) -> None:  # fmt: skip
        self.redis, self.prefix, self.router_id, self.files = redis, prefix, router_id, files
        self.slots = asyncio.Semaphore(concurrency)
        self.max_requests, self.poll_s, self.lease_s, self.keep_s = (
            max_requests, poll_s, lease_s, keep_s)  # fmt: skip
        self.invoke: Invoke | None = None
        self.ready: Callable[[], bool] = lambda: True
        self.tasks: dict[str, asyncio.Task] = {}
        self._supervisor: asyncio.Task | None = None

    # -- the API --------------------------------------------------------------------------

    async def create(self, raw: bytes) -> dict[str, Any]:
        body = parse_body(BatchCreate, raw)
        if body.endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint",
                           "invalid_value")  # fmt: skip
        if body.completion_window not in WINDOW_S:
            raise ApiError(400, "completion_window must be '24h'", "completion_window",
                           "invalid_value")  # fmt: skip
        _check_metadata(body.metadata)
        expiry_seconds(body.output_expires_after, "output_expires_after")
        meta = await self.files.meta(body.input_file_id)
        if meta["purpose"] != "batch":
            raise ApiError(400, f"file {body.input_file_id} has purpose {meta['purpose']!r}; a "
                           "batch reads a file uploaded with purpose 'batch'", "input_file_id",
                           "invalid_value")  # fmt: skip
        now = int(time.time())
        batch = {
            "id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": body.endpoint,
            "errors": None, "input_file_id": body.input_file_id,
            "completion_window": body.completion_window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now,
            "in_progress_at": None, "expires_at": now + WINDOW_S[body.completion_window],
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "usage": Usage().as_dict(), "metadata": body.metadata,
            "output_expires_after": body.output_expires_after,
        }  # fmt: skip
        bid = batch["id"]
        await self.redis.set(batch_lease_key(self.prefix, bid), self.router_id,
                             px=int(self.lease_s * 1000))  # fmt: skip
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(batch_key(self.prefix, bid), json.dumps(batch))
            pipe.zadd(batches_index_key(self.prefix), {bid: time.time()})
            pipe.sadd(batches_running_key(self.prefix), bid)
            await pipe.execute()
        self._start(bid)
        return _public(batch)

    async def load(self, batch_id: str) -> dict[str, Any]:
        """The batch as the API shows it: `cancelling` once it is asked to, whichever router
        runs it."""
        raw = await self.redis.get(batch_key(self.prefix, batch_id))
        if raw is None:
            raise not_found(batch_id)
        batch = json.loads(raw)
        if batch["status"] in ("validating", "in_progress"):
            mark = await self.redis.get(batch_cancel_key(self.prefix, batch_id))
            if mark is not None:
                batch["status"], batch["cancelling_at"] = "cancelling", int(float(mark))
        return batch

    async def retrieve(self, batch_id: str) -> dict[str, Any]:
        return _public(await self.load(batch_id))

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        batch = await self.load(batch_id)
        if batch["status"] not in ("validating", "in_progress", "cancelling"):
            raise ApiError(400, f"cannot cancel a batch that is {batch['status']}", "batch_id",
                           "invalid_state")  # fmt: skip
        now = int(time.time())
        await self.redis.set(batch_cancel_key(self.prefix, batch_id), now, nx=True)
        return await self.retrieve(batch_id)

    async def listing(self, limit: int, after: str | None) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit must be in [1, 100]", "limit", "invalid_value")
        index = batches_index_key(self.prefix)
        ids = [i.decode() for i in await self.redis.zrange(index, 0, -1, desc=True)]
        if after is not None:
            if after not in ids:
                raise ApiError(400, f"no batch has id {after!r}", "after", "invalid_value")
            ids = ids[ids.index(after) + 1:]
        page, gone = [], []
        for batch_id in ids:
            try:
                page.append(await self.retrieve(batch_id))
            except ApiError:  # its record expired
                gone.append(batch_id)
            if len(page) > limit:
                break
        if gone:
            await self.redis.zrem(index, *gone)
        more, page = len(page) > limit, page[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": more}  # fmt: skip

    async def check_file_deletable(self, file_id: str) -> None:
        """A 400 if a batch that has not ended reads `file_id`."""
        for raw in await self.redis.smembers(batches_running_key(self.prefix)):
            record = await self.redis.get(batch_key(self.prefix, raw.decode()))
            if record is not None and json.loads(record)["input_file_id"] == file_id:
                raise ApiError(400, f"file {file_id} is the input of batch {raw.decode()}, "
                               "which has not ended", "file_id", "file_in_use")  # fmt: skip

    # -- running them -------------------------------------------------------------------

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
        tasks = [t for t in (self._supervisor, *self.tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _start(self, batch_id: str) -> None:
        if batch_id in self.tasks:  # (one task a batch)
            return
        task = asyncio.ensure_future(self._drive(batch_id))
        self.tasks[batch_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(batch_id, None))

    async def _supervise(self) -> None:
        """Take the batches no router runs."""
        while True:
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

    async def _save(self, batch: dict[str, Any]) -> None:
        await self.redis.set(batch_key(self.prefix, batch["id"]), json.dumps(batch))

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
        return ending

    async def _check(self, run: _Run) -> str:
        """Renew the lease, store the progress; whether the batch must end now."""
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
            if run.stopping:
                self.slots.release()
                return
            task = asyncio.ensure_future(self._answer(run, results, index, line))
            run.inflight.add(task)
            task.add_done_callback(run.landed)
        run.fed = True
        if not run.inflight:
            run.drained.set()

    async def _answer(self, run: _Run, results: str, index: int, line: Line) -> None:
        try:
            out = refused(line)
            wait_s = 1.0
            while out is None:
                while not self.ready():
                    await asyncio.sleep(self.poll_s)
                assert self.invoke is not None
                answer = await self.invoke(run.batch["endpoint"], json.dumps(line.body).encode())
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

    async def _fail(self, batch: dict[str, Any], errors: list[dict[str, Any]]) -> None:
        batch.update(status="failed", failed_at=int(time.time()),
                     errors={"object": "list", "data": errors})  # fmt: skip
        await self._end(batch)
        logger.info("batch %s failed validation: %s", batch["id"], errors[0]["message"])

    async def _end(self, batch: dict[str, Any]) -> None:
        bid = batch["id"]
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(batch_key(self.prefix, bid), json.dumps(batch),
                     px=int(self.keep_s * 1000) if self.keep_s > 0 else None)  # fmt: skip
            pipe.srem(batches_running_key(self.prefix), bid)
            pipe.delete(batch_results_key(self.prefix, bid), batch_cancel_key(self.prefix, bid))
            await pipe.execute()


def _public(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch object (without what only its runner needs)."""
    return {k: v for k, v in batch.items() if k != "output_expires_after"}


def add_routes(app: Any, state: dict[str, Any]) -> None:
    """`/v1/batches` on the router's app (`state["router"]`: its `Router`)."""

    def runner(request: Request) -> BatchRunner:
        router = state["router"]
        router.authorize(request)
        return router.batches

    @app.post("/v1/batches")
    async def create(request: Request) -> Any:
        return await runner(request).create(await request.body())

    @app.get("/v1/batches")
    async def listing(request: Request, limit: int = 20, after: str | None = None) -> Any:
        return await runner(request).listing(limit, after)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve(batch_id: str, request: Request) -> Any:
        return await runner(request).retrieve(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request) -> Any:
        return await runner(request).cancel(batch_id)
