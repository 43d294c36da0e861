"""A worker started with `--tp-size 2` (its model over two rank processes, gloo on CPU) behind
the router, a tokenizer and a detokenizer: its greedy completions are one rank's (the offline
engine's, unsplit), streamed or not; the server reports its size (each worker's `tp_size` in
`internal_states`); a trainer's broadcast through the router reaches both ranks (ranks 1 and 2
of its group) and the completions are then the new checkpoint's; a rank killed stops the worker
with the rank's name in its log."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time

import httpx2 as httpx

from engine.distributed import free_port
from engine.engine import Engine
from tests.factories import tiny_model
from tests.rl_trainer import Trainer
from tests.system.procs import WORKER_TEST_ARGS, start_stack

pytest_plugins = ["tests.redis_fixtures"]

PROMPTS = ["The sky is", "def main():", "Once upon a time"]
PARAMS = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def offline(model: str) -> list[str]:
    with Engine(model_path=model, max_total_tokens=16384) as engine:
        return [o["text"] for o in engine.generate(prompt=PROMPTS, sampling_params=PARAMS)]


def test_split_worker_serves_one_ranks_greedy_tokens(redis_url: str, tmp_path) -> None:
    model, other = tiny_model("qwen3"), tiny_model("qwen3", seed=1)
    want = offline(model)
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
        # a trainer's broadcast: the worker's two ranks are ranks 1 and 2 of its group
        answers = Trainer("--port", str(free_port()), "--world-size", "3", "--checkpoint",
                          other, "--buckets", "2", "--order", "0,1f",
                          "--router", url).answers()  # fmt: skip
        init, *updates, destroy, done = answers
        assert init["status"] == 200 and init["ranks"] == {stack.worker_id: 1}, init
        assert [u["status"] for u in updates] == [200, 200], updates
        assert destroy["status"] == 200 and done == {"call": "done"}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
        choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        new = offline(other)
        assert new != want and [c["text"] for c in choices] == new
        # a rank that dies stops the worker, with its name (compose restarts it; SGLang's
        # server exits the same way), rather than failing every request from then on
        pid = int(re.search(r"the others' pids (\d+)", stack.worker.log()).group(1))
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(url + "/v1/completions", json=body, timeout=10)
        deadline = time.monotonic() + 30
        while stack.worker.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not stack.worker.alive()
        assert "sluice-tp1 exited with code -9" in stack.worker.log(), stack.worker.log()
