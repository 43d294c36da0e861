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

Running them is services/batch_run.py. Any router can finish a batch: the router running it
renews a lease (`lease_s`) every `poll_s`; every router looks at the batches that have not ended
every `poll_s` and takes one whose lease has lapsed (its router died) or was given back (it
stopped), and goes on from the answers stored so far (the lines in flight when the other stopped
are sent again).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from services.batch_files import FileStore, expiry_seconds
from services.batch_lines import (
    ENDPOINTS,
    Usage,
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
MAX_METADATA = 16



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


class Batches:
    """The batches in Redis: the API's side (BatchRunner runs them)."""

    def __init__(
        self, redis: Any, prefix: str, router_id: str, files: FileStore,
        max_requests: int = 50_000, keep_s: float = 0.0,
    ) -> None:  # fmt: skip
        self.redis, self.prefix, self.router_id, self.files = redis, prefix, router_id, files
        self.max_requests, self.keep_s = max_requests, keep_s

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

    def _start(self, batch_id: str) -> None:
        """Run the batch (services/batch_run.py)."""
        raise NotImplementedError

    async def _save(self, batch: dict[str, Any]) -> None:
        await self.redis.set(batch_key(self.prefix, batch["id"]), json.dumps(batch))

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

    def runner(request: Request) -> Batches:
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
