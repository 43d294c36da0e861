"""Pausing generation on the shared stack, as an RL loop does (services/router_pause.py):
SGLang's `/pause_generation` and `/continue_generation`, vLLM's `/pause`, `/resume` and
`/is_paused`. Mode abort ends the running request and holds a new one until the resume (it
then runs, with transformers' tokens); keep freezes a request, which goes on to the same
tokens as if never paused, and refuses a weights update meanwhile; retract, a weights update,
then the resume: the request continues on the new weights exactly as transformers continues
its text on them; wait answers once the running request has ended; a batch of concurrent
requests retracted mid-run all end with the tokens they would have had. Bad modes and flags
are a 400. Every test leaves the stack generating, on its own weights."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx2 as httpx
import pytest

from shared.keys import paused_key
from tests.factories import hf_greedy, tiny_model
from tests.system.procs import Stack

pytest_plugins = ["tests.system.router_stack"]

PROMPT = [40, 91, 7, 300, 52, 18, 77, 64, 9, 120]
GREEDY = {"temperature": 0, "ignore_eos": True}
OTHER = tiny_model("llama", seed=1)  # the stack's model's shape, other weights


def post(stack: Stack, path: str, body: dict | None = None, **query: str) -> httpx.Response:
    return httpx.post(f"{stack.router_url}{path}", json=body, params=query, timeout=120)


def is_paused(stack: Stack) -> bool:
    r = httpx.get(f"{stack.router_url}/is_paused", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["is_paused"]


@pytest.fixture
def stack(http_stack: Stack):
    yield http_stack
    assert post(http_stack, "/resume").status_code == 200
    assert not is_paused(http_stack)
    info = httpx.get(f"{http_stack.router_url}/get_model_info", timeout=10).json()
    if info["model_path"] != http_stack.model:
        r = post(http_stack, "/update_weights_from_disk", {"model_path": http_stack.model})
        assert r.status_code == 200, r.text


class Streamed:
    """A streaming /generate on a thread: its events so far."""

    def __init__(self, stack: Stack, new: int) -> None:
        self.events: list[dict] = []
        body = {"input_ids": PROMPT, "sampling_params": GREEDY | {"max_new_tokens": new},
                "stream": True}  # fmt: skip
        started = threading.Event()

        def run() -> None:
            url = f"{stack.router_url}/generate"
            with httpx.stream("POST", url, json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.events.append(json.loads(line[len("data: "):]))
                        started.set()

        self.thread = threading.Thread(target=run)
        self.thread.start()
        assert started.wait(60)

    def tokens(self) -> list[int]:
        return self.events[-1]["output_ids"]

    def finish(self) -> dict | None:
        return self.events[-1]["meta_info"]["finish_reason"]

    def settled(self) -> list[int]:
        """Its tokens once they stop coming (paused: the last ones are on their way)."""
        seen = -1
        while len(self.tokens()) != seen:
            seen = len(self.tokens())
            time.sleep(0.5)
        return self.tokens()

    def join(self, timeout_s: float = 120) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive()


def load_becomes(stack: Stack, check: Callable[[int, int], bool]) -> bool:
    """Whether the worker's running and waiting requests, as its heartbeats say them,
    pass `check` within 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        load = httpx.get(f"{stack.router_url}/get_load", timeout=10).json()[0]
        if check(load["num_reqs"] - load["num_waiting_reqs"], load["num_waiting_reqs"]):
            return True
        time.sleep(0.05)
    return False


def generate_in_background(stack: Stack, new: int) -> tuple[threading.Thread, list]:
    out: list[httpx.Response] = []
    body = {"input_ids": PROMPT, "sampling_params": GREEDY | {"max_new_tokens": new}}
    thread = threading.Thread(
        target=lambda: out.append(post(stack, "/generate", body)), daemon=True
    )
    thread.start()
    return thread, out


