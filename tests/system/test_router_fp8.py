"""FP8 through the router, a tokenizer, a worker and a detokenizer: an FP8 checkpoint (no flag:
its config says FP8), and a worker started with `--kv-cache-dtype fp8`. Greedy completions are
the offline engine's on the same model and settings."""

from __future__ import annotations

import os

import httpx2 as httpx

from engine.engine import Engine
from tests.factories import tiny_fp8_model, tiny_model
from tests.system.procs import WORKER_TEST_ARGS, start_stack

pytest_plugins = ["tests.redis_fixtures"]

PROMPTS = ["The sky is", "def main():", "你好"]
PARAMS = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def _served(redis_url: str, model: str, tmp_path, worker_args) -> list[str]:
    """PROMPTS' greedy completions through the router of a stack on `model`."""
    with start_stack(redis_url, model, str(tmp_path), worker_args=worker_args,
                     router=True) as stack:  # fmt: skip
        stack.wait_ready()
        body = {"model": os.path.basename(model), "prompt": PROMPTS, "max_tokens": 12,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        resp = httpx.post(stack.router_url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    assert all(c["finish_reason"] == "length" for c in choices)
    return [c["text"] for c in choices]


def _offline(model: str, **engine_kwargs) -> list[str]:
    with Engine(model_path=model, max_total_tokens=16384, **engine_kwargs) as engine:
        return [o["text"] for o in engine.generate(prompt=PROMPTS, sampling_params=PARAMS)]


def test_fp8_checkpoint_serves_the_engines_greedy_tokens(redis_url: str, tmp_path) -> None:
    model = tiny_fp8_model("qwen3", 16)
    assert _served(redis_url, model, tmp_path, WORKER_TEST_ARGS) == _offline(model)


def test_fp8_kv_cache_worker_serves_the_engines_greedy_tokens(redis_url: str, tmp_path) -> None:
    # (byte-level BPE: with random weights the text holds invalid UTF-8, which a byte-fallback
    # tokenizer's stateless detokenization may render differently, services/detokenize.py)
    model = tiny_model("qwen3")
    want = _offline(model, kv_cache_dtype="fp8")
    assert want != _offline(model)  # the float8 cache changed something (random weights)
    worker_args = [*WORKER_TEST_ARGS, "--kv-cache-dtype", "fp8"]
    assert _served(redis_url, model, tmp_path, worker_args) == want
