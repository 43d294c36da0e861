"""`POST /update_weights_from_disk` on the shared stack (SGLang's call): the worker serves
another checkpoint of the same model, with transformers' greedy tokens for it, and
`/get_model_info` names it; a request running when the update comes finishes on the old
weights, one arriving meanwhile waits and runs on the new ones (counted as paused);
`abort_all_requests` ends the running ones instead; a checkpoint of another model and
unsupported options are a 400 with the reason. SGLang's weight version: set by the update or
`/update_weight_version`, read at its three addresses, `/get_model_info` and every output's
meta_info. The stack's weights (and version) are restored after each test."""

from __future__ import annotations

import json
import threading
import time

import httpx2 as httpx
import pytest

from tests.factories import hf_greedy, tiny_model
from tests.system.procs import Stack

pytest_plugins = ["tests.system.router_stack"]

NEW = 12
PROMPT = [40, 91, 7, 300, 52, 18, 77, 64, 9, 120]
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
OTHER = tiny_model("llama", seed=1)  # the stack's model's shape, other weights


def post(stack: Stack, path: str, **body: object) -> httpx.Response:
    return httpx.post(f"{stack.router_url}{path}", json=body, timeout=120)


def tokens(stack: Stack, **params: object) -> list[int]:
    r = post(stack, "/generate", input_ids=PROMPT, sampling_params=GREEDY | params)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def model_path(stack: Stack) -> str:
    return httpx.get(f"{stack.router_url}/get_model_info", timeout=10).json()["model_path"]


@pytest.fixture
def stack(http_stack: Stack):
    original = model_path(http_stack)
    yield http_stack
    r = post(http_stack, "/update_weights_from_disk", model_path=http_stack.model,
             weight_version="default")  # fmt: skip
    assert r.status_code == 200, r.text
    assert model_path(http_stack) == original


def stream_in_background(stack: Stack, body: dict) -> tuple[threading.Thread, list[dict]]:
    """A streaming /generate on a thread, started: its events so far."""
    started, events = threading.Event(), []

    def run() -> None:
        with httpx.stream("POST", f"{stack.router_url}/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[len("data: "):]))
                    started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60)
    return thread, events


def test_update_and_back(stack: Stack) -> None:
    before = model_path(stack)
    assert tokens(stack) == hf_greedy(stack.model, PROMPT, NEW)
    r = post(stack, "/update_weights_from_disk", model_path=OTHER)
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "message": "Succeeded to update model weights.",
                        "num_paused_requests": 0}  # fmt: skip
    assert model_path(stack) == OTHER != before
    assert tokens(stack) == hf_greedy(OTHER, PROMPT, NEW)


def waiting_updates(stack: Stack) -> int:
    """How many weights updates the worker has logged as waiting for a running request."""
    assert stack.worker is not None
    return stack.worker.log(tail=10**7).count(f"weights update to {OTHER}: waiting for 1 ")


def test_running_requests_finish_on_the_old_weights(stack: Stack) -> None:
    long = {"max_new_tokens": 1500}  # (seconds of decoding: the update waits that long)
    want_old = tokens(stack, **long)
    body = {"input_ids": PROMPT, "sampling_params": GREEDY | long, "stream": True}
    seen = waiting_updates(stack)
    reader, events = stream_in_background(stack, body)
    answer: list[httpx.Response] = []
    updater = threading.Thread(
        target=lambda: answer.append(post(stack, "/update_weights_from_disk", model_path=OTHER))
    )
    updater.start()
    deadline = time.monotonic() + 30
    while waiting_updates(stack) == seen and time.monotonic() < deadline:
        time.sleep(0.02)  # until the worker holds the update back
    assert waiting_updates(stack) == seen + 1
    assert events[-1]["meta_info"]["finish_reason"] is None  # still running
    held = tokens(stack)  # arrives during the wait: runs after the update
    updater.join(120)
    reader.join(120)
    assert events[-1]["output_ids"][-1] == want_old[-1]
    assert events[-1]["meta_info"]["completion_tokens"] == 1500
    assert answer[0].status_code == 200, answer[0].text
    assert answer[0].json()["num_paused_requests"] >= 1
    assert held == hf_greedy(OTHER, PROMPT, NEW)


def test_abort_all_requests(stack: Stack) -> None:
    body = {"input_ids": PROMPT, "sampling_params": GREEDY | {"max_new_tokens": 400},
            "stream": True}  # fmt: skip
    reader, events = stream_in_background(stack, body)
    r = post(stack, "/update_weights_from_disk", model_path=OTHER, abort_all_requests=True)
    reader.join(120)
    assert r.status_code == 200, r.text
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-1]["meta_info"]["completion_tokens"] < 400
    assert tokens(stack) == hf_greedy(OTHER, PROMPT, NEW)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"model_path": "@QWEN"}, "is a ['Qwen3ForCausalLM'] checkpoint"),
        ({"model_path": "/nonexistent"}, "no config.json in /nonexistent"),
        ({"model_path": "@OTHER", "load_format": "gguf"}, "load_format 'gguf' is not supported"),
        ({"model_path": "@OTHER", "flush_cache": False}, "flush_cache false is not supported"),
        ({"model_path": " "}, "model_path must not be empty"),
        ({}, "model_path"),
    ],
)
def test_refusals(stack: Stack, body: dict, why: str) -> None:
    swap = {"@QWEN": tiny_model("qwen3"), "@OTHER": OTHER}
    r = post(stack, "/update_weights_from_disk", **{k: swap.get(v, v) for k, v in body.items()})
    assert r.status_code == 400, r.text
    assert r.json()["success"] is False and why in r.json()["message"], r.text
    assert tokens(stack) == hf_greedy(stack.model, PROMPT, NEW)


def test_weight_versions(stack: Stack) -> None:
    base = stack.router_url

    def versions() -> set[str]:
        paths = ("/get_weight_version", "/weight_version", "/weight_info", "/get_model_info")
        return {httpx.get(base + p, timeout=10).json()["weight_version"] for p in paths}

    def generated_version(**body: object) -> str:
        r = post(stack, "/generate", input_ids=PROMPT, sampling_params=GREEDY, **body)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["weight_version"]

    assert versions() == {"default"} and generated_version() == "default"
    r = post(stack, "/update_weights_from_disk", model_path=OTHER, weight_version="step-1")
    assert r.status_code == 200, r.text
    assert versions() == {"step-1"} and generated_version() == "step-1"
    r = post(stack, "/update_weight_version", new_version="step-2")
    assert r.json() == {"success": True, "message": "Weight version updated to step-2",
                        "new_version": "step-2"}  # fmt: skip
    body = {"input_ids": PROMPT, "sampling_params": GREEDY | {"max_new_tokens": 1500},
            "stream": True}  # fmt: skip
    reader, events = stream_in_background(stack, body)
    r = post(stack, "/update_weight_version", new_version="step-3", abort_all_requests=True)
    assert r.status_code == 200, r.text
    reader.join(120)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[0]["meta_info"]["weight_version"] == "step-2"
    assert events[-1]["meta_info"]["weight_version"] == "step-3"
    assert versions() == {"step-3"}
    for bad in ({"new_version": ""}, {}, {"new_version": 3}):
        r = post(stack, "/update_weight_version", **bad)
        assert r.status_code == 400 and "new_version" in r.text, r.text
    r = post(stack, "/update_weights_from_disk", model_path=OTHER, weight_version=" ")
    assert r.status_code == 400 and "weight_version must not be empty" in r.text
    assert versions() == {"step-3"}
