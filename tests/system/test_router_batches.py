"""The Batch API (`/v1/files`, `/v1/batches`) on real router processes sharing one Redis, with
the fake back end (its output is the last message reversed, one character per token): a
round trip with the openai client whose answers are the HTTP API's, polled on the other
router; the refusals; a cancel on the other router that aborts the requests at the worker; a
batch waiting for a worker; a router with an API key; a router that dies or stops half way,
its batch finished by the other."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import openai
import pytest

from shared.messages import TokenizeReqMsg
from tests.system.router_fakes import ROUTER_PROCS, FakeWorker, Plan, default_plan, start_router
from tests.system.test_router_api import router_workers, running, wait_for

pytest_plugins = ["tests.redis_fixtures"]
PREFIX = "rt-batch"
CHAT = "/v1/chat/completions"


def _plan(msg: TokenizeReqMsg) -> Plan:
    if msg.messages and msg.messages[-1].content == "fail please":
        return Plan(error=(400, "invalid_value", "the fake refuses this prompt"))
    return default_plan(msg)


@pytest.fixture(scope="module")
def routers(redis_url: str) -> Iterator[tuple[str, str, FakeWorker]]:
    with start_router(redis_url, PREFIX) as one, \
            start_router(redis_url, PREFIX, "--router-id", "r2", "--files-max-bytes",
                         "4096", "--batch-priority", "-1") as two:  # fmt: skip
        fake = FakeWorker(redis_url, PREFIX, "w-batch", plan=_plan, step_s=0.02)
        with running(fake, one):
            wait_for(lambda: "w-batch" in router_workers(two))
            yield one, two, fake


def chat_line(custom_id: str, content: str, max_tokens: int = 8, **extra: Any) -> dict:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, **extra}  # fmt: skip
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def upload(base: str, lines: list[dict], purpose: str = "batch") -> dict:
    content = "\n".join(json.dumps(x) for x in lines).encode()
    resp = httpx.post(base + "/v1/files", files={"file": ("in.jsonl", content)},
                      data={"purpose": purpose}, timeout=10)  # fmt: skip
    assert resp.status_code == 200, resp.text
    return resp.json()


def create(base: str, lines: list[dict], endpoint: str = CHAT, **headers: str) -> dict:
    file_id = upload(base, lines)["id"]
    body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"}
    resp = httpx.post(base + "/v1/batches", json=body, headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def get(base: str, batch_id: str, **headers: str) -> dict:
    resp = httpx.get(f"{base}/v1/batches/{batch_id}", headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def until(base: str, batch_id: str, *statuses: str, timeout_s: float = 30.0, **headers: str):
    deadline = time.monotonic() + timeout_s
    while (batch := get(base, batch_id, **headers))["status"] not in statuses:
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    return batch


def lines_of(base: str, file_id: str | None, **headers: str) -> list[dict]:
    if file_id is None:
        return []
    resp = httpx.get(f"{base}/v1/files/{file_id}/content", headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    return [json.loads(x) for x in resp.text.splitlines()]


def test_a_round_trip_with_the_openai_client(routers) -> None:
    one, two, _ = routers
    client = openai.OpenAI(base_url=one + "/v1", api_key="unused")
    lines = [chat_line(f"q{i}", f"question {i}") for i in range(12)]
    lines[5] = chat_line("q5", "fail please")
    content = "\n".join(json.dumps(x) for x in lines).encode()
    uploaded = client.files.create(file=("questions.jsonl", io.BytesIO(content)), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == ("batch", len(content),
                                                                     "questions.jsonl")
    assert client.files.content(uploaded.id).content == content
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = until(two, batch.id, "completed")  # polled on the other router
    assert done["request_counts"] == {"total": 12, "completed": 11, "failed": 1}
    answers = lines_of(two, done["output_file_id"])
    assert [x["custom_id"] for x in answers] == [f"q{i}" for i in range(12) if i != 5]
    for line, out in zip([x for x in lines if x["custom_id"] != "q5"], answers, strict=True):
        direct = httpx.post(one + CHAT, json=line["body"], timeout=10).json()
        assert out["response"]["status_code"] == 200 and out["error"] is None
        body = out["response"]["body"]
        assert body["choices"] == direct["choices"] and body["usage"] == direct["usage"]
        assert out["response"]["request_id"] == body["id"].removeprefix("chatcmpl-")
    assert done["usage"]["output_tokens"] == sum(
        x["response"]["body"]["usage"]["completion_tokens"] for x in answers)  # fmt: skip
    [failed] = lines_of(one, done["error_file_id"])
    assert failed["custom_id"] == "q5" and failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"]["message"] == "the fake refuses this prompt"
    listed = client.batches.list(limit=5)
    assert listed.data[0].id == batch.id and listed.data[0].status == "completed"
    outputs = {f.id for f in client.files.list(purpose="batch_output").data}
    assert {done["output_file_id"], done["error_file_id"]} <= outputs
    assert client.files.delete(done["error_file_id"]).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(done["error_file_id"])


def test_completions_in_a_batch(routers) -> None:
    one, _, _ = routers
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "fake-model", "prompt": f"abc{i}", "max_tokens": 4}}
             for i in range(3)]  # fmt: skip
    done = until(one, create(one, lines, "/v1/completions")["id"], "completed")
    texts = [x["response"]["body"]["choices"][0]["text"] for x in lines_of(one,
                                                                           done["output_file_id"])]
    assert texts == ["0cba", "1cba", "2cba"]


def test_a_routers_batch_priority_reaches_the_worker(routers) -> None:
    _, two, fake = routers
    lines = [chat_line("p0", "prioritised"), chat_line("p1", "own priority", priority=5)]
    until(two, create(two, lines)["id"], "completed")
    got = {m.messages[-1].content: m.priority for m in fake.received if m.messages}
    assert got["prioritised"] == -1 and got["own priority"] == 5


def test_refusals(routers) -> None:
    one, two, _ = routers
    small = [chat_line("a", "x")]
    cases = [
        (httpx.post(one + "/v1/files", content=b"{}", timeout=5), 400, None),
        (httpx.post(one + "/v1/files", files={"file": ("a.jsonl", b"{}")}, timeout=5), 400,
         "purpose"),
        (httpx.post(one + "/v1/files", data={"purpose": "batch"}, files={"x": ("a", b"1")},
                    timeout=5), 400, "file"),
        (httpx.post(one + "/v1/files", files={"file": ("a.jsonl", b"{}")},
                    data={"purpose": "homework"}, timeout=5), 400, "purpose"),
        (httpx.post(one + "/v1/files", files={"file": ("a.jsonl", b"{}")},
                    data={"purpose": "batch", "expires_after[anchor]": "created_at",
                          "expires_after[seconds]": "60"}, timeout=5), 400,
         "expires_after.seconds"),
        (httpx.post(two + "/v1/files", files={"file": ("a.jsonl", b"x" * 5000)},
                    data={"purpose": "batch"}, timeout=5), 413, "file"),
        (httpx.get(one + "/v1/files/file-nope", timeout=5), 404, "file_id"),
        (httpx.get(one + "/v1/files/file-nope/content", timeout=5), 404, "file_id"),
        (httpx.delete(one + "/v1/files/file-nope", timeout=5), 404, "file_id"),
        (httpx.get(one + "/v1/files", params={"order": "up"}, timeout=5), 400, "order"),
        (httpx.post(one + "/v1/batches", content=b"{", timeout=5), 400, None),
        (httpx.post(one + "/v1/batches", json={"input_file_id": upload(one, small)["id"],
                    "endpoint": "/generate", "completion_window": "24h"}, timeout=5), 400,
         "endpoint"),
        (httpx.get(one + "/v1/batches/batch_nope", timeout=5), 404, "batch_id"),
        (httpx.post(one + "/v1/batches/batch_nope/cancel", timeout=5), 404, "batch_id"),
        (httpx.get(one + "/v1/batches", params={"limit": 0}, timeout=5), 400, "limit"),
        (httpx.get(one + "/v1/batches", params={"limit": "many"}, timeout=5), 400, "limit"),
        (httpx.get(one + "/v1/files", params={"limit": "1.5"}, timeout=5), 400, "limit"),
    ]  # fmt: skip
    for resp, status, param in cases:
        assert resp.status_code == status, (resp.request.url, resp.text)
        assert resp.json()["error"]["param"] == param, resp.text
    meta = upload(one, small, purpose="user_data")
    body = {"input_file_id": meta["id"], "endpoint": CHAT, "completion_window": "24h"}
    resp = httpx.post(two + "/v1/batches", json=body, timeout=5)
    assert resp.status_code == 400 and "purpose 'user_data'" in resp.json()["error"]["message"]
    failed = until(one, create(one, [chat_line("a", "x"), {"custom_id": "b"}])["id"], "failed")
    [error] = failed["errors"]["data"]
    assert error["line"] == 2 and error["param"] == "method"


def test_cancel_on_the_other_router_aborts_the_requests(routers) -> None:
    one, two, fake = routers
    long = "".join(chr(ord("a") + i % 26) for i in range(150))  # ~3 s at 20 ms a token
    lines = [chat_line(f"l{i}", long + str(i), max_tokens=200) for i in range(4)]
    batch = create(one, lines)
    until(two, batch["id"], "in_progress")
    wait_for(lambda: len(fake.running) >= 4)
    resp = httpx.delete(f"{two}/v1/files/{batch['input_file_id']}", timeout=5)
    assert resp.status_code == 400 and "has not ended" in resp.json()["error"]["message"]
    aborted_before = len(fake.aborted)
    cancelling = httpx.post(f"{two}/v1/batches/{batch['id']}/cancel", timeout=5).json()
    assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"]
    done = until(two, batch["id"], "cancelled", timeout_s=10)
    assert done["cancelled_at"] and done["output_file_id"] is None
    assert done["request_counts"] == {"total": 4, "completed": 0, "failed": 4}
    errors = lines_of(one, done["error_file_id"])
    assert sorted(x["custom_id"] for x in errors) == ["l0", "l1", "l2", "l3"]
    assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
    wait_for(lambda: len(fake.aborted) >= aborted_before + 4)  # aborted at the worker
    resp = httpx.post(f"{one}/v1/batches/{batch['id']}/cancel", timeout=5)
    assert resp.status_code == 400 and "cancelled" in resp.json()["error"]["message"]
    assert httpx.delete(f"{two}/v1/files/{batch['input_file_id']}", timeout=5).status_code == 200


def test_a_batch_waits_for_a_worker_behind_an_api_key(redis_url: str) -> None:
    """No worker at first: the lines' 503s are sent again until one comes. The router's own
    calls carry its API key."""
    prefix, key = "rt-batch-key", {"Authorization": "Bearer k3y"}
    with start_router(redis_url, prefix, "--api-key", "k3y") as base:
        denied = httpx.post(base + "/v1/files", files={"file": ("a", b"{}")},
                            data={"purpose": "batch"}, timeout=5)  # fmt: skip
        assert denied.status_code == 401
        content = json.dumps(chat_line("only", "hello")).encode()
        meta = httpx.post(base + "/v1/files", files={"file": ("in.jsonl", content)},
                          data={"purpose": "batch"}, headers=key, timeout=5).json()  # fmt: skip
        body = {"input_file_id": meta["id"], "endpoint": CHAT, "completion_window": "24h"}
        batch = httpx.post(base + "/v1/batches", json=body, headers=key, timeout=5).json()
        until(base, batch["id"], "in_progress", **key)
        time.sleep(1.5)  # a 503 or two
        assert get(base, batch["id"], **key)["status"] == "in_progress"
        with running(FakeWorker(redis_url, prefix, "w-late"), base):
            done = until(base, batch["id"], "completed", **key)
        [out] = lines_of(base, done["output_file_id"], **key)
        assert out["response"]["body"]["choices"][0]["message"]["content"] == "olleh"


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_the_other_router_finishes_a_batch(redis_url: str, routers, how: str) -> None:
    """A router killed half way leaves its batch when its 1 s lease lapses, one stopped gives
    it back at once (its lease is 10 s); the other router sends only what was not answered."""
    one, _, fake = routers
    lease = {"killed": "1", "stopped": "10"}[how]
    lines = [chat_line(f"k{i}", f"{how} line {i}", max_tokens=20) for i in range(12)]
    with start_router(redis_url, PREFIX, "--router-id", "r3", "--batch-concurrency", "2",
                      env={"SLUICE_BATCH_LEASE_S": lease}) as three:  # fmt: skip
        wait_for(lambda: "w-batch" in router_workers(three))
        batch = create(three, lines)
        wait_for(lambda: get(one, batch["id"])["request_counts"]["completed"] >= 2)
        if how == "killed":
            ROUTER_PROCS[three].kill()
            ROUTER_PROCS[three].wait()
        stopped_at = time.monotonic()
    done = until(one, batch["id"], "completed")
    taken_s = time.monotonic() - stopped_at
    answers = lines_of(one, done["output_file_id"])
    assert [x["custom_id"] for x in answers] == [f"k{i}" for i in range(12)]
    texts = [x["response"]["body"]["choices"][0]["message"]["content"] for x in answers]
    assert texts == [f"{how} line {i}"[::-1] for i in range(12)]
    assert done["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    sent = [m for m in fake.received if m.messages and m.messages[-1].content.startswith(how)]
    assert 12 <= len(sent) <= 14  # at most the 2 in flight when r3 went were sent again
    if how == "stopped":
        assert taken_s < 8, taken_s  # well inside the 10 s lease: it was given back
