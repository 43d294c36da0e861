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


def test_fp8_checkpoint_serves_the_engines_greedy_tokens(redis_url: str, tmp_path) -> None:
    model = tiny_fp8_model("qwen3", 16)
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=model, max_total_tokens=16384) as engine:
        want = [o["text"] for o in engine.generate(prompt=PROMPTS, sampling_params=params)]
    with start_stack(redis_url, model, str(tmp_path), worker_args=WORKER_TEST_ARGS,
                     router=True) as stack:  # fmt: skip
        stack.wait_ready()
        body = {"model": os.path.basename(model), "prompt": PROMPTS, "max_tokens": 12,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        resp = httpx.post(stack.router_url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    got = [c["text"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]
    assert got == want
    assert all(c["finish_reason"] == "length" for c in resp.json()["choices"])


def test_fp8_kv_cache_worker_serves_the_engines_greedy_tokens(redis_url: str, tmp_path) -> None:
    # (byte-level BPE: with random weights the text holds invalid UTF-8, which a byte-fallback
    # tokenizer's stateless detokenization may render differently, services/detokenize.py)
    model = tiny_model("qwen3")
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=model, max_total_tokens=16384, kv_cache_dtype="fp8") as engine:
        want = [o["text"] for o in engine.generate(prompt=PROMPTS, sampling_params=params)]
    with Engine(model_path=model, max_total_tokens=16384) as engine:
        plain = [o["text"] for o in engine.generate(prompt=PROMPTS, sampling_params=params)]
    worker_args = [*WORKER_TEST_ARGS, "--kv-cache-dtype", "fp8"]
    with start_stack(redis_url, model, str(tmp_path), worker_args=worker_args,
                     router=True) as stack:  # fmt: skip
        stack.wait_ready()
        body = {"model": os.path.basename(model), "prompt": PROMPTS, "max_tokens": 12,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        resp = httpx.post(stack.router_url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    got = [c["text"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]
    assert got == want
    assert got != plain  # the float8 cache changed something (random weights amplify it)
