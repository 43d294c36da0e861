"""A real router process against a real Redis, with a fake back end writing its stream.

The fake (`router_fakes.FakeWorker`) answers each request with its prompt reversed, one
character per token, and can deliver rows out of order and twice, stay silent, or fail a
request with an `ErrorMsg`, so every router behaviour is checked without a model.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest
import redis

from shared.keys import router_out_stream
from shared.messages import TokenizeReqMsg
from tests.system.router_fakes import (
    CONTEXT_LEN,
    FakeWorker,
    Plan,
    default_plan,
    metric,
    start_router,
)

pytest_plugins = ["tests.redis_fixtures"]
PREFIX = "rt"


@pytest.fixture(scope="module")
def base(redis_url: str) -> Iterator[str]:
    with start_router(redis_url, PREFIX, "--health-generate-timeout-s", "2") as url:
        yield url


@pytest.fixture
def worker(redis_url: str, base: str) -> Iterator[FakeWorker]:
    """A fake worker with a fresh id, out-of-order and repeated delivery on."""
    with running(
        FakeWorker(redis_url, PREFIX, f"w{uuid.uuid4().hex[:6]}", shuffle=True, duplicate=True),
        base,
    ) as w:
        yield w


class running:
    """Start fake workers and wait until the router sees them; stop them and wait it doesn't."""

    def __init__(self, *workers_and_base: object) -> None:
        *self.workers, self.base = workers_and_base
        self.ids = {w.worker_id for w in self.workers}

    def __enter__(self):  # noqa: ANN204
        for w in self.workers:
            w.start()
        wait_for(lambda: self.ids <= router_workers(self.base))
        return self.workers[0]

    def __exit__(self, *exc: object) -> None:
        for w in self.workers:
            w.stop()
        wait_for(lambda: not self.ids & router_workers(self.base))


def router_workers(base: str) -> set[str]:
    text = httpx.get(base + "/metrics").text
    return {
        line.split('worker_id="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("sluice:num_running_reqs{")
    }


def sse_events(lines: Iterator[str]) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def post_stream(base: str, path: str, body: dict) -> list:
    with httpx.stream("POST", base + path, json=body, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        return sse_events(resp.iter_lines())


def completion_text(events: list) -> str:
    assert events[-1] == "[DONE]"
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])


PROMPT = "héllo wörld, 你好 🙂 and more text"


def test_health_follows_the_heartbeats_of_every_kind(redis_url: str, base: str) -> None:
    resp = httpx.get(base + "/health")
    assert resp.status_code == 503
    assert resp.json()["status"] == "no live worker, tokenizer, detokenizer"
    with running(FakeWorker(redis_url, PREFIX, "w-health"), base) as fake:
        resp = httpx.get(base + "/health")
        assert resp.status_code == 200 and resp.json() == {
            "status": "ok", "workers": ["w-health"], "tokenizers": ["w-health"],
            "detokenizers": ["w-health"]}  # fmt: skip
        assert httpx.get(base + "/ping").json() == resp.json()  # vLLM's name
        assert httpx.post(base + "/ping").status_code == 200
        fake.role_beats[1].stop()  # the only detokenizer goes
        resp = httpx.get(base + "/health")
        assert resp.status_code == 503 and resp.json()["status"] == "no live detokenizer"
        assert httpx.get(base + "/ping").status_code == 503
    assert httpx.get(base + "/health").status_code == 503


def test_server_info_has_the_settings_and_each_workers_capacity(
    redis_url: str, base: str
) -> None:
    with running(FakeWorker(redis_url, PREFIX, "w-info"), base):
        info = httpx.get(base + "/get_server_info").json()
    assert info["prefix"] == PREFIX and info["router_id"] == "r1"
    assert info["health_generate_timeout_s"] == 2 and info["api_key_required"] is False
    assert info["redis_url"] == redis_url and info["version"]
    (state,) = [s for s in info["internal_states"] if s["worker_id"] == "w-info"]
    assert state["context_len"] == CONTEXT_LEN and state["max_total_num_tokens"] == 10_000
    # (under SGLang's names too, as its benchmarks read them)
    assert state["avg_spec_accept_length"] == state["spec_accept_length"] == 2.25
    assert state["last_gen_throughput"] == state["gen_throughput"] == 123.5


