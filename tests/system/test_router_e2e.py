"""HTTP end to end through every service (router, tokenizer, worker, 3 detokenizers).

Greedy outputs equal the offline engine's; streamed deltas concatenate to the whole text
(CJK and emoji through byte tokens); stop strings cut real output; a client that goes away
frees its request at the worker; and a detokenizer killed with SIGKILL while 100 streams
run changes no stream's text. The kill test runs last: it leaves 2 detokenizers.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from engine.tokenizer import load_tokenizer
from services.detokenize import StepDetokenizer
from shared.keys import DETOKENIZER_GROUP, detok_stream
from tests.detok_oracle import matches_decode
from tests.system.procs import WORKER_TEST_ARGS, Stack, wait_until
from tests.system.router_fakes import metric

pytest_plugins = ["tests.system.router_stack"]

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "你好，世界", "emoji 😀 and café", "a"]


def offline(model: str, prompts: list[str], params: dict) -> list[dict]:
    from engine.engine import Engine

    flags = dict(zip(WORKER_TEST_ARGS[::2], WORKER_TEST_ARGS[1::2], strict=True))
    with Engine(
        model_path=model,
        max_total_tokens=int(flags["--max-total-tokens"]),
        max_running_requests=int(flags["--max-running-requests"]),
    ) as engine:
        return engine.generate(prompt=prompts, sampling_params=params)


def sse_texts(resp: httpx.Response, pick) -> list:  # noqa: ANN001
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: {"):
            out.append(pick(json.loads(line[6:])))
    return out


def stream(base: str, path: str, body: dict, pick) -> list:  # noqa: ANN001
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        return sse_texts(resp, pick)


def completion_delta(chunk: dict) -> str:
    return "".join(c["text"] for c in chunk["choices"])


def test_greedy_outputs_over_http_equal_the_offline_engine(http_stack: Stack) -> None:
    resp = httpx.post(
        http_stack.router_url + "/generate",
        json={"text": PROMPTS, "sampling_params": GREEDY},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    det = StepDetokenizer(load_tokenizer(http_stack.model))
    for got, want in zip(resp.json(), offline(http_stack.model, PROMPTS, GREEDY), strict=True):
        assert got["output_ids"] == want["output_ids"]
        assert matches_decode(det, got["output_ids"], got["text"]), (got["text"], want["text"])
        for key in ("prompt_tokens", "completion_tokens"):
            assert got["meta_info"][key] == want["meta_info"][key]
        # the wire's FinishReason carries `matched` for stops only (the engine's says 24)
        assert (
            got["meta_info"]["finish_reason"]["type"] == want["meta_info"]["finish_reason"]["type"]
        )


@pytest.mark.parametrize("prompt", ["你好，世界！", "emoji 😀🎉 and café"])
def test_streamed_deltas_concatenate_to_the_whole_text(
    http_stack: Stack, served_model: str, prompt: str
) -> None:
    base = http_stack.router_url
    body = {
        "model": served_model,
        "prompt": prompt,
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole = httpx.post(base + "/v1/completions", json=body, timeout=120).json()
    text = whole["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] == 40 and text
    assert "".join(stream(base, "/v1/completions", body, completion_delta)) == text
    generate = {"text": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 40}}
    cumulative = stream(base, "/generate", generate, lambda c: c["text"])
    assert cumulative[-1] == text and all(
        b.startswith(a) for a, b in zip(cumulative, cumulative[1:])
    )
    chat = {
        "model": served_model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 30,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole_chat = httpx.post(base + "/v1/chat/completions", json=chat, timeout=120).json()
    deltas = stream(
        base, "/v1/chat/completions", chat, lambda c: c["choices"][0]["delta"].get("content", "")
    )
    assert "".join(deltas) == whole_chat["choices"][0]["message"]["content"]


def test_a_stop_string_cuts_real_output(http_stack: Stack, served_model: str) -> None:
    base = http_stack.router_url
    body = {
        "model": served_model,
        "prompt": "Once upon a time",
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
    }
    text = httpx.post(base + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    clean = [i for i in range(8, len(text) - 3) if "\ufffd" not in text[i : i + 3]]
    assert clean, f"no usable stop string in {text!r}"
    stop = text[clean[0] : clean[0] + 3]
    want = text[: text.find(stop)]
    choice = httpx.post(
        base + "/v1/completions", json={**body, "stop": [stop]}, timeout=120
    ).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["matched_stop"]) == (want, "stop", stop)
    streamed = stream(base, "/v1/completions", {**body, "stop": stop}, completion_delta)
    assert "".join(streamed) == want


def test_flush_cache_and_model_info_as_sglang_serves_them(
    http_stack: Stack, served_model: str
) -> None:
    base = http_stack.router_url
    info = httpx.get(base + "/get_model_info", timeout=30).json()
    assert info["is_generation"] is True and info["served_model_name"] == served_model
    assert info["max_context_length"] > 0
    deadline = time.monotonic() + 30  # idle once earlier tests' requests have left the worker
    while (resp := httpx.post(base + "/flush_cache", timeout=30)).status_code != 200:
        assert resp.status_code == 400 and "not flushed" in resp.json()["error"]["message"]
        assert time.monotonic() < deadline, resp.text
        time.sleep(0.2)
    assert resp.json()["success"] is True and resp.json()["workers"] == [http_stack.worker_id]
    resp = httpx.post(base + "/reset_prefix_cache", timeout=30)  # vLLM's name: idle now
    assert resp.status_code == 200 and resp.json()["workers"] == [http_stack.worker_id]


def _trace_names(path: str) -> set[str]:
    with gzip.open(path, "rt") as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


def test_start_and_stop_profile_write_each_workers_trace(
    http_stack: Stack, served_model: str, tmp_path: Path
) -> None:
    """SGLang's /start_profile and /stop_profile: the torch profiler on the worker, its trace
    with the steps and the model's ops; and the stop after num_steps (sent as SGLang's
    profiler client sends it, a string)."""
    base, wid = http_stack.router_url, http_stack.worker_id
    body = {"model": served_model, "prompt": "profile me", "max_tokens": 4, "temperature": 0}
    resp = httpx.post(base + "/start_profile", json={"output_dir": str(tmp_path),
                      "profile_id": "e2e", "activities": ["CPU"]}, timeout=30)  # fmt: skip
    assert resp.status_code == 200, resp.text
    path = str(tmp_path / f"e2e-worker-{wid}.trace.json.gz")
    assert path in resp.json()["workers"][wid]
    again = httpx.post(base + "/start_profile", timeout=30)  # (no body: the defaults)
    assert again.status_code == 400 and "already profiling" in again.json()["error"]["message"]
    assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
    resp = httpx.post(base + "/stop_profile", timeout=130)
    assert resp.status_code == 200, resp.text
    device = str(tmp_path / f"e2e-worker-{wid}-device.trace.json.gz")  # (the CPU executor's)
    assert resp.json()["traces"] == {wid: [path, device]}
    assert any(n.startswith("sluice step ") for n in _trace_names(path))
    assert _trace_names(device) & {"aten::linear", "aten::mm", "aten::addmm"}
    resp = httpx.post(base + "/stop_profile", timeout=30)
    assert resp.status_code == 400 and "not profiling" in resp.json()["error"]["message"]

    auto = {"output_dir": str(tmp_path), "profile_id": "auto", "num_steps": "2"}
    assert httpx.post(base + "/start_profile", json=auto, timeout=30).status_code == 200
    assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
    written = tmp_path / f"auto-worker-{wid}.trace.json.gz"
    wait_until(written.exists, 30, what="the trace after 2 steps")
    resp = httpx.post(base + "/stop_profile", timeout=30)
    assert resp.status_code == 400 and "not profiling" in resp.json()["error"]["message"]

    for bad, param in [({"activities": ["TPU"]}, "activities"), ({"profile_by_stage": True},
                       "profile_by_stage"), ({"num_steps": 0}, "num_steps")]:  # fmt: skip
        resp = httpx.post(base + "/start_profile", json=bad, timeout=30)
        assert resp.status_code == 400, (bad, resp.text)
        assert resp.json()["error"]["param"] == param, resp.text


def test_a_client_that_disconnects_mid_stream_frees_its_request(
    http_stack: Stack, served_model: str
) -> None:
    """The worker's KV slots held by running requests (its heartbeat) go back to 0."""
    base = http_stack.router_url
    wait_until(lambda: metric(base, "sglang:num_used_tokens") == 0, 30, what="an idle worker")
    aborted = metric(base, "sglang:num_aborted_requests_total")
    body = {
        "model": served_model,
        "prompt": "tell me everything",
        "max_tokens": 1800,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for _ in range(10):
            next(lines)
        wait_until(lambda: metric(base, "sglang:num_used_tokens") > 0, 30, what="a running request")
    wait_until(
        lambda: metric(base, "sglang:num_used_tokens") == 0,
        30,
        http_stack.services,
        "the worker to free the request",
    )
    assert metric(base, "sglang:num_aborted_requests_total") == aborted + 1


def test_abort_request_by_rid_ends_a_running_generation(
    http_stack: Stack, served_model: str
) -> None:
    """SGLang's /abort_request: the response comes, with what was generated and `abort`."""
    base = http_stack.router_url
    wait_until(lambda: metric(base, "sglang:num_used_tokens") == 0, 30, what="an idle worker")
    aborted = metric(base, "sglang:num_aborted_requests_total")
    by_abort = 'vllm:request_success_total{model_name="%s",finished_reason="abort"}'
    vllm_aborted = metric(base, by_abort % served_model)
    params = {"max_new_tokens": 1800, "temperature": 0, "ignore_eos": True}
    body = {"text": "tell me everything", "rid": "e2e-abort", "sampling_params": params}
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, base + "/generate", json=body, timeout=60)
        wait_until(lambda: metric(base, "sglang:num_used_tokens") > 0, 30, what="a running request")
        resp = httpx.post(base + "/abort_request", json={"rid": "e2e-abort"}, timeout=30)
        assert resp.status_code == 200 and resp.json()["num_aborted"] == 1
        out = future.result().json()
    meta = out["meta_info"]
    assert meta["id"] == "e2e-abort"
    assert meta["finish_reason"] == {"type": "abort", "message": "aborted by /abort_request"}
    assert 0 < len(out["output_ids"]) < 1800 == params["max_new_tokens"]
    assert meta["completion_tokens"] == len(out["output_ids"])
    made = len(out["output_ids"])  # the greedy output, as far as it went
    want = offline(http_stack.model, ["tell me everything"], {**params, "max_new_tokens": made})
    assert out["output_ids"] == want[0]["output_ids"]
    wait_until(lambda: metric(base, "sglang:num_used_tokens") == 0, 30, what="the KV freed")
    assert metric(base, "sglang:num_aborted_requests_total") == aborted + 1
    assert metric(base, by_abort % served_model) == vllm_aborted + 1


