"""Stored responses of the Responses API, in Redis, so that every router sees them.

A response is stored when it ends (whole or streamed) if its request's `store` is true (the
API's default) and the router's `--responses-store-ttl-s` is above 0 (default 3600 s): one
JSON record under `{p}:response:{id}` that expires after that long, holding the response
object and the input items of its whole conversation (those of the response it continued,
that response's output, then its own input, each item with an id).

* `previous_response_id` continues a stored conversation: the request's messages are the
  stored items and the stored response's output items, then its own `input`. `instructions`
  are not carried over (OpenAI's rule: send them again).
* `GET /v1/responses/{id}` gives the stored response, `GET /v1/responses/{id}/input_items`
  its input items (a list object, oldest first), `DELETE /v1/responses/{id}` removes it;
  an id not stored (never, expired or deleted) is a 404 there and a 400 as
  `previous_response_id`.

With storing off (TTL 0), a response says `"store": false` and `previous_response_id` is a
400, as in vLLM without its store. Conversations with `conversation` ids are not served;
`background` responses are (services/responses_background.py), on this store.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from services.router_fields import ApiError
from shared.keys import response_key

logger = logging.getLogger(__name__)

MAX_ID_LEN = 256
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}  # fmt: skip


class ResponseStore:
    def __init__(self, redis: Any, prefix: str, ttl_s: float) -> None:
        self.redis, self.prefix, self.ttl_s = redis, prefix, ttl_s

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    def keeps(self, store: bool | None) -> bool:
        """Whether a response whose request says `store` is stored."""
        return self.enabled and store is not False

    async def save(
        self, response: dict[str, Any], items: list[dict[str, Any]], owner: str | None = None,
        new: bool = False,
    ) -> bool:  # fmt: skip
        """Store `response` and its conversation's input `items`; `owner`: the router that
        generates it in the background (services/responses_background.py). With `new` (a
        response's first save), a response stored under its id already is kept: False."""
        record: dict[str, Any] = {"response": response, "input": items}
        if owner is not None:
            record["owner"] = owner
        raw = json.dumps(record, separators=(",", ":"))
        key = response_key(self.prefix, response["id"])
        saved = await self.redis.set(key, raw, px=self.ttl_ms, nx=new)
        if not saved:
            logger.warning("response %s not stored: a stored response has its id", response["id"])
        return bool(saved)

    async def check_new_id(self, response_id: str) -> None:
        """A 400 unless a response can be stored under `response_id`, a client's `rid`: at
        most MAX_ID_LEN characters and no stored response's (vLLM overwrites that one, and
        with it the conversation other requests continue)."""
        if len(response_id) > MAX_ID_LEN:
            raise ApiError(400, f"rid of a stored response must be at most {MAX_ID_LEN} "
                                f"characters, got {len(response_id)}", "rid",
                           "invalid_value")  # fmt: skip
        if await self.redis.exists(response_key(self.prefix, response_id)):
            raise duplicate_id(response_id)

    async def load(self, response_id: str) -> dict[str, Any] | None:
        """The stored record (`response`, `input`), or None."""
        if not response_id or len(response_id) > MAX_ID_LEN:
            return None
        raw = await self.redis.get(response_key(self.prefix, response_id))
        return None if raw is None else json.loads(raw)

    async def delete(self, response_id: str) -> bool:
        if not response_id or len(response_id) > MAX_ID_LEN:
            return False
        return bool(await self.redis.delete(response_key(self.prefix, response_id)))

    async def found(self, response_id: str) -> dict[str, Any]:
        """The stored record, or a 404 (for GET /v1/responses/{id})."""
        record = await self.load(response_id)
        if record is None:
            raise not_found(response_id)
        return record

    async def history(self, previous_id: str) -> list[dict[str, Any]]:
        """The conversation a request with `previous_response_id` continues: the stored
        input items, then the stored response's output items (400 if none is stored)."""
        record = await self.load(previous_id) if self.enabled else None
        if record is None:
            why = "" if self.enabled else " (this server stores no responses)"
            raise ApiError(400, f"previous response with id {previous_id!r} not found{why}",
                           "previous_response_id", "previous_response_not_found")  # fmt: skip
        return [*record["input"], *record["response"]["output"]]


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"no stored response has id {response_id!r}", "response_id", "not_found")


def duplicate_id(response_id: str) -> ApiError:
    return ApiError(400, f"a stored response has id {response_id!r} already (delete it, or "
                         "name this request otherwise)", "rid", "duplicate_rid")  # fmt: skip


def input_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` as items, each with a type and an id (what is stored)."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": given}]}]  # fmt: skip
    items = []
    for item in given:
        item = {"type": "message", **item} if "type" not in item else dict(item)
        if not item.get("id"):
            item["id"] = f"{_ITEM_PREFIX.get(item['type'], 'item')}_{uuid.uuid4().hex}"
        items.append(item)
    return items


def items_page(
    record: dict[str, Any], order: str = "desc", limit: int = 20, after: str | None = None
) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items`: the stored input items as a list object (the
    API's paging: newest first unless `order=asc`, `limit` 1-100, `after` an item id)."""
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be asc or desc, got {order!r}", "order",
                       "invalid_value")  # fmt: skip
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit must be between 1 and 100, got {limit}", "limit",
                       "invalid_value")  # fmt: skip
    items = record["input"] if order == "asc" else record["input"][::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, f"no input item has id {after!r}", "after", "invalid_value")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit}  # fmt: skip


def add_routes(app: Any, state: dict[str, Any]) -> None:
    """The Responses API's routes on the router's app (`state["router"]`: its `Router`)."""
    @app.post("/v1/responses")
    async def create(request: Request) -> Any:
        return await state["router"].responses(request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(
        response_id: str, request: Request, stream: bool = False,
        starting_after: int | None = None,
    ) -> Any:  # fmt: skip
        """The stored response; with `stream`, a background one's events (again), after the
        one numbered `starting_after` (services/responses_background.py)."""
        router = state["router"]
        router.authorize(request)
        if stream:
            events = await router.background.stream(response_id, starting_after)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        return (await router.background.found(response_id))["response"]

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> Any:
        router = state["router"]
        router.authorize(request)
        await router.background.check_deletable(response_id)
        if not await router.responses_store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request) -> Any:
        state["router"].authorize(request)
        return await state["router"].background.cancel(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(
        response_id: str, request: Request, order: str = "desc", limit: int = 20,
        after: str | None = None,
    ) -> Any:  # fmt: skip
        state["router"].authorize(request)
        record = await state["router"].responses_store.found(response_id)
        return items_page(record, order, limit, after)