def test_health_generate_runs_one_token_through_the_pipeline(redis_url: str, base: str) -> None:
    """200 once a token came back; 503 with no worker, or (after the router's 2 s timeout)
    with a worker that never answers, whose request is then aborted; never in the metrics."""
    resp = httpx.get(base + "/health_generate", timeout=30)
    assert resp.status_code == 503 and "no live worker" in resp.json()["message"]
    requests = metric(base, "sluice:num_requests_total")
    aborted = metric(base, "sluice:num_aborted_requests_total")
    with running(FakeWorker(redis_url, PREFIX, "w-hg"), base) as fake:
        resp = httpx.get(base + "/health_generate", timeout=30)
        assert resp.status_code == 200 and resp.json()["status"] == "ok"
        (msg,) = fake.received
        assert msg.sampling_params["max_new_tokens"] == 1
    with running(FakeWorker(redis_url, PREFIX, "w-hg-silent", silent=True), base) as silent:
        t0 = time.monotonic()
        resp = httpx.get(base + "/health_generate", timeout=30)
        assert resp.status_code == 503
        assert resp.json() == {"status": "failed", "message": "timed out"}
        assert 2 <= time.monotonic() - t0 < 10
        wait_for(lambda: silent.aborted == [silent.received[0].rid])
    assert metric(base, "sluice:num_requests_total") == requests
    assert metric(base, "sluice:num_aborted_requests_total") == aborted


def test_no_live_worker_is_503(base: str) -> None:
    resp = httpx.post(base + "/generate", json={"text": "x"})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_worker"


