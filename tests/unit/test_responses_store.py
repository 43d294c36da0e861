"""The Responses API's store (services/responses_store.py) on a real Redis: expiry, the
conversation a previous response continues, the input items and their paging, refusals."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from services.responses_store import MAX_ID_LEN, ResponseStore, input_items, items_page
from services.router_fields import ApiError

pytest_plugins = ["tests.redis_fixtures"]


def _run(redis_url: str, work) -> object:  # noqa: ANN001
    async def main() -> object:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await work(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def _response(rid: str, text: str) -> dict:
    output = [{"type": "message", "id": "msg_out", "role": "assistant",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}]  # fmt: skip
    return {"id": rid, "object": "response", "output": output}


def test_a_response_expires_after_its_ttl(redis_url: str) -> None:
    async def work(client) -> tuple:  # noqa: ANN001
        store = ResponseStore(client, "st-ttl", ttl_s=0.3)
        await store.save(_response("resp_a", "hi"), items=input_items("hello"))
        kept = await store.load("resp_a")
        time.sleep(0.5)
        return kept, await store.load("resp_a"), await store.delete("resp_a")

    kept, expired, deleted = _run(redis_url, work)
    assert kept["response"]["id"] == "resp_a" and kept["input"][0]["role"] == "user"
    assert expired is None and deleted is False


def test_history_is_the_stored_input_then_the_output(redis_url: str) -> None:
    async def work(client) -> tuple:  # noqa: ANN001
        store = ResponseStore(client, "st-hist", ttl_s=60)
        items = input_items([{"role": "user", "content": "one"}])
        await store.save(_response("resp_1", "eno"), items=items)
        history = await store.history("resp_1")
        with pytest.raises(ApiError) as missing:
            await store.history("resp_nope")
        too_long = await store.load("r" * (MAX_ID_LEN + 1))
        return items, history, missing.value, too_long

    items, history, missing, too_long = _run(redis_url, work)
    assert history == [*items, *_response("resp_1", "eno")["output"]]
    assert (missing.status, missing.param) == (400, "previous_response_id")
    assert too_long is None


def test_a_first_save_keeps_a_stored_response_and_new_ids_are_checked(redis_url: str) -> None:
    async def work(client) -> tuple:  # noqa: ANN001
        store = ResponseStore(client, "st-new", ttl_s=60)
        first = await store.save(_response("mine", "one"), items=[], new=True)
        again = await store.save(_response("mine", "two"), items=[], new=True)
        kept = (await store.load("mine"))["response"]["output"][0]["content"][0]["text"]
        refusals = []
        for rid in ("mine", "r" * (MAX_ID_LEN + 1)):
            with pytest.raises(ApiError) as refused:
                await store.check_new_id(rid)
            refusals.append(refused.value)
        await store.check_new_id("free")  # no error
        overwritten = await store.save(_response("mine", "three"), items=[])  # (its own)
        return first, again, kept, refusals, overwritten

    first, again, kept, (taken, too_long), overwritten = _run(redis_url, work)
    assert (first, again, kept, overwritten) == (True, False, "one", True)
    assert (taken.status, taken.code, taken.param) == (400, "duplicate_rid", "rid")
    assert (too_long.status, too_long.param) == (400, "rid") and "256" in too_long.message


def test_a_store_that_is_off_refuses_previous_response_ids() -> None:
    store = ResponseStore(None, "off", ttl_s=0)  # never reaches Redis
    assert not store.enabled
    with pytest.raises(ApiError, match="stores no responses"):
        asyncio.run(store.history("resp_1"))


def test_input_items_get_types_and_ids() -> None:
    given = [{"role": "user", "content": "a"}, {"type": "message", "id": "msg_mine", "role":
             "user", "content": "b"}, {"type": "function_call_output", "call_id": "c",
             "output": "x"}]  # fmt: skip
    items = input_items(given)
    assert [i["type"] for i in items] == ["message", "message", "function_call_output"]
    assert items[0]["id"].startswith("msg_") and items[1]["id"] == "msg_mine"
    assert items[2]["id"].startswith("fco_")
    assert "id" not in given[0], "the request's own items are not changed"
    (text,) = input_items("hi")
    assert text["content"] == [{"type": "input_text", "text": "hi"}]


def test_items_page_orders_limits_and_continues() -> None:
    record = {"input": [{"id": f"i{k}"} for k in range(5)]}
    newest = items_page(record, limit=2)
    assert [i["id"] for i in newest["data"]] == ["i4", "i3"] and newest["has_more"]
    rest = items_page(record, after=newest["last_id"])
    assert [i["id"] for i in rest["data"]] == ["i2", "i1", "i0"] and not rest["has_more"]
    assert items_page(record, order="asc", limit=5)["data"] == record["input"]
    for kwargs, param in (({"order": "up"}, "order"), ({"limit": 0}, "limit"),
                          ({"after": "nope"}, "after")):  # fmt: skip
        with pytest.raises(ApiError) as err:
            items_page(record, **kwargs)
        assert (err.value.status, err.value.param) == (400, param)
