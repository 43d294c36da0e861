"""Hierarchical cache (host memory behind the device's KV pool) against the plain radix cache,
side by side, on a multi-turn workload whose conversations do not fit the device pool.

    python benchmarks/hicache.py [--clients 16] [--turns 4] [--context 512] [--rounds 2]

SGLang's multi-turn benchmark (`bench_multiturn`), in process: `--clients` conversations,
each starting with a `--context`-token document; a turn appends a `--question`-token
question and generates `--output` tokens (greedy, `ignore_eos`), and the next turn's prompt is
the whole conversation so far. `--concurrency` turns run at a time, the conversations taking
turns in round-robin order, so a conversation comes back after every other one has had a
turn: its context has left a device pool of `--device-tokens` tokens by then. The hierarchical
arm keeps it in a host pool (`--hicache-ratio` x the device pool) and loads it back.

TTFT is measured from a turn's `add_request` to the scheduler step that returns its first
token (the engine runs in this process, as a worker does, with the overlap scheduler and its
device process unless `--disable-overlap`). Reported per arm: prompt tokens served from
cache (device or host), mean and p50 TTFT, turns per second, and, for hicache, tokens loaded
back from host memory; then hicache/radix ratios. `--rounds` runs both arms that many times,
alternating their order; the JSON has every run, the summary the medians. Both arms must
generate the same tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import print_table, small_model, write_result  # noqa: E402


def workload(args: Any) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each client's document, and its questions per turn."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 30000) for _ in range(n)]

    docs = [tokens(args.context) for _ in range(args.clients)]
    questions = [[tokens(args.question) for _ in range(args.turns)] for _ in range(args.clients)]
    return docs, questions


def run_arm(path: str, hicache: bool, args: Any) -> dict[str, Any]:
    from engine.engine import Engine
    from engine.sampling.sampling_params import SamplingParams

    docs, questions = workload(args)
    jobs = [(c, t) for t in range(args.turns) for c in range(args.clients)]  # round robin
    history = [list(d) for d in docs]
    outputs: dict[tuple[int, int], list[int]] = {}
    ttft: list[float] = []
    prompt_tokens = cached_tokens = 0
    engine = Engine(
        model_path=path,
        skip_tokenizer_init=True,
        max_total_tokens=args.device_tokens,
        chunked_prefill_size=args.chunk,
        disable_overlap_schedule=args.disable_overlap,
        enable_hierarchical_cache=hicache,
        hicache_ratio=args.hicache_ratio,
        page_size=args.page_size,
    )
    try:
        sched = engine.scheduler
        in_flight: dict[str, tuple[int, int, float, bool]] = {}  # rid -> client, turn, t0, seen
        next_job = 0
        t_start = time.perf_counter()
        while next_job < len(jobs) or in_flight:
            while next_job < len(jobs) and len(in_flight) < args.concurrency:
                c, t = jobs[next_job]
                if any(ic == c for ic, *_ in in_flight.values()):
                    break  # its previous turn is still running (fewer clients than slots)
                next_job += 1
                prompt = history[c] + questions[c][t]
                rid = f"c{c}-t{t}"
                params = SamplingParams(max_new_tokens=args.output, temperature=0.0,
                                        ignore_eos=True)  # fmt: skip
                sched.add_request(rid, prompt, params)
                in_flight[rid] = (c, t, time.perf_counter(), False)
                history[c] = prompt
            for ev in sched.step():
                c, t, t0, seen = in_flight[ev.rid]
                if not seen and ev.new_token_ids:
                    ttft.append(time.perf_counter() - t0)
                    in_flight[ev.rid] = (c, t, t0, True)
                if ev.finished_reason is not None:
                    req = ev.req
                    outputs[(c, t)] = list(req.output_ids)
                    history[c] = history[c] + list(req.output_ids)
                    prompt_tokens += len(req.origin_input_ids)
                    cached_tokens += req.cached_tokens
                    del in_flight[ev.rid]
        wall = time.perf_counter() - t_start
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    return {
        "arm": "hicache" if hicache else "radix",
        "turns": len(jobs),
        "prompt_tokens": prompt_tokens,
        "cache_hit_rate": cached_tokens / prompt_tokens,
        "host_loaded_tokens": stats.get("hicache_loaded_tokens", 0),
        "host_stored_tokens": stats.get("hicache_stored_tokens", 0),
        "mean_ttft_ms": 1000 * statistics.mean(ttft),
        "p50_ttft_ms": 1000 * statistics.median(ttft),
        "wall_s": wall,
        "turns_per_s": len(jobs) / wall,
        "outputs": [outputs[k] for k in sorted(outputs)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4, help="of the `small` Llama shape")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context", type=int, default=512, help="document tokens per client")
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--output", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--device-tokens", type=int, default=3072, help="the device KV pool")
    ap.add_argument("--hicache-ratio", type=float, default=4.0)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--disable-overlap", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = small_model(args.layers, seed=args.seed)
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for hicache in ((False, True) if r % 2 == 0 else (True, False)):
            res = run_arm(path, hicache, args)
            res["round"] = r
            runs.append(res)
            print(f"round {r} {res['arm']}: {res['wall_s']:.1f} s", flush=True)
    columns = [
        "round", "arm", "turns", "cache_hit_rate", "host_loaded_tokens", "mean_ttft_ms",
        "p50_ttft_ms", "wall_s", "turns_per_s",
    ]  # fmt: skip
    table = [{k: v for k, v in r.items() if k != "outputs"} for r in runs]
    print_table(table, columns)

    def median(arm: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["arm"] == arm)

    summary = {
        "cache_hit_rate_radix": median("radix", "cache_hit_rate"),
        "cache_hit_rate_hicache": median("hicache", "cache_hit_rate"),
        "mean_ttft_radix_over_hicache": median("radix", "mean_ttft_ms")
        / median("hicache", "mean_ttft_ms"),
        "p50_ttft_radix_over_hicache": median("radix", "p50_ttft_ms")
        / median("hicache", "p50_ttft_ms"),
        "throughput_hicache_over_radix": median("hicache", "turns_per_s")
        / median("radix", "turns_per_s"),
        "same_tokens": all(r["outputs"] == runs[0]["outputs"] for r in runs),
    }
    print(summary)
    print("wrote", write_result("hicache", table, summary, config=vars(args)))
    if not summary["same_tokens"]:
        raise SystemExit("the arms generated different tokens")


if __name__ == "__main__":
    main()