def test_generate_whole_and_streamed_agree_despite_reordered_repeated_rows(
    worker: FakeWorker, base: str
) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 64}}
    whole = httpx.post(base + "/generate", json=body).json()
    assert whole["text"] == PROMPT[::-1]
    assert whole["output_ids"] == [ord(c) for c in PROMPT[::-1]]
    meta = whole["meta_info"]
    assert meta["completion_tokens"] == len(PROMPT) and meta["prompt_tokens"] == len(PROMPT)
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    events = post_stream(base, "/generate", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, SGLang-style
    assert texts[-1] == whole["text"] and events[-2]["output_ids"] == whole["output_ids"]
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "stop"


def test_a_routers_stream_expires_unless_renewed_and_goes_with_a_clean_stop(
    redis_url: str,
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = router_out_stream(PREFIX, "r-brief")
    with start_router(redis_url, PREFIX, "--router-id", "r-brief") as brief:
        with running(FakeWorker(redis_url, PREFIX, "w-brief"), brief):  # (no repeated rows)
            resp = httpx.post(brief + "/generate", json={"text": "ab"}, timeout=30)
            assert resp.status_code == 200 and client.exists(stream)
            # renewed at the router's next look at its workers (0.2 s here): ~600 s
            wait_for(lambda: 590_000 < client.pttl(stream) <= 600_000)
    assert not client.exists(stream)
    client.close()


def test_completion_stream_deltas_concatenate_to_the_whole_text(
    worker: FakeWorker, base: str
) -> None:
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 20}
    whole = httpx.post(base + "/v1/completions", json=body).json()
    assert whole["object"] == "text_completion" and whole["choices"][0]["finish_reason"] == "length"
    assert whole["choices"][0]["text"] == PROMPT[::-1][:20]
    assert whole["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 20,
        "total_tokens": len(PROMPT) + 20,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    events = post_stream(base, "/v1/completions", {**body, "stream": True})
    assert completion_text(events) == whole["choices"][0]["text"]
    assert all("usage" not in e for e in events[:-1])  # include_usage not asked
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_role_first_usage_last(worker: FakeWorker, base: str) -> None:
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "abc"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = post_stream(base, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "cba"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["object"] == "chat.completion.chunk" for c in events[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(
    worker: FakeWorker, base: str
) -> None:
    # vLLM's stream_options.continuous_usage_stats; the fake makes a token per character
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 12, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    events = post_stream(base, "/v1/completions", body)
    chunks, last = events[:-2], events[-2]
    texts = {0: "", 1: ""}
    assert len(chunks) > 4
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        want = len(texts[choice["index"]])
        assert chunk["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": want,
                                  "total_tokens": len(PROMPT) + want}  # fmt: skip
    assert texts == {0: PROMPT[::-1][:12], 1: PROMPT[::-1][:12]}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 24
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "abc"}],
            "stream": True, "stream_options": {"continuous_usage_stats": True}}  # fmt: skip
    events = post_stream(base, "/v1/chat/completions", chat)  # without include_usage: none
    assert all("usage" not in e for e in events[:-1])


def test_stop_strings_are_trimmed_whole_and_streamed(worker: FakeWorker, base: str) -> None:
    # the reply is "0987654321 ZYX ..."; the stop "54" spans two tokens
    body = {"model": "fake-model", "prompt": "... XYZ 1234567890", "stop": ["XX", "54"]}
    whole = httpx.post(base + "/v1/completions", json=body).json()["choices"][0]
    assert (whole["text"], whole["finish_reason"], whole["matched_stop"]) == ("09876", "stop", "54")
    events = post_stream(base, "/v1/completions", {**body, "stream": True})
    assert completion_text(events) == "09876"
    assert not any("5" in e["choices"][0]["text"] for e in events[:-1])  # held back, then cut


def test_stop_strings_are_kept_when_asked(worker: FakeWorker, base: str) -> None:
    # vLLM's include_stop_str_in_output and SGLang's no_stop_trim keep "54" at the end
    body = {"model": "fake-model", "prompt": "... XYZ 1234567890", "stop": ["XX", "54"],
            "include_stop_str_in_output": True}  # fmt: skip
    whole = httpx.post(base + "/v1/completions", json=body).json()["choices"][0]
    assert (whole["text"], whole["matched_stop"]) == ("0987654", "54")
    events = post_stream(base, "/v1/completions", {**body, "stream": True})
    assert completion_text(events) == "0987654"
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "... XYZ 123456"}],
            "stop": "43", "no_stop_trim": True}  # fmt: skip
    message = httpx.post(base + "/v1/chat/completions", json=chat).json()["choices"][0]
    assert message["message"]["content"].endswith("43")
    gen = {"text": "... XYZ 1234567890", "sampling_params": {"stop": "54", "no_stop_trim": True}}
    out = httpx.post(base + "/generate", json=gen).json()
    assert (out["text"], out["meta_info"]["finish_reason"]) == (
        "0987654", {"type": "stop", "matched": "54"}
    )
    bad = httpx.post(base + "/v1/completions", json={**body, "include_stop_str_in_output": 1})
    assert bad.status_code == 400 and "include_stop_str_in_output" in bad.text


def test_router_cuts_a_stop_string_the_worker_missed_and_aborts_it(
    redis_url: str, base: str
) -> None:
    def ignore_stops(msg: TokenizeReqMsg) -> Plan:
        return Plan(list("abcSTOPdefghijklmnopqrstuvwxyz" * 3))

    with running(
        FakeWorker(redis_url, PREFIX, "w-nostop", plan=ignore_stops, step_s=0.02), base
    ) as w:
        body = {"model": "fake-model", "prompt": "x", "stop": "STOP", "max_tokens": 90}
        choice = httpx.post(base + "/v1/completions", json=body).json()["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["matched_stop"]) == (
            "abc",
            "stop",
            "STOP",
        )
        wait_for(lambda: w.aborted and not w.running)