def test_a_priority_reaches_the_worker_which_refuses_it_without_priority_scheduling(
    http_stack: Stack, served_model: str
) -> None:
    base = http_stack.router_url
    body = {"model": served_model, "prompt": "hi", "max_tokens": 2, "priority": 5}
    resp = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert "--enable-priority-scheduling" in resp.json()["error"]["message"]
    resp = httpx.post(base + "/v1/completions", json={**body, "priority": 0}, timeout=60)
    assert resp.status_code == 200, resp.text
    resp = httpx.post(base + "/generate", json={"text": "hi", "priority": "high"}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority"


def test_a_cache_salt_keeps_cached_prefixes_within_its_tenant(
    http_stack: Stack, served_model: str
) -> None:
    """vLLM's `cache_salt` (SGLang's `extra_key`) reaches the worker's prefix cache: the
    same prompt under another salt, or none, finds nothing cached; under its own, it does."""
    base = http_stack.router_url
    prompt = "Salted document: " + " ".join(f"item{i}" for i in range(40))
    body = {"model": served_model, "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def cached(path: str = "/v1/completions", **extra: object) -> int:
        resp = httpx.post(base + path, json={**body, **extra}, timeout=60)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        if path == "/generate":
            return out["meta_info"]["cached_tokens"]
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    # (an unsalted prompt would find at least the BOS token of earlier tests' prompts)
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached() <= 1  # not tenant-a's or tenant-b's document: only a shared BOS
    hit = cached(cache_salt="tenant-a")
    assert hit > 40, hit
    assert cached(extra_key="tenant-b") == hit  # SGLang's name: the same salt
    generate = {"text": prompt, "sampling_params": {"max_new_tokens": 2}, "extra_key": "tenant-a"}
    assert cached("/generate", **generate) == hit
    assert cached("/generate", **{**generate, "extra_key": "tenant-c"}) == 0
    resp = httpx.post(base + "/v1/completions", json={**body, "cache_salt": ""}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt"


def test_generate_logprob_entries_are_sglangs_triples(http_stack: Stack) -> None:
    """`/generate`'s logprobs as SGLang gives them: `[logprob, token id, text]`, the text None
    unless `return_text_in_logprobs`, then the token's own text, in the output's entries, the
    top candidates and the prompt's (`logprob_start_len`)."""
    base = http_stack.router_url
    tokenizer = load_tokenizer(http_stack.model)
    body = {"text": "The sky is", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}  # fmt: skip
    plain = httpx.post(base + "/generate", json=body, timeout=60).json()["meta_info"]
    named = httpx.post(base + "/generate", json={**body, "return_text_in_logprobs": True},
                       timeout=60).json()["meta_info"]  # fmt: skip
    keys = ("output_token_logprobs", "input_token_logprobs")
    for key in keys:
        assert all(len(e) == 3 and e[2] is None for e in plain[key]), plain[key]
        assert [e[:2] for e in named[key]] == [e[:2] for e in plain[key]]
        assert [e[2] for e in named[key]] == [tokenizer.decode([e[1]]) for e in named[key]]
    assert plain["input_token_logprobs"][0][0] is None  # the prompt's first token has none
    assert 0 < plain["e2e_latency"] < 60  # SGLang's: arrival to end, in seconds
    for row in named["output_top_logprobs"]:
        assert [e[2] for e in row] == [tokenizer.decode([e[1]]) for e in row]
    bad = httpx.post(base + "/generate", json={**body, "return_text_in_logprobs": "yes"},
                     timeout=60)  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_text_in_logprobs"


def test_loads_and_the_newer_info_names(http_stack: Stack, served_model: str) -> None:
    """SGLang's `/get_load` (one entry per worker) and vLLM's `/load` count a request while
    it runs; SGLang's newer `/model_info` and `/server_info` answer as the older names."""
    base = http_stack.router_url

    def get(path: str) -> Any:
        r = httpx.get(base + path, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    assert get("/model_info") == get("/get_model_info")
    assert get("/server_info")["router_id"] == get("/get_server_info")["router_id"]
    body = {"model": served_model, "prompt": "load", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    seen: list[tuple[list, dict]] = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if len(seen) < 40 and line.startswith("data: {"):
                seen.append((get("/get_load"), get("/load")))
                if seen[-1][0][0]["num_reqs"] >= 1:
                    break
    loads, load = seen[-1]
    assert [e["worker_id"] for e in loads] == [http_stack.worker_id] and loads[0]["dp_rank"] == 0
    assert loads[0]["num_reqs"] >= 1 and loads[0]["num_tokens"] > 0, seen
    assert load["server_load"] >= 1
    deadline = time.monotonic() + 30  # (the stream closed: the router aborts it)
    while get("/load")["server_load"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert get("/load") == {"server_load": 0}


def test_request_ids_as_vllm_takes_them(http_stack: Stack, served_model: str) -> None:
    """vLLM's request id: the body's `request_id`, or the `X-Request-Id` header (which wins),
    is the response's id after its prefix and comes back in the `X-Request-Id` header
    (a new one when neither is given); streamed, every chunk has that id."""
    base = http_stack.router_url
    comp = {"model": served_model, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    chat = {"model": served_model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "temperature": 0}  # fmt: skip

    def post(path: str, body: dict, **headers: str) -> httpx.Response:
        r = httpx.post(base + path, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r

    r = post("/v1/completions", {**comp, "request_id": "abc"})
    assert r.json()["id"] == "cmpl-abc" and r.headers["x-request-id"] == "abc"
    r = post("/v1/chat/completions", {**chat, "request_id": "body"}, **{"X-Request-Id": "hdr"})
    assert r.json()["id"] == "chatcmpl-hdr" and r.headers["x-request-id"] == "hdr"
    r = post("/v1/completions", comp)
    new = r.headers["x-request-id"]
    assert len(new) == 32 and r.json()["id"] == f"cmpl-{new}"
    with httpx.stream("POST", base + "/v1/chat/completions", json={**chat, "stream": True},
                      headers={"X-Request-Id": "s-1"}, timeout=60) as r:  # fmt: skip
        assert r.headers["x-request-id"] == "s-1"
        ids = {json.loads(line[6:])["id"] for line in r.iter_lines()
               if line.startswith("data: {")}  # fmt: skip
    assert ids == {"chatcmpl-s-1"}
    r = httpx.post(base + "/v1/completions", json=comp, headers={"X-Request-Id": "x" * 300},
                   timeout=60)  # fmt: skip
    assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", json={**comp, "request_id": ""}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


def test_return_tokens_as_token_ids_spells_logprob_tokens_by_id(
    http_stack: Stack, served_model: str
) -> None:
    """vLLM's `return_tokens_as_token_ids`: the logprobs' tokens (and top candidates) are
    `token_id:N` instead of their decoded text, on completions (streamed too) and chat; the
    text itself is unchanged."""
    base = http_stack.router_url
    tokenizer = load_tokenizer(http_stack.model)
    body = {"model": served_model, "prompt": "The sky is", "max_tokens": 5, "temperature": 0,
            "logprobs": 2, "return_token_ids": True}  # fmt: skip
    plain = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    by_id = httpx.post(base + "/v1/completions", json={**body, "return_tokens_as_token_ids":
                       True}, timeout=60).json()["choices"][0]  # fmt: skip
    ids = plain["token_ids"]
    assert plain["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert by_id["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert by_id["text"] == plain["text"]
    assert by_id["logprobs"]["token_logprobs"] == pytest.approx(
        plain["logprobs"]["token_logprobs"], abs=1e-4
    )  # (a second run: its prompt from the prefix cache)
    assert all(k.startswith("token_id:") for top in by_id["logprobs"]["top_logprobs"]
               for k in top)  # fmt: skip
    streamed = []
    with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
            **body, "stream": True, "return_tokens_as_token_ids": True}) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[len("data: "):])["choices"][0]["logprobs"]
                streamed += lp["tokens"] if lp else []
    assert streamed == by_id["logprobs"]["tokens"]
    chat = {"model": served_model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 1,
            "return_tokens_as_token_ids": True, "return_token_ids": True}  # fmt: skip
    out = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60).json()
    content = out["choices"][0]["logprobs"]["content"]
    ids = out["choices"][0]["token_ids"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
    assert [e["bytes"] for e in content] == [list(f"token_id:{t}".encode()) for t in ids]
    assert all(c["token"].startswith("token_id:") for e in content for c in e["top_logprobs"])


def test_kill_9_of_one_of_three_detokenizers_while_100_streams_run(
    http_stack: Stack, served_model: str
) -> None:
    base = http_stack.router_url
    prompts = [f"stream {i}: " + "ab" * (i % 5) for i in range(100)]

    async def one(client: httpx.AsyncClient, prompt: str, chunks: list[int]) -> str:
        body = {
            "model": served_model,
            "prompt": prompt,
            # long enough that the fault, injected early, finds many step messages still to
            # come: the victim must be caught holding one
            "max_tokens": 96,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text = ""
        async with client.stream("POST", base + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    text += completion_delta(json.loads(line[6:]))
                    chunks[0] += 1
        return text

    async def run_all(fault=None) -> list[str]:  # noqa: ANN001
        chunks = [0]
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(timeout=180, limits=limits) as client:
            tasks = [asyncio.create_task(one(client, p, chunks)) for p in prompts]
            if fault is not None:
                while chunks[0] < 300:
                    await asyncio.sleep(0.01)
                await asyncio.to_thread(fault)
            return await asyncio.gather(*tasks)

    fault_free = asyncio.run(run_all())
    victim = http_stack.detokenizers[0]
    held: list[int] = []

    def pending() -> int:
        consumers = http_stack.client.xinfo_consumers(
            detok_stream(http_stack.prefix), DETOKENIZER_GROUP
        )
        return next((c["pending"] for c in consumers if c["name"] == b"detok0"), 0)

    def kill_while_holding_entries() -> None:
        held.append(victim.kill_while_holding(pending, producer=http_stack.worker))

    t0 = time.monotonic()
    with_fault = asyncio.run(run_all(kill_while_holding_entries))
    assert held[0] > 0, "the victim never held a step (the test proved nothing)"
    assert with_fault == fault_free
    assert time.monotonic() - t0 < 120


def test_tokenize_and_detokenize_as_vllm_serves_them(http_stack: Stack, served_model: str) -> None:
    """The tokenizer service answers: the same ids the generation path uses (a chat's count is
    its prompt_tokens), the tokens' strings on request, and the text of ids back."""
    base = http_stack.router_url
    tok = load_tokenizer(http_stack.model)

    def post(path: str, body: dict, status: int = 200) -> dict:
        resp = httpx.post(base + path, json=body, timeout=30)
        assert resp.status_code == status, resp.text
        return resp.json()

    text = "The sky is blue. 你好"
    got = post("/tokenize", {"model": served_model, "prompt": text, "return_token_strs": True})
    assert got["tokens"] == tok.encode(text) and got["count"] == len(got["tokens"])
    assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
    assert got["max_model_len"] > 0
    bare = post("/tokenize", {"prompt": text, "add_special_tokens": False})
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False)
    assert bare["token_strs"] is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = post("/tokenize", {"model": served_model, "messages": messages})
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False)
    completion = post("/v1/chat/completions",
                      {"model": served_model, "messages": messages, "max_tokens": 1})  # fmt: skip
    assert completion["usage"]["prompt_tokens"] == chat["count"]
    back = tok.decode(got["tokens"])
    assert post("/detokenize", {"tokens": got["tokens"]}) == {"prompt": back, "text": back}
    assert post("/detokenize", {"model": served_model, "tokens": []})["prompt"] == ""
    # SGLang's spellings: /v1/..., batches, skip_special_tokens
    batch = post("/v1/tokenize", {"prompt": [text, "hi"], "add_special_tokens": False})
    assert batch["tokens"] == [bare["tokens"], tok.encode("hi", add_special_tokens=False)]
    assert batch["count"] == [len(t) for t in batch["tokens"]]
    with_special = chat["tokens"]  # the chat template writes special tokens
    texts = post("/v1/detokenize", {"tokens": [with_special, got["tokens"]],
                                    "skip_special_tokens": True})["text"]  # fmt: skip
    assert texts == [tok.decode(ids, skip_special_tokens=True)
                     for ids in (with_special, got["tokens"])]  # fmt: skip
    assert texts[1] != back  # without the BOS this time
    # errors: the client's, with the reason
    too_big = post("/detokenize", {"tokens": [1, 10**6]}, 400)
    assert "token ids must be in" in too_big["error"]["message"]
    both = post("/tokenize", {"prompt": "x", "messages": messages}, 400)
    assert "exactly one of prompt and messages" in both["error"]["message"]
    post("/tokenize", {"model": "not-served", "prompt": "x"}, 404)
    roles = post("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400)
    assert roles["error"]["param"].startswith("messages")
