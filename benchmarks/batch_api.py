"""The Batch API against the same requests sent over HTTP, on one `sluice serve` deployment.

    python benchmarks/batch_api.py [--requests 128] [--output 32] [--rounds 3] [--layers 4]

One deployment (`sluice serve`, one worker of the `small` Llama shape with `--layers`
layers); `--requests` greedy chat requests (distinct prompts, `ignore_eos`, `--output` new
tokens each) two ways, alternating which goes first, each on an empty prefix cache:

* "http": every request sent at once over HTTP (aiohttp, one connection each, answers whole);
* "batch": the same requests as the lines of one input file: `POST /v1/files`,
  `POST /v1/batches`, `GET /v1/batches/{id}` every `--poll-s` (0.1 s) until `completed`,
  then the output file's content downloaded (services/batches.py; the router serves the
  lines in process, all at once since `--batch-concurrency` 256 is above the count).

Reported per arm (medians over rounds): wall time from the first byte sent to the last answer
in hand, output tokens per second, the router process's CPU time per request (psutil: what
the batch's bookkeeping costs the router against HTTP's sockets and parsing), and batch/http
wall time. The greedy answers of the two ways are compared per request (`same_answers`: the
fraction equal). On this shared 2-core VM absolute times are noise; the ratio is the point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from typing import Any

import aiohttp
import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import print_table, small_model, write_result  # noqa: E402
from benchmarks.routing_policy import _post, _wait_http, _wait_ready  # noqa: E402
from services.serve import service_command, spawn, stop_processes  # noqa: E402
from shared.redis_server import free_port  # noqa: E402

CHAT = "/v1/chat/completions"
COLUMNS = ["round", "arm", "requests", "wall_s", "output_tok_s", "router_cpu_ms_per_req",
           "vs_http"]  # fmt: skip
WORDS = "river stone cloud amber lantern meadow copper violet harbor signal orbit maple".split()


def bodies(model: str, n: int, output: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        words = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12))
        out.append({"model": model, "messages": [{"role": "user", "content": f"{i}: {words}"}],
                    "max_tokens": output, "temperature": 0, "ignore_eos": True})  # fmt: skip
    return out


def answers_of(chat: list[dict[str, Any]]) -> tuple[list[str], int]:
    """The texts of whole chat answers, and their output tokens."""
    texts = [c["choices"][0]["message"]["content"] for c in chat]
    return texts, sum(c["usage"]["completion_tokens"] for c in chat)


async def over_http(base: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one(body: dict[str, Any]) -> dict[str, Any]:
            async with session.post(base + CHAT, json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        return await asyncio.gather(*(one(b) for b in requests))


async def as_batch(
    base: str, requests: list[dict[str, Any]], poll_s: float
) -> list[dict[str, Any]]:
    lines = [{"custom_id": str(i), "method": "POST", "url": CHAT, "body": b}
             for i, b in enumerate(requests)]  # fmt: skip
    content = "\n".join(json.dumps(x) for x in lines).encode()
    async with aiohttp.ClientSession() as session:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", content, filename="bench.jsonl")
        async with session.post(base + "/v1/files", data=form) as resp:
            assert resp.status == 200, await resp.text()
            file_id = (await resp.json())["id"]
        body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
        async with session.post(base + "/v1/batches", json=body) as resp:
            assert resp.status == 200, await resp.text()
            batch = await resp.json()
        while batch["status"] != "completed":
            assert batch["status"] in ("validating", "in_progress", "finalizing"), batch
            await asyncio.sleep(poll_s)
            async with session.get(f"{base}/v1/batches/{batch['id']}") as resp:
                batch = await resp.json()
        async with session.get(f"{base}/v1/files/{batch['output_file_id']}/content") as resp:
            out = [json.loads(x) for x in (await resp.text()).splitlines()]
    assert [x["custom_id"] for x in out] == [str(i) for i in range(len(requests))]
    assert batch["request_counts"]["completed"] == len(requests), batch
    return [x["response"]["body"] for x in out]


def router_process(serve: subprocess.Popen) -> psutil.Process:
    for child in psutil.Process(serve.pid).children(recursive=True):
        if "router" in " ".join(child.cmdline()):
            return child
    raise RuntimeError("no router process under sluice serve")


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def run_arm(
    base: str, arm: str, requests: list, router: psutil.Process, poll_s: float
) -> tuple[dict, list]:
    _post(base + "/flush_cache")
    cpu0, start = cpu_s(router), time.perf_counter()
    way = over_http(base, requests) if arm == "http" else as_batch(base, requests, poll_s)
    chat = asyncio.run(way)
    wall = time.perf_counter() - start
    cpu = cpu_s(router) - cpu0
    texts, tokens = answers_of(chat)
    row = {"arm": arm, "requests": len(requests), "wall_s": wall, "output_tok_s": tokens / wall,
           "router_cpu_ms_per_req": 1e3 * cpu / len(requests)}  # fmt: skip
    return row, texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--poll-s", type=float, default=0.1, help="the batch's client polls")
    ap.add_argument("--name", default="batch_api")
    args = ap.parse_args()
    model = small_model(args.layers)
    rows: list[dict[str, Any]] = []
    same: list[float] = []
    with ExitStack() as stack:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
        port = free_port()
        log = stack.enter_context(open(os.path.join(tempfile.gettempdir(), "batch_api.log"), "w"))
        serve = spawn(service_command("serve", "--model", model, "--port", str(port),
                                      "--max-running-requests", "256"),
                      env, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO)  # fmt: skip
        stack.callback(stop_processes, [serve])
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in serve.stdout], daemon=True).start()
        _wait_ready(serve, lines)
        base = f"http://127.0.0.1:{port}"
        _wait_http(base)
        router = router_process(serve)
        requests = bodies(os.path.basename(model), args.requests, args.output)
        asyncio.run(over_http(base, requests[:8]))  # warm-up
        for rnd in range(args.rounds):
            order = ("http", "batch") if rnd % 2 == 0 else ("batch", "http")
            got = {}
            for arm in order:
                row, got[arm] = run_arm(base, arm, requests, router, args.poll_s)
                rows.append({"round": rnd, **row})
            http_wall = next(r["wall_s"] for r in rows[-2:] if r["arm"] == "http")
            for r in rows[-2:]:
                r["vs_http"] = r["wall_s"] / http_wall
            same.append(sum(a == b for a, b in zip(got["http"], got["batch"], strict=True))
                        / len(requests))  # fmt: skip
            print_table(rows[-2:], COLUMNS)
    print_table(rows, COLUMNS)

    def median(arm: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["arm"] == arm)

    summary = {
        "batch_vs_http_wall": median("batch", "vs_http"),
        "http_output_tok_s": median("http", "output_tok_s"),
        "batch_output_tok_s": median("batch", "output_tok_s"),
        "http_router_cpu_ms_per_req": median("http", "router_cpu_ms_per_req"),
        "batch_router_cpu_ms_per_req": median("batch", "router_cpu_ms_per_req"),
        "same_answers": min(same),
    }
    print(summary)
    notes = [f"sluice serve, one worker of the small Llama shape with {args.layers} layers, "
             "embedded Redis; medians over rounds, arms alternating"]  # fmt: skip
    print(write_result(args.name, {"rows": rows}, summary, notes=notes, args=vars(args)))


if __name__ == "__main__":
    main()