def test_abort_ends_the_running_request_and_holds_new_ones(stack: Stack) -> None:
    running = Streamed(stack, 1500)
    r = post(stack, "/pause_generation", {})  # (SGLang's default mode: abort)
    assert r.status_code == 200, r.text
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    running.join()
    assert running.finish()["type"] == "abort" and len(running.tokens()) < 1500
    assert is_paused(stack) and stack.client.get(paused_key(stack.prefix)) == b"abort"
    health = httpx.get(f"{stack.router_url}/health_generate", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "paused", "mode": "abort"}
    waiting, answer = generate_in_background(stack, 8)
    time.sleep(1.5)
    assert not answer  # (held in the worker's queue while paused)
    r = post(stack, "/continue_generation", {})
    assert r.json() == {"message": "Generation continued successfully.", "status": "ok"}
    waiting.join(60)
    assert answer and answer[0].status_code == 200, answer
    assert answer[0].json()["output_ids"] == hf_greedy(stack.model, PROMPT, 8)
    assert not is_paused(stack)


def test_keep_freezes_a_request_that_then_goes_on_to_the_same_tokens(stack: Stack) -> None:
    new = 600
    running = Streamed(stack, new)
    r = post(stack, "/pause", mode="keep")
    assert r.status_code == 200 and r.json() == {"status": "paused"}, r.text
    frozen = running.settled()
    assert 0 < len(frozen) < new and running.finish() is None
    r = post(stack, "/update_weights_from_disk", {"model_path": OTHER})
    assert r.status_code == 400 and "paused in place" in r.json()["message"], r.text
    r = post(stack, "/resume")
    assert r.status_code == 200 and r.json() == {"status": "resumed"}
    running.join()
    assert running.finish()["type"] == "length"
    assert running.tokens() == hf_greedy(stack.model, PROMPT, new)


def test_retract_update_and_continue_on_the_new_weights(stack: Stack) -> None:
    new = 300
    running = Streamed(stack, new)
    r = post(stack, "/pause_generation", {"mode": "retract"})
    assert r.status_code == 200, r.text
    done = running.settled()
    assert 0 < len(done) < new and running.finish() is None
    r = post(stack, "/update_weights_from_disk", {"model_path": OTHER})
    assert r.status_code == 200, r.text
    assert post(stack, "/continue_generation", {}).status_code == 200
    running.join()
    assert done == hf_greedy(stack.model, PROMPT, new)[: len(done)]
    assert running.tokens() == done + hf_greedy(OTHER, PROMPT + done, new - len(done))


def test_wait_answers_once_the_running_request_has_ended(stack: Stack) -> None:
    running = Streamed(stack, 200)
    r = post(stack, "/pause", wait_for_inflight_requests="true", clear_cache="false")
    assert r.status_code == 200, r.text
    assert stack.client.get(paused_key(stack.prefix)) == b"wait"
    running.join(timeout_s=10)  # (ended before the answer: its last rows are on their way)
    assert running.finish()["type"] == "length" and len(running.tokens()) == 200


def test_a_retracted_batch_ends_with_the_tokens_it_would_have_had(stack: Stack) -> None:
    new, n = 1200, 12  # (long enough to be running still after a heartbeat or two)
    requests = [generate_in_background(stack, new) for _ in range(n)]
    assert load_becomes(stack, lambda running, waiting: running == n)
    r = post(stack, "/pause_generation", {"mode": "retract"})
    assert r.status_code == 200, r.text
    assert not any(answer for _, answer in requests), "ended before the pause"
    assert load_becomes(stack, lambda running, waiting: (running, waiting) == (0, n))
    assert post(stack, "/continue_generation", {}).status_code == 200
    want = hf_greedy(stack.model, PROMPT, new)
    for thread, answer in requests:
        thread.join(120)
        assert answer and answer[0].status_code == 200, answer
        assert answer[0].json()["output_ids"] == want


@pytest.mark.parametrize(
    "path,body,query,why",
    [
        ("/pause_generation", {"mode": "later"}, {}, "unknown pause mode 'later'"),
        ("/pause_generation", {"mode": 3}, {}, "mode"),
        ("/pause", None, {"mode": "stop"}, "unknown pause mode 'stop'"),
        ("/pause", None, {"clear_cache": "maybe"}, "clear_cache: 'maybe' is not a boolean"),
    ],
)
def test_bad_modes_and_flags_are_a_400(
    stack: Stack, path: str, body: dict | None, query: dict, why: str
) -> None:
    r = post(stack, path, body, **query)
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert not is_paused(stack)
