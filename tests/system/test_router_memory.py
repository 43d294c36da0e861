"""Device memory released while idle on the shared stack, as an RL loop does it
(services/router_memory.py): SGLang's `/release_memory_occupation` and
`/resume_memory_occupation`, vLLM's `/sleep`, `/wake_up` and `/is_sleeping`. Released, a new
request waits in the worker's queue (and `/health_generate` says sleeping) until the resume,
then has transformers' tokens; vLLM's level 2, the weights woken, updated to another
checkpoint, then the K/V woken: the new weights' tokens; a release while a request runs is
refused, and after a retracting pause it goes on, the request ending with the tokens it would
have had once the memory is back. Bad tags and levels are a 400. Every test leaves the stack
awake, generating, on its own weights."""

from __future__ import annotations

import time

import httpx2 as httpx
import pytest

from shared.keys import memory_released_key
from tests.factories import hf_greedy
from tests.system.procs import Stack
from tests.system.test_router_pause import (
    OTHER,
    PROMPT,
    Streamed,
    generate_in_background,
    is_paused,
    load_becomes,
    post,
)

pytest_plugins = ["tests.system.router_stack"]

ALL = ["cuda_graph", "kv_cache", "weights"]


def is_sleeping(stack: Stack) -> bool:
    r = httpx.get(f"{stack.router_url}/is_sleeping", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["is_sleeping"]


@pytest.fixture
def stack(http_stack: Stack):
    yield http_stack
    assert post(http_stack, "/resume_memory_occupation", {}).status_code == 200
    assert post(http_stack, "/continue_generation", {}).status_code == 200
    assert not is_sleeping(http_stack) and not is_paused(http_stack)
    info = httpx.get(f"{http_stack.router_url}/get_model_info", timeout=10).json()
    if info["model_path"] != http_stack.model:
        r = post(http_stack, "/update_weights_from_disk", {"model_path": http_stack.model})
        assert r.status_code == 200, r.text


def test_released_requests_wait_and_the_resume_gives_transformers_tokens(stack: Stack) -> None:
    r = post(stack, "/release_memory_occupation", {})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] and body["released"] == ALL
    assert body["num_bytes"][stack.worker_id] > 0
    assert is_sleeping(stack) and stack.client.get(memory_released_key(stack.prefix)) == (
        b"cuda_graph,kv_cache,weights"
    )
    health = httpx.get(f"{stack.router_url}/health_generate", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "sleeping", health.text
    waiting, answer = generate_in_background(stack, 8)
    assert load_becomes(stack, lambda running, queued: queued == 1)
    time.sleep(1.0)
    assert not answer  # (held in the worker's queue while released)
    r = post(stack, "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
    assert r.status_code == 200 and r.json()["released"] == ["cuda_graph"], r.text
    waiting.join(60)
    assert answer and answer[0].status_code == 200, answer
    assert answer[0].json()["output_ids"] == hf_greedy(stack.model, PROMPT, 8)
    r = post(stack, "/resume_memory_occupation", {"tags": ["cuda_graph"]})
    assert r.json()["released"] == [] and not is_sleeping(stack)
    assert stack.client.get(memory_released_key(stack.prefix)) is None


def test_vllm_sleep_level_2_update_then_wake_runs_the_new_weights(stack: Stack) -> None:
    r = post(stack, "/sleep", level="2")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "sleeping" and r.json()["released"] == ["kv_cache", "weights"]
    r = httpx.post(f"{stack.router_url}/wake_up?tags=weights", timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "sleeping", r.text
    assert is_sleeping(stack)
    r = post(stack, "/update_weights_from_disk", {"model_path": OTHER})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{stack.router_url}/wake_up?tags=kv_cache", timeout=120)
    assert r.status_code == 200 and r.json() == {
        "status": "awake", "released": [], "num_bytes": r.json()["num_bytes"]
    }, r.text  # fmt: skip
    assert not is_sleeping(stack)
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8,
                                                     "ignore_eos": True}}  # fmt: skip
    r = post(stack, "/generate", body)
    assert r.status_code == 200 and r.json()["output_ids"] == hf_greedy(OTHER, PROMPT, 8)


def test_refused_while_a_request_runs_then_released_after_a_retraction(stack: Stack) -> None:
    new = 1500
    running = Streamed(stack, new)
    r = post(stack, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    assert r.status_code == 400 and "requests are running" in r.text, r.text
    assert not is_sleeping(stack)
    assert post(stack, "/pause_generation", {"mode": "retract"}).status_code == 200
    done = running.settled()
    r = post(stack, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    assert r.status_code == 200, r.text
    assert post(stack, "/continue_generation", {}).status_code == 200
    time.sleep(1.0)
    assert running.tokens() == done and running.finish() is None  # (asleep: nothing runs)
    assert 0 < len(done) < new
    r = httpx.post(f"{stack.router_url}/wake_up", timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "awake", r.text
    running.join()
    assert running.finish()["type"] == "length"
    assert running.tokens() == hf_greedy(stack.model, PROMPT, new)


@pytest.mark.parametrize(
    "path,body,query,why",
    [
        ("/release_memory_occupation", {"tags": ["gpu"]}, {}, "tags: unknown tag 'gpu'"),
        ("/release_memory_occupation", {"tags": []}, {}, "tags: empty"),
        ("/release_memory_occupation", {"tags": "weights"}, {}, "tags"),
        ("/resume_memory_occupation", {"tags": [1]}, {}, "tags"),
        ("/sleep", None, {"level": "3"}, "level: '3'"),
        ("/wake_up", None, {"tags": "kv"}, "tags: unknown tag 'kv'"),
    ],
)
def test_bad_tags_and_levels_are_a_400(
    stack: Stack, path: str, body: dict | None, query: dict, why: str
) -> None:
    r = post(stack, path, body, **query)
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert not is_sleeping(stack)
