"""Named requests across two real router processes sharing one Redis (fake back end): an
abort sent to either router ends the request on the one that took it, `abort_all` ends every
router's requests, a rid names one request in the whole deployment, and claims left by a
dead router (or by an earlier run of the same router) are taken over."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest
import redis

from shared.heartbeat import Heartbeat
from shared.keys import ROUTER_KIND, heartbeat_key, named_request_key
from shared.messages import ServiceStatusMsg
from tests.system.router_fakes import FakeWorker, start_router
from tests.system.test_router_abort import abort_a_chat_stream
from tests.system.test_router_api import router_workers, running, wait_for

pytest_plugins = ["tests.redis_fixtures"]
PREFIX = "rt-abort2"
WHY = "aborted by /abort_request"
LONG = "abcdefghij" * 40  # 400 tokens at 20 ms each: far from done when the abort comes
GEN = {"sampling_params": {"max_new_tokens": 400}}


@pytest.fixture(scope="module")
def routers(redis_url: str) -> Iterator[tuple[str, str]]:
    with start_router(redis_url, PREFIX) as one, \
            start_router(redis_url, PREFIX, "--router-id", "r2") as two:  # fmt: skip
        yield one, two


@pytest.fixture
def slow(redis_url: str, routers: tuple[str, str]) -> Iterator[FakeWorker]:
    one, two = routers
    worker_id = f"w{uuid.uuid4().hex[:6]}"
    with running(FakeWorker(redis_url, PREFIX, worker_id, step_s=0.02), one) as w:
        wait_for(lambda: worker_id in router_workers(two))
        yield w


@pytest.fixture
def db(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def abort(base: str, **body: object) -> httpx.Response:
    return httpx.post(base + "/abort_request", json=body, timeout=10)


def test_abort_sent_to_the_other_router_ends_the_request(
    slow: FakeWorker, routers: tuple[str, str], db: redis.Redis
) -> None:
    one, two = routers
    key = named_request_key(PREFIX, "job-1")
    with ThreadPoolExecutor(1) as pool:
        body = {"text": LONG, "rid": "job-1", **GEN}
        future = pool.submit(httpx.post, one + "/generate", json=body, timeout=30)
        wait_for(lambda: any(r.pos > 2 for r in list(slow.running.values())))
        assert db.get(key).decode().startswith("r1:")  # claimed by the router that took it
        resp = abort(two, rid="job-1")
        assert resp.status_code == 200 and resp.json() == {"success": True, "num_aborted": 1}
        out = future.result()
    meta = out.json()["meta_info"]
    assert meta["id"] == "job-1" and meta["finish_reason"] == {"type": "abort", "message": WHY}
    assert 0 < len(out.json()["text"]) < len(LONG)
    assert slow.aborted == [slow.received[0].rid]
    wait_for(lambda: db.get(key) is None)  # released when it ended
    assert abort(two, rid="job-1").status_code == 404
    assert abort(one, rid="job-1").status_code == 404


def test_abort_from_the_other_router_counts_every_choice_of_a_stream(
    slow: FakeWorker, routers: tuple[str, str]
) -> None:
    one, two = routers
    abort_a_chat_stream(two, "chat-9", abort_base=one)
    assert sorted(slow.aborted) == sorted(m.rid for m in slow.received)


def test_a_rid_names_one_request_in_the_whole_deployment(
    slow: FakeWorker, routers: tuple[str, str]
) -> None:
    one, two = routers
    with ThreadPoolExecutor(1) as pool:
        body = {"text": LONG, "rid": "dup", **GEN}
        future = pool.submit(httpx.post, one + "/generate", json=body, timeout=30)
        wait_for(lambda: slow.running)
        chat = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "rid": "dup"}
        resp = httpx.post(two + "/v1/chat/completions", json=chat, timeout=10)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "duplicate_rid"
        # a batch with the rid among others is refused whole, and claims none of them
        batch = {"text": ["ab", "cd"], "rid": ["fresh", "dup"], **GEN}
        resp = httpx.post(two + "/generate", json=batch, timeout=10)
        assert resp.status_code == 400 and "'dup'" in resp.json()["error"]["message"]
        resp = httpx.post(one + "/generate", json={**batch, "rid": ["fresh", "b"]}, timeout=30)
        assert resp.status_code == 200
        assert abort(two, rid="dup").json()["num_aborted"] == 1
        assert future.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(slow.received) == 3  # the refused requests never left their routers
    resp = httpx.post(two + "/generate", json={"text": "ab", "rid": "dup", **GEN}, timeout=30)
    assert resp.status_code == 200 and resp.json()["meta_info"]["id"] == "dup"


def test_abort_all_ends_the_requests_of_every_router(
    slow: FakeWorker, routers: tuple[str, str]
) -> None:
    one, two = routers
    sends = [
        (one, {"text": LONG, **GEN}),
        (one, {"text": LONG, "rid": "on-one", **GEN}),
        (two, {"text": [LONG, LONG], **GEN}),
    ]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(httpx.post, b + "/generate", json=j, timeout=30) for b, j in sends]
        wait_for(lambda: len(slow.running) == 4)
        assert abort(two, abort_all=True).json() == {"success": True, "num_aborted": 4}
        outs = [f.result().json() for f in futures]
    metas = [outs[0]["meta_info"], outs[1]["meta_info"], *(o["meta_info"] for o in outs[2])]
    assert all(m["finish_reason"] == {"type": "abort", "message": WHY} for m in metas)
    assert len(slow.aborted) == 4 and not slow.running
    assert abort(one, abort_all=True).json() == {"success": True, "num_aborted": 0}


def test_claims_of_dead_or_earlier_routers_are_taken_over(
    slow: FakeWorker, routers: tuple[str, str], db: redis.Redis
) -> None:
    one, two = routers
    db.set(named_request_key(PREFIX, "ghost"), "gone-router:tok", px=60_000)  # no heartbeat
    db.set(named_request_key(PREFIX, "mine"), "r1:old-run", px=60_000)  # r1 before a restart
    assert abort(two, rid="ghost").status_code == 404  # its router died with its requests
    for rid in ("ghost", "mine"):
        resp = httpx.post(one + "/generate", json={"text": "ab", "rid": rid, **GEN}, timeout=30)
        assert resp.status_code == 200 and resp.json()["meta_info"]["id"] == rid
        assert db.get(named_request_key(PREFIX, rid)) is None


def test_a_live_holder_that_does_not_answer_is_a_503(
    slow: FakeWorker, routers: tuple[str, str], db: redis.Redis
) -> None:
    one, _ = routers
    beat = ServiceStatusMsg("router", "mute", "host", 1, time.time(), time.time())
    mute = Heartbeat(db, heartbeat_key(PREFIX, ROUTER_KIND, "mute"), 30, lambda: beat)
    mute.beat()  # a live router that reads nothing
    db.set(named_request_key(PREFIX, "held"), "mute:tok", px=30_000)
    try:
        resp = httpx.post(one + "/generate", json={"text": "ab", "rid": "held", **GEN}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "duplicate_rid"
        start = time.monotonic()
        resp = abort(one, rid="held")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "router_unavailable"
        assert time.monotonic() - start < 5
        # abort_all still answers (after 2 s), counting what the routers that answered ended
        start = time.monotonic()
        assert abort(one, abort_all=True).json() == {"success": True, "num_aborted": 0}
        assert 1.5 < time.monotonic() - start < 5
    finally:
        mute.stop()
        db.delete(named_request_key(PREFIX, "held"))
