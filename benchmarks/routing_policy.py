"""Routing policies over two workers: cache_aware against shortest_queue and round_robin.

One deployment (`sluice serve --dp-size 2`: two workers of the `small` Llama shape, one torch
thread each) with one router per policy on the same workers, so the arms differ only in how
requests are routed. Two workloads, SGLang's bench_serving datasets, sent as token ids with a
bounded concurrency:

* `shared-prefix` (`generated-shared-prefix`): groups of questions behind one long system
  prompt each, shuffled. What cache-aware routing is for: a group's prompts should meet its
  system prompt in one worker's prefix cache instead of in both.
* `unique` (`random`): prompts sharing nothing. Cache-aware routing must then spread them as
  well as the load-based policies do.

Each arm runs on empty caches (`/flush_cache` through its own router, which also empties
cache_aware's tree); the arms alternate order over the rounds, each round on fresh prompts.
Reported per arm: the prefix-cache hit rate of prompt tokens (the router's /metrics), the
requests each worker was sent, TTFT, end-to-end latency and request throughput; ratios are
against shortest_queue in the same round.

    python benchmarks/routing_policy.py [--rounds 2] [--groups 8] [--per-group 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import ExitStack
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_serving import (  # noqa: E402
    build_parser,
    load_tokenizer,
    random_requests,
    run_requests,
    shared_prefix_requests,
    summarize,
)
from benchmarks.common import print_table, small_model, write_result  # noqa: E402
from services.serve import service_command, spawn, stop_processes  # noqa: E402
from shared.redis_server import free_port  # noqa: E402

POLICIES = ("cache_aware", "shortest_queue", "round_robin")
_ROUTED = re.compile(
    r'sluice:router_routed_requests_total\{[^}]*worker_id="([^"]+)",reason="([^"]+)"\} (\S+)'
)
_COUNTER = re.compile(r"^sluice:(prompt_tokens|cached_tokens)_total\{[^}]*\} (\S+)$", re.M)


def _post(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=60) as r:
        r.read()


def _metrics(base: str) -> tuple[dict[str, float], dict[str, float]]:
    """(prompt and cached token counters, requests routed per worker) of one router."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    counters = {name: float(v) for name, v in _COUNTER.findall(text)}
    routed: dict[str, float] = {}
    for worker, _, n in _ROUTED.findall(text):
        routed[worker] = routed.get(worker, 0.0) + float(n)
    return counters, routed


def _wait_ready(proc: subprocess.Popen, lines: queue.Queue, timeout_s: float = 600) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sluice serve exited with {proc.returncode}")
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line.startswith("sluice ready"):
            return line.split("(redis ")[1].split(",")[0]
    raise RuntimeError("sluice serve was not ready in time")


def _wait_http(base: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"router at {base} not healthy")


