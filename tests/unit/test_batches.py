"""The Batch API's runner (services/batches.py) on a real Redis, each line answered by a fake
in-process call instead of the router's app: validation, the answers in input order, usage,
the concurrency bound, 503s sent again, expiry, a lost lease, and a second runner going on
from the answers the first stored. The HTTP side is tests/system/test_router_batches.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from services.batch_files import FileStore
from services.batch_lines import Answer, parse_input
from services.batch_run import BatchRunner
from services.router_fields import ApiError
from shared.keys import batch_key, batch_lease_key, batch_results_key, batches_running_key

pytest_plugins = ["tests.redis_fixtures"]
CHAT = "/v1/chat/completions"


def line(custom_id: str, content: str = "hi", url: str = CHAT, **extra: Any) -> str:
    body = {"messages": [{"role": "user", "content": content}], **extra}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def answer(status: int, body: dict[str, Any]) -> Answer:
    return Answer(status, {"x-request-id": "rid-" + str(body.get("n", ""))},
                  bytearray(json.dumps(body).encode()))  # fmt: skip


def echo(sleep_s: float = 0.0) -> Callable[[str, bytes], Awaitable[Answer]]:
    """A call that answers each chat request with its message, 2 prompt and 3 output tokens."""

    async def call(path: str, raw: bytes) -> Answer:
        body = json.loads(raw)
        await asyncio.sleep(sleep_s)
        content = body["messages"][0]["content"]
        if content == "refuse":
            return answer(400, {"error": {"message": "no", "type": "invalid_request_error"}})
        usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                 "prompt_tokens_details": {"cached_tokens": 1}}  # fmt: skip
        return answer(200, {"path": path, "echo": content, "usage": usage})

    return call


async def until(runner: BatchRunner, batch_id: str, *statuses: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while (batch := await runner.retrieve(batch_id))["status"] not in statuses:
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.02)
    return batch


def run(redis_url: str, test: Callable[[Any, FileStore], Awaitable[None]]) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        await client.flushdb()
        try:
            await test(client, FileStore(client, "bt", 0, 1 << 20))
        finally:
            await client.aclose()

    asyncio.run(main())


def runner(client: Any, files: FileStore, call: Any, router_id: str = "r1", **kw: Any):
    batches = BatchRunner(client, "bt", router_id, files, poll_s=0.02, **kw)
    batches.start(call)
    return batches


async def create(batches: BatchRunner, files: FileStore, lines: list[str]) -> dict[str, Any]:
    meta = await files.create("\n".join(lines).encode(), "in.jsonl", "batch")
    body = {"input_file_id": meta["id"], "endpoint": CHAT, "completion_window": "24h"}
    return await batches.create(json.dumps(body).encode())


async def answered(client: Any, batch_id: str, k: int, timeout_s: float = 10.0) -> int:
    """Wait until `k` answers of the batch are stored; how many are."""
    deadline = time.monotonic() + timeout_s
    while (n := await client.hlen(batch_results_key("bt", batch_id))) < k:
        assert time.monotonic() < deadline, n
        await asyncio.sleep(0.01)
    return n


async def started(client: Any, files: FileStore, n: int, k: int) -> tuple:
    """A runner sending the lines of an n-line batch, two at a time, `k` answered already."""
    batches = runner(client, files, echo(0.05), concurrency=2)
    batch = await create(batches, files, [line(f"id{i}", f"m{i}") for i in range(n)])
    await answered(client, batch["id"], k)
    return batches, batch


async def output(files: FileStore, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in (await files.content(file_id)).decode().splitlines()]


def test_parse_input_names_each_bad_line() -> None:
    good = line("a")
    text = "\n".join([good, "{not json", json.dumps([1]), line("a"), line("b", url="/v1/x"),
                      json.dumps({"custom_id": "c", "method": "GET", "url": CHAT, "body": {}}),
                      json.dumps({"custom_id": "d", "method": "POST", "url": CHAT, "body": 3}),
                      json.dumps({"method": "POST", "url": CHAT, "body": {}}), "", line("e")])
    lines, errors = parse_input(text.encode(), CHAT, 100)
    assert [x.custom_id for x in lines] == ["a", "e"]
    assert [(e["line"], e["code"], e["param"]) for e in errors] == [
        (2, "invalid_json_line", None), (3, "invalid_request", None),
        (4, "duplicate_custom_id", "custom_id"), (5, "mismatched_url", "url"),
        (6, "invalid_request", "method"), (7, "invalid_request", "body"),
        (8, "invalid_request", "custom_id"),
    ]  # fmt: skip
    assert parse_input(b"\n\n", CHAT, 100)[1][0]["code"] == "empty_file"
    assert parse_input(b"\xff", CHAT, 100)[1][0]["code"] == "invalid_json_line"
    many = "\n".join(line(str(i)) for i in range(4)).encode()
    assert parse_input(many, CHAT, 3)[1][0]["code"] == "too_many_requests"
    assert not parse_input(many, CHAT, 4)[1]


def test_a_batch_answers_every_line_in_order_with_usage(redis_url: str) -> None:
    async def test(client: Any, files: FileStore) -> None:
        batches = runner(client, files, echo(0.001))
        lines = [line(f"id{i}", f"m{i}") for i in range(30)]
        lines[7] = line("id7", "refuse")
        lines[9] = line("id9", "x", stream=True)
        batch = await create(batches, files, lines)
        assert batch["status"] == "validating" and batch["request_counts"]["total"] == 0
        done = await until(batches, batch["id"], "completed")
        assert done["request_counts"] == {"total": 30, "completed": 28, "failed": 2}
        assert done["usage"] == {"input_tokens": 56, "input_tokens_details": {"cached_tokens": 28},
                                 "output_tokens": 84, "output_tokens_details":
                                 {"reasoning_tokens": 0}, "total_tokens": 140}  # fmt: skip
        assert done["in_progress_at"] and done["finalizing_at"] and done["completed_at"]
        good = await output(files, done["output_file_id"])
        assert [x["custom_id"] for x in good] == [f"id{i}" for i in range(30) if i not in (7, 9)]
        assert [x["response"]["body"]["echo"] for x in good[:3]] == ["m0", "m1", "m2"]
        assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in good)
        assert good[0]["response"]["request_id"] == "rid-"
        assert good[0]["id"].startswith("batch_req_")
        bad = await output(files, done["error_file_id"])
        assert [(x["custom_id"], x["response"]["status_code"]) for x in bad] == [
            ("id7", 400), ("id9", 400)]  # fmt: skip
        assert bad[1]["response"]["body"]["error"]["param"] == "stream"
        meta = await files.meta(done["output_file_id"])
        assert meta["purpose"] == "batch_output" and meta["filename"].endswith("_output.jsonl")
        assert not await client.exists(batch_results_key("bt", batch["id"]))
        assert not await client.sismember(batches_running_key("bt"), batch["id"])
        await batches.stop()

    run(redis_url, test)


def test_validation_fails_the_batch_with_its_errors(redis_url: str) -> None:
    async def test(client: Any, files: FileStore) -> None:
        batches = runner(client, files, echo())
        batch = await create(batches, files, [line("a"), line("a")])
        failed = await until(batches, batch["id"], "failed")
        [error] = failed["errors"]["data"]
        assert error["code"] == "duplicate_custom_id" and error["line"] == 2
        assert failed["failed_at"] and failed["output_file_id"] is None
        await batches.stop()

    run(redis_url, test)


def test_requests_refused_at_creation(redis_url: str) -> None:
    async def test(client: Any, files: FileStore) -> None:
        batches = runner(client, files, echo())
        meta = await files.create(line("a").encode(), "in.jsonl", "batch")
        other = await files.create(line("a").encode(), "in.jsonl", "user_data")

        async def refused(status: int, param: str | None, **fields: Any) -> None:
            body = {"input_file_id": meta["id"], "endpoint": CHAT, "completion_window": "24h",
                    **fields}  # fmt: skip
            with pytest.raises(ApiError) as err:
                await batches.create(json.dumps(body).encode())
            assert (err.value.status, err.value.param) == (status, param), err.value.message

        await refused(400, "endpoint", endpoint="/v1/models")
        await refused(400, "completion_window", completion_window="1h")
        await refused(404, "file_id", input_file_id="file-nope")
        await refused(400, "input_file_id", input_file_id=other["id"])
        await refused(400, "metadata", metadata={str(i): "v" for i in range(17)})
        await refused(400, "output_expires_after.seconds",
                      output_expires_after={"anchor": "created_at", "seconds": 10})  # fmt: skip
        await refused(400, "colour", colour="red")
        with pytest.raises(ApiError) as err:
            await batches.retrieve("batch_nope")
        assert err.value.status == 404
        await batches.stop()

    run(redis_url, test)


def test_concurrency_is_bounded_and_503s_are_sent_again(redis_url: str) -> None:
    async def test(client: Any, files: FileStore) -> None:
        inflight, peak, calls = 0, 0, {}
        inner = echo(0.005)

        async def call(path: str, raw: bytes) -> Answer:
            nonlocal inflight, peak
            custom = json.loads(raw)["messages"][0]["content"]
            calls[custom] = calls.get(custom, 0) + 1
            inflight += 1
            peak = max(peak, inflight)
            try:
                if custom == "m3" and calls[custom] < 3:  # no live worker, twice
                    return answer(503, {"error": {"message": "no live worker"}})
                return await inner(path, raw)
            finally:
                inflight -= 1

        batches = runner(client, files, call, concurrency=4)
        batch = await create(batches, files, [line(f"id{i}", f"m{i}") for i in range(24)])
        done = await until(batches, batch["id"], "completed")
        assert done["request_counts"] == {"total": 24, "completed": 24, "failed": 0}
        assert peak == 4 and calls["m3"] == 3 and calls["m0"] == 1
        await batches.stop()

    run(redis_url, test)


def test_cancelled_lines_go_to_the_error_file(redis_url: str) -> None:
    async def test(client: Any, files: FileStore) -> None:
        batches, batch = await started(client, files, 40, 4)
        cancelling = await batches.cancel(batch["id"])
        assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"]
        done = await until(batches, batch["id"], "cancelled")
        counts = done["request_counts"]
        good = await output(files, done["output_file_id"])
        bad = await output(files, done["error_file_id"])
        assert 0 < counts["completed"] == len(good) < 40 and counts["failed"] == len(bad)
        assert counts["completed"] + counts["failed"] == 40
        assert sorted(x["custom_id"] for x in good + bad) == sorted(f"id{i}" for i in range(40))
        assert all(x["response"] is None and x["error"]["code"] == "batch_cancelled" for x in bad)
        with pytest.raises(ApiError, match="cancelled"):
            await batches.cancel(batch["id"])
        await batches.stop()

    run(redis_url, test)


def test_an_expired_batch_ends_expired(redis_url: str) -> None:
    async def test(client: Any, files: FileStore) -> None:
        batches, batch = await started(client, files, 20, 2)
        raw = json.loads(await client.get(batch_key("bt", batch["id"])))
        await batches.stop()  # (its expiry moved to the past while no router runs it)
        raw["expires_at"] = time.time() - 1
        await client.set(batch_key("bt", batch["id"]), json.dumps(raw))
        again = runner(client, files, echo(), router_id="r2")
        done = await until(again, batch["id"], "expired")
        bad = await output(files, done["error_file_id"])
        assert bad and all(x["error"]["code"] == "batch_expired" for x in bad)
        assert done["request_counts"]["completed"] + len(bad) == 20 and done["expired_at"]
        await again.stop()

    run(redis_url, test)


def test_a_second_runner_goes_on_from_the_stored_answers(redis_url: str) -> None:
    """One runner stops (its lease given back) half way; another takes the batch and sends
    only the lines not answered, so each custom_id is in the output once."""

    async def test(client: Any, files: FileStore) -> None:
        seen: list[str] = []
        inner = echo(0.02)

        async def call(path: str, raw: bytes) -> Answer:
            seen.append(json.loads(raw)["messages"][0]["content"])
            return await inner(path, raw)

        first = runner(client, files, call, concurrency=2)
        batch = await create(batches=first, files=files,
                             lines=[line(f"id{i}", f"m{i}") for i in range(30)])  # fmt: skip
        await answered(client, batch["id"], 6)
        await first.stop()
        assert not await client.exists(batch_lease_key("bt", batch["id"]))
        stored = await client.hlen(batch_results_key("bt", batch["id"]))
        assert 0 < stored < 30
        before = len(seen)
        second = runner(client, files, call, router_id="r2", concurrency=2)
        done = await until(second, batch["id"], "completed")
        good = await output(files, done["output_file_id"])
        assert [x["custom_id"] for x in good] == [f"id{i}" for i in range(30)]
        assert len(seen) - before <= 30 - stored + 2  # (at most the 2 in flight sent again)
        assert done["request_counts"]["completed"] == 30
        await second.stop()

    run(redis_url, test)


def test_a_runner_that_loses_its_lease_stops_sending(redis_url: str) -> None:
    async def test(client: Any, files: FileStore) -> None:
        calls: list[str] = []
        inner = echo(0.02)

        async def call(path: str, raw: bytes) -> Answer:
            calls.append(path)
            return await inner(path, raw)

        batches = runner(client, files, call, concurrency=2)
        batch = await create(batches, files, [line(f"id{i}", f"m{i}") for i in range(50)])
        await until(batches, batch["id"], "in_progress")
        await client.set(batch_lease_key("bt", batch["id"]), "someone-else", px=60_000)
        deadline = time.monotonic() + 10
        while batch["id"] in batches.tasks:  # (it notices at its next renewal)
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        sent = len(calls)
        await asyncio.sleep(0.2)
        assert len(calls) == sent < 50
        assert (await batches.retrieve(batch["id"]))["status"] == "in_progress"
        await batches.stop()

    run(redis_url, test)


def test_a_batch_priority_goes_to_generation_requests_that_name_none(redis_url: str) -> None:
    async def test(client: Any, files: FileStore) -> None:
        bodies: dict[str, dict] = {}
        inner = echo()

        async def call(path: str, raw: bytes) -> Answer:
            body = json.loads(raw)
            bodies[body["messages"][0]["content"]] = body
            return await inner(path, raw)

        batches = runner(client, files, call, priority=-3)
        batch = await create(batches, files, [line("a", "plain"), line("b", "own", priority=7)])
        await until(batches, batch["id"], "completed")
        assert bodies["plain"]["priority"] == -3 and bodies["own"]["priority"] == 7
        await batches.stop()
        bodies.clear()
        batches = runner(client, files, call)  # (none set: the bodies as they are)
        batch = await create(batches, files, [line("a", "plain")])
        await until(batches, batch["id"], "completed")
        assert "priority" not in bodies["plain"]
        await batches.stop()

    run(redis_url, test)
