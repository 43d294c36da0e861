"""SGLang's `rid` and `POST /abort_request` on a real router process, with a fake back end.

An aborted request still gets its response: what was generated until the worker ended it,
with finish_reason `abort` (and a stream ends with its final chunk and [DONE]).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest

from tests.system.router_fakes import FakeWorker, start_router
from tests.system.test_router_api import running, sse_events, wait_for

pytest_plugins = ["tests.redis_fixtures"]
PREFIX = "rt-abort"
WHY = "aborted by /abort_request"
LONG = "abcdefghij" * 40  # 400 tokens at 20 ms each: far from done when the abort comes


@pytest.fixture(scope="module")
def base(redis_url: str) -> Iterator[str]:
    with start_router(redis_url, PREFIX) as url:
        yield url


@pytest.fixture
def slow(redis_url: str, base: str) -> Iterator[FakeWorker]:
    with running(FakeWorker(redis_url, PREFIX, f"w{uuid.uuid4().hex[:6]}", step_s=0.02), base) as w:
        yield w


def abort(base: str, **body: object) -> httpx.Response:
    return httpx.post(base + "/abort_request", json=body)


def test_abort_by_rid_ends_generate_with_what_it_made(slow: FakeWorker, base: str) -> None:
    body = {"text": LONG, "rid": "job-1", "sampling_params": {"max_new_tokens": 400}}
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, base + "/generate", json=body, timeout=30)
        wait_for(lambda: any(r.pos > 2 for r in list(slow.running.values())))
        resp = abort(base, rid="job-1")
        assert resp.status_code == 200 and resp.json() == {"success": True, "num_aborted": 1}
        out = future.result()
    assert out.status_code == 200
    meta = out.json()["meta_info"]
    assert meta["id"] == "job-1"
    assert meta["finish_reason"] == {"type": "abort", "message": WHY}
    text = out.json()["text"]
    assert 0 < len(text) < len(LONG) and LONG[::-1].startswith(text)
    assert meta["completion_tokens"] == len(text)
    assert slow.aborted == [slow.received[0].rid]  # the router's own rid went to the worker
    # the rid is free again once its request ended
    resp = httpx.post(base + "/generate", json={**body, "text": "ab"}, timeout=30)
    assert resp.json()["meta_info"]["id"] == "job-1" and resp.json()["text"] == "ba"


def abort_a_chat_stream(base: str, rid: str, abort_base: str | None = None) -> None:
    """A streamed chat request with n=2 named `rid`, sent to `base`, aborted mid-stream at
    `abort_base` (default: the same router): both choices end with finish_reason abort."""
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": LONG}],
        "max_tokens": 400,
        "n": 2,
        "stream": True,
        "rid": rid,
    }
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line)
        assert abort(abort_base or base, rid=rid).json()["num_aborted"] == 2
        events = sse_events([first, *lines])
    assert events[-1] == "[DONE]"
    assert {e["id"] for e in events[:-1]} == {rid}
    ends = {c["index"]: c["finish_reason"] for e in events[:-1] for c in e["choices"]}
    assert ends == {0: "abort", 1: "abort"}


def test_abort_by_rid_ends_a_chat_stream_and_n_choices(slow: FakeWorker, base: str) -> None:
    abort_a_chat_stream(base, "chat-7")
    assert sorted(slow.aborted) == sorted(m.rid for m in slow.received)


def test_abort_all_ends_every_request_of_the_router(slow: FakeWorker, base: str) -> None:
    bodies = [
        {"text": LONG, "sampling_params": {"max_new_tokens": 400}},
        {"text": LONG, "rid": "named", "sampling_params": {"max_new_tokens": 400}},
        {"text": [LONG, LONG], "sampling_params": {"max_new_tokens": 400}},
    ]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(httpx.post, base + "/generate", json=b, timeout=30) for b in bodies]
        wait_for(lambda: len(slow.running) == 4)
        assert abort(base, abort_all=True).json() == {"success": True, "num_aborted": 4}
        outs = [f.result().json() for f in futures]
    metas = [outs[0]["meta_info"], outs[1]["meta_info"], *(o["meta_info"] for o in outs[2])]
    assert all(m["finish_reason"] == {"type": "abort", "message": WHY} for m in metas)
    assert outs[1]["meta_info"]["id"] == "named"
    assert len(slow.aborted) == 4 and not slow.running


def test_rid_in_use_unknown_or_malformed_is_refused(slow: FakeWorker, base: str) -> None:
    body = {"text": LONG, "rid": "dup", "sampling_params": {"max_new_tokens": 400}}
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, base + "/generate", json=body, timeout=30)
        wait_for(lambda: slow.running)
        chat = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}]}
        resp = httpx.post(base + "/v1/chat/completions", json={**chat, "rid": "dup"})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "duplicate_rid"
        assert abort(base, rid="dup").status_code == 200
        assert future.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(slow.received) == 1  # the refused request never left the router
    resp = abort(base, rid="nobody")
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "rid"
    assert abort(base).status_code == 400
    assert abort(base, rid="").status_code == 400
    assert abort(base, abort_all="yes").status_code == 400
    for bad in (
        {"text": ["a", "b"], "rid": "one"},  # a batch needs one rid per prompt
        {"text": ["a", "b"], "rid": ["one"]},
        {"text": ["a", "b"], "rid": ["same", "same"]},
        {"text": "a", "rid": ["one"]},
        {"text": "a", "rid": 5},
    ):
        resp = httpx.post(base + "/generate", json=bad)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "rid", bad


def test_batch_rids_name_each_prompt(slow: FakeWorker, base: str) -> None:
    body = {"text": ["ab", LONG], "rid": ["p0", "p1"], "sampling_params": {"max_new_tokens": 400}}
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, base + "/generate", json=body, timeout=30)
        wait_for(lambda: len(slow.received) == 2 and len(slow.running) == 1)
        assert abort(base, rid="p1").json()["num_aborted"] == 1
        outs = future.result().json()
    assert abort(base, rid="p0").status_code == 404  # done already
    assert [o["meta_info"]["id"] for o in outs] == ["p0", "p1"]
    assert outs[0]["text"] == "ba" and outs[0]["meta_info"]["finish_reason"]["type"] == "stop"
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "abort"
