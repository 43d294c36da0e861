"""A worker started with `--tp-size 2` (its model over two rank processes, gloo on CPU) behind
the router, a tokenizer and a detokenizer: its greedy completions are one rank's (the offline
engine's, unsplit), streamed or not, and the server reports its size (each worker's `tp_size`
in `internal_states`)."""

from __future__ import annotations

import json
import os

import httpx2 as httpx

from engine.engine import Engine
from tests.factories import tiny_model
from tests.system.procs import WORKER_TEST_ARGS, start_stack

pytest_plugins = ["tests.redis_fixtures"]

PROMPTS = ["The sky is", "def main():", "Once upon a time"]
PARAMS = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def test_split_worker_serves_one_ranks_greedy_tokens(redis_url: str, tmp_path) -> None:
    model = tiny_model("qwen3")
    with Engine(model_path=model, max_total_tokens=16384) as engine:
        want = [o["text"] for o in engine.generate(prompt=PROMPTS, sampling_params=PARAMS)]
    worker_args = [*WORKER_TEST_ARGS, "--tp-size", "2"]
    with start_stack(redis_url, model, str(tmp_path), worker_args=worker_args,
                     router=True) as stack:  # fmt: skip
        stack.wait_ready()
        url, name = stack.router_url, os.path.basename(model)
        body = {"model": name, "prompt": PROMPTS, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in choices] == want
        streamed = ""
        one = {**body, "prompt": PROMPTS[0], "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=one, timeout=60) as events:
            for line in events.iter_lines():
                if line.startswith("data: {"):
                    streamed += json.loads(line[6:])["choices"][0]["text"]
        assert streamed == want[0]
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        assert [w["tp_size"] for w in info["internal_states"]] == [2], info