def test_errors_from_the_tokenizer_become_http_errors(redis_url: str, base: str) -> None:
    def too_long(msg: TokenizeReqMsg) -> Plan:
        if "long" in (msg.text or ""):
            return Plan(error=(400, "prompt_too_long", "the prompt has 9999 tokens, max 4096"))
        return default_plan(msg)

    with running(FakeWorker(redis_url, PREFIX, "w-err", plan=too_long), base):
        for stream in (False, True):
            body = {"model": "fake-model", "prompt": "a long prompt", "stream": stream}
            resp = httpx.post(base + "/v1/completions", json=body)
            assert resp.status_code == 400
            assert resp.json() == {
                "error": {
                    "message": "the prompt has 9999 tokens, max 4096",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "prompt_too_long",
                }
            }
        resp = httpx.post(base + "/v1/completions", json={"model": "gpt-4", "prompt": "x"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
        body = {"model": "fake-model", "prompt": "x", "max_tokens": CONTEXT_LEN}
        resp = httpx.post(base + "/v1/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
        resp = httpx.post(base + "/v1/chat/completions", content=b'{"model": ')
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "n": 0}
        resp = httpx.post(base + "/v1/chat/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"


def test_client_disconnect_mid_stream_frees_the_request(redis_url: str, base: str) -> None:
    slow = FakeWorker(redis_url, PREFIX, "w-slow", step_s=0.05)
    with running(slow, base):
        body = {"model": "fake-model", "prompt": "z" * 500, "max_tokens": 500, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            got = [line for line, _ in zip(lines, range(6), strict=False) if line]
            assert len(got) >= 2 and slow.running
        wait_for(lambda: len(slow.aborted) == 1 and not slow.running)
        wait_for(lambda: metric(base, "sglang:num_running_reqs") == 0)


def test_cancelled_whole_request_is_aborted_at_the_worker(redis_url: str, base: str) -> None:
    slow = FakeWorker(redis_url, PREFIX, "w-slow2", step_s=0.05)
    with running(slow, base):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                base + "/generate",
                json={"text": "y" * 300, "sampling_params": {"max_new_tokens": 300}},
                timeout=0.5,
            )
        wait_for(lambda: len(slow.aborted) == 1 and not slow.running)


def test_request_sent_to_a_worker_that_dies_goes_to_another(redis_url: str, base: str) -> None:
    silent = FakeWorker(redis_url, PREFIX, "w-a-silent", silent=True)
    good = FakeWorker(redis_url, PREFIX, "w-b-good")
    with running(silent, base), ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, base + "/generate", json={"text": "failover"}, timeout=30)
        wait_for(lambda: silent.received)
        with running(good, base):
            silent.stop()  # its heartbeat goes: the router resends the request
            resp = future.result()
    assert resp.status_code == 200 and resp.json()["text"] == "revoliaf"
    assert len(good.received) == 1 and good.received[0].rid != silent.received[0].rid


def test_worker_dying_mid_stream_ends_the_stream_with_an_error(redis_url: str, base: str) -> None:
    w = FakeWorker(redis_url, PREFIX, "w-dies", step_s=0.05)
    with running(w, base):
        body = {"model": "fake-model", "prompt": "q" * 200, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            next(lines)
            w.stop()
            events = sse_events(lines)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "worker_unavailable"


def test_n_fans_out_with_distinct_rids_and_seeds_and_logprobs(
    worker: FakeWorker, base: str
) -> None:
    body = {"model": "fake-model", "prompt": "ab", "n": 3, "seed": 7, "logprobs": 2}
    out = httpx.post(base + "/v1/completions", json=body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["text"] == "ba" for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == 2 and out["usage"]["completion_tokens"] == 6
    assert len({m.rid for m in worker.received}) == 3
    assert sorted(m.sampling_params["sampling_seed"] for m in worker.received) == [7, 8, 9]
    lp = out["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-ord("b") / 1000, -ord("a") / 1000]
    assert lp["tokens"] == ["token_id:98", "token_id:97"]  # the router has no tokenizer here
    assert lp["top_logprobs"][0] == {"token_id:98": -0.098, "token_id:99": -0.099}
    chat = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "a"}],
        "logprobs": True,
        "top_logprobs": 1,
    }
    content = httpx.post(base + "/v1/chat/completions", json=chat).json()["choices"][0]
    entry = content["logprobs"]["content"][0]
    assert entry["logprob"] == -0.097 and entry["top_logprobs"][0]["token"] == "token_id:97"


def test_many_concurrent_streams_with_reordering_are_all_exact(
    worker: FakeWorker, base: str
) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {
            "model": "fake-model",
            "prompt": f"request {i} " + PROMPT,
            "max_tokens": 30,
            "stream": True,
        }
        text = ""
        async with client.stream("POST", base + "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(40)))

    texts = asyncio.run(main())
    assert texts == [(f"request {i} " + PROMPT)[::-1][:30] for i in range(40)]


def test_metrics_count_what_the_router_served(worker: FakeWorker, base: str) -> None:
    before = metric(base, "sglang:generation_tokens_total")
    count_before = metric(base, "sglang:e2e_request_latency_seconds_count")
    httpx.post(base + "/generate", json={"text": "abcd"})
    assert metric(base, "sglang:generation_tokens_total") == before + 4
    assert metric(base, "sluice:e2e_request_latency_seconds_count") == count_before + 1
    models = httpx.get(base + "/v1/models").json()
    assert models["data"][0]["id"] == "fake-model"
    assert models["data"][0]["max_model_len"] == CONTEXT_LEN
    card = httpx.get(base + "/v1/models/fake-model").json()  # OpenAI's retrieve
    assert card == models["data"][0]
    missing = httpx.get(base + "/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(base + "/version").json()["version"] not in ("", None)


def test_api_key_and_request_timeout(redis_url: str) -> None:
    prefix = "rt-key"
    env = {"SLUICE_API_KEY": "sekret"}
    with start_router(redis_url, prefix, "--request-timeout-s", "1.5", env=env) as url:
        with running(FakeWorker(redis_url, prefix, "w-key", silent=True), url):
            body = {"model": "fake-model", "prompt": "x"}
            resp = httpx.post(url + "/v1/completions", json=body)
            assert resp.status_code == 401
            assert resp.json()["error"]["code"] == "invalid_api_key"
            bad = {"Authorization": "Bearer nope"}
            assert httpx.get(url + "/v1/models", headers=bad).status_code == 401
            assert httpx.get(url + "/health").status_code == 200  # probes need no key
            good = {"Authorization": "Bearer sekret"}
            t0 = time.monotonic()
            resp = httpx.post(url + "/v1/completions", json=body, headers=good, timeout=30)
            assert resp.status_code == 504 and resp.json()["error"]["code"] == "timeout"
            assert 1.4 < time.monotonic() - t0 < 5


def test_incremental_streaming_output_sends_only_new_text_and_ids(redis_url: str) -> None:
    prefix = "rt-inc"
    with start_router(redis_url, prefix, "--incremental-streaming-output") as url:
        with running(FakeWorker(redis_url, prefix, "w-inc", shuffle=True, duplicate=True), url):
            body = {"text": [PROMPT, "abc"], "sampling_params": {"max_new_tokens": 64}}
            events = post_stream(url, "/generate", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    for i, prompt in enumerate([PROMPT, "abc"]):
        mine = [e for e in events[:-1] if e["index"] == i]
        assert len(mine) > 1 and "".join(e["text"] for e in mine) == prompt[::-1]
        assert [t for e in mine for t in e["output_ids"]] == [ord(c) for c in prompt[::-1]]
        assert mine[-1]["meta_info"]["completion_tokens"] == len(prompt)
        assert mine[-1]["meta_info"]["finish_reason"]["type"] == "stop"


def wait_for(cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)
