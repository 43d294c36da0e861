"""`sluice serve`: an embedded Redis and every service as children; ready, serving, and
gone without a trace after SIGTERM."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import urllib.request

import redis

from services.serve import count_live, port_open, service_command, spawn
from shared.bus import Bus
from shared.redis_server import free_port
from tests.factories import tiny_model
from tests.system.procs import read_lines, router_available
from tests.system.stream_client import StreamClient

READY_TIMEOUT_S = 300


def children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")  # a zombie has exited
    except FileNotFoundError:
        return True


def test_serve_runs_every_service_and_stops_cleanly(tmp_path) -> None:
    model = tiny_model("llama")
    port = free_port()
    command = service_command(
        "serve", "--model", model, "--port", str(port), "--tokenizers", "1",
        "--detokenizers", "2", "--max-total-tokens", "16384",
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    with open(tmp_path / "serve.log", "wb") as log:
        proc = spawn(command, env, stdout=subprocess.PIPE, stderr=log, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        ready = lines.get(timeout=READY_TIMEOUT_S)
        assert ready.startswith("sluice ready"), ready
        url = ready.split("(redis ")[1].split(",")[0]
        client = redis.Redis.from_url(url)
        assert count_live(client, "sluice") == {"worker": 1, "tokenizer": 1, "detokenizer": 2}
        children = children_of(proc.pid)
        with_router = router_available()
        assert len(children) == 1 + 1 + 1 + 2 + with_router  # redis, worker, tok, detoks

        stream_client = StreamClient(Bus(client, "sluice"), "0")
        rid = stream_client.request(text="Hello", sampling_params={"max_new_tokens": 6})
        assert stream_client.wait([rid], timeout_s=60)[rid].final.completion_tokens == 6
        if with_router:
            body = {"text": "Hello", "sampling_params": {"max_new_tokens": 6}}
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(), method="POST"
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                out = json.load(resp)
            assert out["meta_info"]["completion_tokens"] == 6
        client.close()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert all(gone(pid) for pid in children), [p for p in children if not gone(p)]
        assert not port_open("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0]))
        assert not port_open("127.0.0.1", port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
