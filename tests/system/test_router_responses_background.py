"""Background responses (`background: true`) on two real router processes sharing one Redis,
with the fake back end (its output is the last message reversed, one character per token):
queued, then polled, streamed again and resumed, and cancelled, each from the other router;
the refusals; a failed one; a router that stops, or is killed, while it generates one."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest

from shared.messages import TokenizeReqMsg
from tests.system.router_fakes import ROUTER_PROCS, FakeWorker, Plan, default_plan, start_router
from tests.system.test_router_api import router_workers, running, wait_for

pytest_plugins = ["tests.redis_fixtures"]
PREFIX = "rt-bg"
LONG = "".join(chr(ord("a") + i % 26) for i in range(150))  # 150 tokens: ~3 s at 20 ms a step


def _plan(msg: TokenizeReqMsg) -> Plan:
    if msg.messages and msg.messages[-1].content == "fail please":
        return Plan(error=(400, "invalid_value", "the fake refuses this prompt"))
    return default_plan(msg)


@pytest.fixture(scope="module")
def routers(redis_url: str) -> Iterator[tuple[str, str]]:
    with start_router(redis_url, PREFIX) as one, \
            start_router(redis_url, PREFIX, "--router-id", "r2") as two:  # fmt: skip
        fake = FakeWorker(redis_url, PREFIX, "w-bg", plan=_plan, step_s=0.02)
        with running(fake, one):
            wait_for(lambda: "w-bg" in router_workers(two))
            yield one, two


def post(base: str, **body: object) -> httpx.Response:
    payload = {"model": "fake-model", "max_output_tokens": 500, **body}
    return httpx.post(base + "/v1/responses", json=payload, timeout=30)


def get(base: str, response_id: str) -> dict:
    resp = httpx.get(f"{base}/v1/responses/{response_id}", timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def until(base: str, response_id: str, *statuses: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (body := get(base, response_id))["status"] not in statuses:
        assert time.monotonic() < deadline, body
        time.sleep(0.05)
    return body


def read_events(resp: httpx.Response, stop_after: int | None = None) -> list[dict]:
    """The SSE events of `resp` (all, or the first `stop_after`)."""
    out, kind = [], None
    for line in resp.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            out.append(json.loads(line[6:]))
            assert out[-1]["type"] == kind
            if stop_after is not None and len(out) == stop_after:
                break
    return out


def stream_again(base: str, response_id: str, starting_after: int | None = None) -> list[dict]:
    params = {"stream": "true"}
    if starting_after is not None:
        params["starting_after"] = str(starting_after)
    url = f"{base}/v1/responses/{response_id}"
    with httpx.stream("GET", url, params=params, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        return read_events(resp)


def text_of(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def test_queued_then_completed_and_streamed_again_on_the_other_router(routers) -> None:
    one, two = routers
    resp = post(one, input="hello background", metadata={"k": "v"}, background=True)
    assert resp.status_code == 200, resp.text
    queued = resp.json()
    assert (queued["status"], queued["background"], queued["store"]) == ("queued", True, True)
    assert queued["output"] == [] and queued["metadata"] == {"k": "v"}
    done = until(two, queued["id"], "completed")
    assert done["background"] and done["output"][0]["content"][0]["text"] == "dnuorgkcab olleh"
    assert done["usage"]["output_tokens"] == len("hello background")
    events = stream_again(two, queued["id"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert events[-1]["response"] == done and text_of(events) == "dnuorgkcab olleh"
    assert stream_again(one, queued["id"], starting_after=4) == events[5:]
    assert stream_again(one, queued["id"], starting_after=len(events)) == []


def test_a_stream_from_the_post_resumed_on_the_other_router(routers) -> None:
    """The client drops the POST's stream; the response goes on; it resumes elsewhere."""
    one, two = routers
    payload = {"model": "fake-model", "input": LONG, "max_output_tokens": 500,
               "background": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", one + "/v1/responses", json=payload, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        first = read_events(resp, stop_after=8)
    rest = stream_again(two, first[0]["response"]["id"], first[-1]["sequence_number"])
    events = first + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed" and text_of(events) == LONG[::-1]


def test_cancel_on_the_other_router(routers) -> None:
    one, two = routers
    queued = post(one, input=LONG, background=True).json()
    until(two, queued["id"], "in_progress")
    resp = httpx.post(f"{two}/v1/responses/{queued['id']}/cancel", timeout=30)
    assert resp.status_code == 200, resp.text
    cancelled = resp.json()
    assert cancelled["status"] == "cancelled"
    text = cancelled["output"][0]["content"][0]["text"]
    assert 0 < len(text) < len(LONG) and LONG[::-1].startswith(text)  # stopped part way
    assert get(one, queued["id"]) == cancelled
    events = stream_again(one, queued["id"])
    assert events[-1]["type"] == "response.cancelled" and text_of(events) == text
    again = httpx.post(f"{one}/v1/responses/{queued['id']}/cancel", timeout=30)
    assert again.status_code == 400 and "already cancelled" in again.json()["error"]["message"]


def test_refusals(routers) -> None:
    one, two = routers
    resp = post(one, input="x", background=True, store=False)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "background"
    sync = post(one, input="sync")
    assert sync.status_code == 200 and sync.json()["background"] is False
    sync_id = sync.json()["id"]
    resp = httpx.post(f"{two}/v1/responses/{sync_id}/cancel", timeout=10)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "Cannot cancel a synchronous response."
    resp = httpx.get(f"{two}/v1/responses/{sync_id}", params={"stream": "true"}, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream"
    for method, path in [("POST", "/cancel"), ("GET", "?stream=true")]:
        resp = httpx.request(method, f"{two}/v1/responses/resp_never{path}", timeout=10)
        assert resp.status_code == 404, (method, resp.text)
    running_id = post(one, input=LONG, background=True).json()["id"]
    resp = httpx.delete(f"{two}/v1/responses/{running_id}", timeout=10)
    assert resp.status_code == 400 and "cancel it first" in resp.json()["error"]["message"]
    until(two, running_id, "completed")
    assert httpx.delete(f"{two}/v1/responses/{running_id}", timeout=10).status_code == 200


def test_a_failed_background_response(routers) -> None:
    one, two = routers
    queued = post(one, input="fail please", background=True).json()
    failed = until(two, queued["id"], "failed")
    assert failed["error"] == {"code": "invalid_value", "message": "the fake refuses this prompt"}
    events = stream_again(two, queued["id"])
    assert [e["type"] for e in events] == ["response.failed"]


def test_a_router_that_stops_marks_its_responses_failed(redis_url: str, routers) -> None:
    one, _ = routers
    with start_router(redis_url, PREFIX, "--router-id", "r3") as three:
        wait_for(lambda: "w-bg" in router_workers(three))
        queued = post(three, input=LONG, background=True).json()
        until(one, queued["id"], "in_progress")
        time.sleep(0.3)  # ~15 tokens
    failed = get(one, queued["id"])
    assert failed["status"] == "failed" and "router stopped" in failed["error"]["message"]
    [item] = failed["output"]  # what was generated is kept
    text = item["content"][0]["text"]
    assert item["status"] == "incomplete" and text and LONG[::-1].startswith(text)


def first_events(base: str, response_id: str, n: int) -> list[dict]:
    """The first `n` events of a running response, once they are stored."""
    url = f"{base}/v1/responses/{response_id}"
    with httpx.stream("GET", url, params={"stream": "true"}, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        return read_events(resp, stop_after=n)


def test_a_killed_routers_responses_fail_where_they_are_read(redis_url: str, routers) -> None:
    """Killed, a router marks nothing: a new run of it fails its running responses at once
    (it generates none of them), the other routers once its heartbeat is gone."""
    one, two = routers
    ids = {}
    for router_id, ttl in (("r4", "5"), ("r3", "1")):
        with start_router(redis_url, PREFIX, "--router-id", router_id,
                          "--heartbeat-ttl-s", ttl) as base:  # fmt: skip
            wait_for(lambda b=base: "w-bg" in router_workers(b))
            ids[router_id] = post(base, input=LONG, background=True).json()["id"]
            until(one, ids[router_id], "in_progress")
            first_events(one, ids[router_id], 6)  # (two deltas are in Redis: not lost)
            ROUTER_PROCS[base].kill()
            ROUTER_PROCS[base].wait()
        if router_id == "r4":
            assert get(two, ids["r4"])["status"] == "in_progress"  # its heartbeat lives 5 s
            with start_router(redis_url, PREFIX, "--router-id", "r4") as again:
                failed = get(again, ids["r4"])
            assert failed["status"] == "failed", failed
            message = "router r4, which was generating the response, stopped"
            assert failed["error"] == {"code": "server_error", "message": message}
    failed = until(two, ids["r3"], "failed", timeout_s=10)
    assert "router r3" in failed["error"]["message"]
    for response_id in ids.values():
        assert get(one, response_id)["status"] == "failed"
        events = stream_again(one, response_id)  # they end, with no gap in their numbers
        assert events[-1]["type"] == "response.failed" and events[-1]["response"]["error"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert len(events) > 3  # (what the router sent before it was killed)
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        (item,) = events[-1]["response"]["output"]  # what was generated, from the events
        assert item["status"] == "incomplete" and item["content"][0]["text"] == deltas
        assert get(two, response_id)["output"] == [item]
        resp = httpx.post(f"{two}/v1/responses/{response_id}/cancel", timeout=10)
        assert resp.status_code == 400  # ended