def start(stack: ExitStack, model: str, args: argparse.Namespace) -> dict[str, str]:
    """The deployment; the base URL of each policy's router."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env["OMP_NUM_THREADS"] = str(args.worker_threads)
    port = free_port()
    log = stack.enter_context(open(os.path.join(tempfile.gettempdir(), "routing_policy.log"), "w"))
    serve = spawn(
        service_command(
            "serve", "--model", model, "--port", str(port), "--dp-size", "2",
            "--policy", POLICIES[0], "--max-total-tokens", str(args.max_total_tokens),
            "--page-size", str(args.page_size), *args.engine_flags.split(),
        ),
        env, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO,
    )  # fmt: skip
    stack.callback(stop_processes, [serve])
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in serve.stdout], daemon=True).start()
    redis_url = _wait_ready(serve, lines)
    routers = {POLICIES[0]: f"http://127.0.0.1:{port}"}
    for policy in POLICIES[1:]:
        p = free_port()
        proc = spawn(
            service_command("router", "--redis-url", redis_url, "--port", str(p),
                            "--model", model, "--policy", policy),
            env, stderr=log, cwd=REPO,
        )  # fmt: skip
        stack.callback(stop_processes, [proc])
        routers[policy] = f"http://127.0.0.1:{p}"
    for base in routers.values():
        _wait_http(base)
    return routers


def run_arm(base: str, requests: list, args: argparse.Namespace) -> dict[str, Any]:
    _post(base + "/flush_cache")
    before, routed_before = _metrics(base)
    run_args = build_parser().parse_args([])
    run_args.backend, run_args.tokenize_prompt = "sluice", True
    run_args.max_concurrency, run_args.disable_tqdm = args.concurrency, True
    run_args.warmup_requests = 0
    outputs, duration = asyncio.run(run_requests(run_args, base, requests, "default"))
    after, routed_after = _metrics(base)
    res = summarize(outputs, duration)
    prompt = after.get("prompt_tokens", 0) - before.get("prompt_tokens", 0)
    cached = after.get("cached_tokens", 0) - before.get("cached_tokens", 0)
    res["cache_hit_rate"] = cached / prompt if prompt else 0.0
    res["routed"] = {w: routed_after[w] - routed_before.get(w, 0.0) for w in sorted(routed_after)}
    return res


def workloads(args: argparse.Namespace, tokenizer: Any, seed: int) -> dict[str, list]:
    p = build_parser().parse_args([])
    p.gsp_num_groups, p.gsp_prompts_per_group = args.groups, args.per_group
    p.gsp_system_prompt_len, p.gsp_question_len = args.system_len, args.question_len
    p.gsp_output_len = args.output_len
    p.num_prompts = args.groups * args.per_group
    p.random_input_len = args.system_len + args.question_len
    p.random_output_len, p.random_range_ratio = args.output_len, 1.0
    return {
        "shared-prefix": shared_prefix_requests(p, tokenizer, seed),
        "unique": random_requests(p, tokenizer, seed),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=384)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2, help="layers of the small-shaped model")
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument(
        "--max-total-tokens", type=int, default=6000,
        help="KV tokens per worker: the system prompts of about 2/3 of the groups (the "
        "regime of a GPU cache smaller than the working set)",
    )
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--engine-flags", default="--disable-overlap-schedule")
    args = ap.parse_args()
    model = small_model(args.layers)
    tokenizer = load_tokenizer(model)
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        routers = start(stack, model, args)
        for rnd in range(args.rounds):
            for name, requests in workloads(args, tokenizer, seed=100 + rnd).items():
                order = POLICIES if rnd % 2 == 0 else POLICIES[::-1]
                for policy in order:
                    res = run_arm(routers[policy], requests, args)
                    assert res["failed"] == 0, res.get("first_error")
                    rows.append({"round": rnd, "workload": name, "policy": policy, **res})
                    print(f"round {rnd} {name:13s} {policy:14s} hit {res['cache_hit_rate']:.2f}"
                          f" ttft {res['mean_ttft_ms']:.0f} ms  {res['duration']:.1f} s"
                          f"  routed {res['routed']}", flush=True)  # fmt: skip
    table, summary = _summarize(rows)
    print_table(table, ["workload", "policy", "cache_hit_rate", "mean_ttft_ms", "p99_ttft_ms",
                        "mean_e2e_latency_ms", "request_throughput", "throughput_vs_sq",
                        "ttft_vs_sq", "routed"])  # fmt: skip
    write_result("routing_policy", {"runs": rows, "table": table}, summary,
                 config=vars(args), model=model)  # fmt: skip


def _summarize(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per workload and policy: the means over rounds, and the per-round ratios against
    shortest_queue (geometric mean)."""
    table, summary = [], {}
    for name in dict.fromkeys(r["workload"] for r in rows):
        base = {r["round"]: r for r in rows if r["workload"] == name
                and r["policy"] == "shortest_queue"}  # fmt: skip
        for policy in POLICIES:
            runs = [r for r in rows if r["workload"] == name and r["policy"] == policy]
            tput = [r["request_throughput"] / base[r["round"]]["request_throughput"] for r in runs]
            ttft = [base[r["round"]]["mean_ttft_ms"] / r["mean_ttft_ms"] for r in runs]
            routed: dict[str, float] = {}
            for r in runs:
                for w, n in r["routed"].items():
                    routed[w] = routed.get(w, 0.0) + n
            row = {
                "workload": name,
                "policy": policy,
                **{k: float(np.mean([r[k] for r in runs])) for k in (
                    "cache_hit_rate", "mean_ttft_ms", "p99_ttft_ms", "mean_e2e_latency_ms",
                    "request_throughput")},
                "throughput_vs_sq": float(np.exp(np.mean(np.log(tput)))),
                "ttft_vs_sq": float(np.exp(np.mean(np.log(ttft)))),
                "routed": "/".join(str(int(routed[w])) for w in sorted(routed)),
            }  # fmt: skip
            table.append(row)
            key = f"{name.replace('-', '_')}_{policy}"
            summary[f"{key}_cache_hit_rate"] = row["cache_hit_rate"]
            summary[f"{key}_throughput_vs_shortest_queue"] = row["throughput_vs_sq"]
            summary[f"{key}_ttft_speedup_vs_shortest_queue"] = row["ttft_vs_sq"]
    return table, summary


if __name__ == "__main__":
    main()
