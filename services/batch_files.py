"""OpenAI's Files API (`/v1/files`), the Batch API's inputs and outputs, stored in Redis so
that every router sees them (services/batches.py runs the batches).

* `POST /v1/files` (multipart: `file`, `purpose`, optional `expires_after[anchor]` =
  `created_at` and `expires_after[seconds]` in [3600, 2592000]) stores the file and answers its
  file object. Purposes are OpenAI's; only `batch` files feed batches. A file expires after
  `expires_after`, else after the router's `--files-ttl-s` (default 30 days, OpenAI's for batch
  files; 0 keeps files until they are deleted). At most `--files-max-bytes` (200 MB, OpenAI's
  batch input limit): a larger one is a 413.
* `GET /v1/files` (`purpose`, `limit` (1..10000), `order` asc|desc by creation, `after` an id),
  `GET /v1/files/{id}`, `GET /v1/files/{id}/content` (its bytes), `DELETE /v1/files/{id}`
  (a 400 while a batch that has not ended reads it).

A file is one Redis hash `{p}:file:{id}` (`meta`: the file object's JSON, `content`: the
bytes) that expires with the file, and an entry in the sorted set `{p}:files` (id by creation
time) that listing prunes of the expired.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from services.router_fields import ApiError
from shared.keys import file_key, files_index_key

PURPOSES = ("batch", "assistants", "fine-tune", "vision", "user_data", "evals")
OUTPUT_PURPOSE = "batch_output"  # the purpose of the files batches write
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 2_592_000  # OpenAI's bounds on expires_after.seconds
MAX_LIST = 10_000


def not_found(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", "file_id", "file_not_found")


def expiry_seconds(expires_after: Any, param: str) -> int | None:
    """The seconds of an `expires_after` object (`{"anchor": "created_at", "seconds": N}`),
    None without one; a 400 naming `param` if it is malformed."""
    if expires_after is None:
        return None
    if not isinstance(expires_after, dict) or set(expires_after) != {"anchor", "seconds"}:
        raise ApiError(400, f"{param} must be an object with 'anchor' and 'seconds'", param,
                       "invalid_value")  # fmt: skip
    if expires_after["anchor"] != "created_at":
        raise ApiError(400, f"{param}.anchor must be 'created_at'", f"{param}.anchor",
                       "invalid_value")  # fmt: skip
    seconds = expires_after["seconds"]
    if isinstance(seconds, str) and seconds.strip().isdigit():  # a multipart form's field
        seconds = int(seconds)
    if type(seconds) is not int or not MIN_EXPIRY_S <= seconds <= MAX_EXPIRY_S:
        raise ApiError(400, f"{param}.seconds must be an integer in [{MIN_EXPIRY_S}, "
                       f"{MAX_EXPIRY_S}]", f"{param}.seconds", "invalid_value")  # fmt: skip
    return seconds


class FileStore:
    def __init__(self, redis: Any, prefix: str, ttl_s: float, max_bytes: int) -> None:
        self.redis, self.prefix, self.ttl_s, self.max_bytes = redis, prefix, ttl_s, max_bytes

    def _expiry(self, seconds: int | None) -> int | None:
        if seconds is None and self.ttl_s > 0:
            seconds = max(1, int(self.ttl_s))
        return seconds

    async def create(
        self, content: bytes, filename: str, purpose: str, expires_s: int | None = None
    ) -> dict[str, Any]:
        """Store `content` as a new file; its file object."""
        now = int(time.time())
        seconds = self._expiry(expires_s)
        meta = {
            "id": f"file-{uuid.uuid4().hex}",
            "object": "file",
            "bytes": len(content),
            "created_at": now,
            "expires_at": now + seconds if seconds else None,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
        }
        key = file_key(self.prefix, meta["id"])
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"meta": json.dumps(meta), "content": content})
            if seconds:
                pipe.expire(key, seconds)
            pipe.zadd(files_index_key(self.prefix), {meta["id"]: time.time()})
            await pipe.execute()
        return meta

    async def meta(self, file_id: str) -> dict[str, Any]:
        raw = await self.redis.hget(file_key(self.prefix, file_id), "meta")
        if raw is None:
            raise not_found(file_id)
        return json.loads(raw)

    async def content(self, file_id: str) -> bytes:
        raw = await self.redis.hget(file_key(self.prefix, file_id), "content")
        if raw is None:
            raise not_found(file_id)
        return bytes(raw)

    async def delete(self, file_id: str) -> bool:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(file_key(self.prefix, file_id))
            pipe.zrem(files_index_key(self.prefix), file_id)
            removed, _ = await pipe.execute()
        return bool(removed)

    async def listing(
        self, purpose: str | None, limit: int, order: str, after: str | None
    ) -> dict[str, Any]:
        if not 1 <= limit <= MAX_LIST:
            raise ApiError(400, f"limit must be in [1, {MAX_LIST}]", "limit", "invalid_value")
        if order not in ("asc", "desc"):
            raise ApiError(400, "order must be 'asc' or 'desc'", "order", "invalid_value")
        index = files_index_key(self.prefix)
        ids = [i.decode() for i in await self.redis.zrange(index, 0, -1, desc=order == "desc")]
        if after is not None:
            if after not in ids:
                raise ApiError(400, f"no file has id {after!r}", "after", "invalid_value")
            ids = ids[ids.index(after) + 1:]
        page: list[dict[str, Any]] = []
        gone: list[str] = []
        for start in range(0, len(ids), 256):
            chunk = ids[start:start + 256]
            async with self.redis.pipeline(transaction=False) as pipe:
                for file_id in chunk:
                    pipe.hget(file_key(self.prefix, file_id), "meta")
                metas = await pipe.execute()
            for file_id, raw in zip(chunk, metas, strict=True):
                if raw is None:  # expired
                    gone.append(file_id)
                    continue
                meta = json.loads(raw)
                if purpose is None or meta["purpose"] == purpose:
                    page.append(meta)
            if len(page) > limit:
                break
        if gone:
            await self.redis.zrem(index, *gone)
        more = len(page) > limit
        page = page[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": more}  # fmt: skip


async def _upload(store: FileStore, request: Request) -> dict[str, Any]:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(400, "a file is uploaded as multipart/form-data with fields 'file' and "
                       "'purpose'", None, "invalid_request")  # fmt: skip
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > store.max_bytes + 65536:
        raise _too_large(store)
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception as exc:  # a malformed multipart body
        raise ApiError(400, f"malformed multipart body: {exc}", None, "invalid_request") from None
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "missing the 'file' field (a file part)", "file",
                           "missing_required_parameter")  # fmt: skip
        if not isinstance(purpose, str) or not purpose:
            raise ApiError(400, "missing the 'purpose' field", "purpose",
                           "missing_required_parameter")  # fmt: skip
        if purpose not in PURPOSES:
            raise ApiError(400, f"purpose must be one of {', '.join(PURPOSES)}", "purpose",
                           "invalid_value")  # fmt: skip
        anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
        expires = None
        if anchor is not None or seconds is not None:
            expires = expiry_seconds({"anchor": anchor, "seconds": seconds}, "expires_after")
        content = await upload.read(store.max_bytes + 1)
        if len(content) > store.max_bytes:
            raise _too_large(store)
        name = upload.filename or "upload"
    finally:
        await form.close()
    return await store.create(content, name, purpose, expires)


def _too_large(store: FileStore) -> ApiError:
    return ApiError(413, f"a file must be at most {store.max_bytes} bytes", "file",
                    "file_too_large")  # fmt: skip


def add_routes(app: Any, state: dict[str, Any]) -> None:
    """`/v1/files` on the router's app (`state["router"]`: its `Router`, whose `files` is the
    store and `batches` the batch runner, which says whether a batch reads a file)."""

    def store(request: Request) -> FileStore:
        router = state["router"]
        router.authorize(request)
        return router.files

    @app.post("/v1/files")
    async def upload(request: Request) -> Any:
        return await _upload(store(request), request)

    @app.get("/v1/files")
    async def listing(
        request: Request, purpose: str | None = None, limit: int = MAX_LIST, order: str = "desc",
        after: str | None = None,
    ) -> Any:  # fmt: skip
        return await store(request).listing(purpose, limit, order, after)

    @app.get("/v1/files/{file_id}")
    async def retrieve(file_id: str, request: Request) -> Any:
        return await store(request).meta(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def content(file_id: str, request: Request) -> Response:
        return Response(await store(request).content(file_id),
                        media_type="application/octet-stream")  # fmt: skip

    @app.delete("/v1/files/{file_id}")
    async def delete(file_id: str, request: Request) -> Any:
        files = store(request)
        await state["router"].batches.check_file_deletable(file_id)
        if not await files.delete(file_id):
            raise not_found(file_id)
        return {"id": file_id, "object": "file", "deleted": True}
