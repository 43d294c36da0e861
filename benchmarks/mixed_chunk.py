"""Mixed chunk (`--enable-mixed-chunk`) on vs off, in-process, side by side.

    python benchmarks/mixed_chunk.py --model /tmp/bench-m2 [--pairs 4] [--threads 1]

Without mixing, every prefill step (a new prompt, or one chunk of a long one) is a pause for
the running requests: their next token waits for the prefill step and then for a decode
step. With mixing, the running requests' decode step rides inside the prefill batch. Two
workloads, each through the in-process engine's closed loop (the one of the serving
benchmark: at most `concurrency` requests in flight, a finished one replaced at once):

* `short`: the disaggregation benchmark's, 64-token prompts (±50%), ≤ 128 output tokens,
  concurrency 64: short prompts arriving as others finish.
* `long`: 1024-token prompts, ≤ 64 output tokens, concurrency 16, chunked prefill 256: each
  prompt is prefilled in four chunks, each a pause for up to 15 decoding requests.

Both engines (off and on) are built first; each pair runs them one after the other on fresh
prompts, alternating which goes first. Reported per workload: output throughput, TTFT and
ITL (p50/p99) of each side, the steps each took by kind, and as summary the medians over
pairs of on/off ratios. On a CPU a forward costs about its number of tokens, so mixing saves
the per-step overhead and the decode step's fixed costs, not the decode tokens' compute; on
a GPU the decode part of a mixed batch is nearly free (decode is bound by reading weights).

The recorded result (`results/mixed_chunk.json`) came from `OMP_NUM_THREADS=1 python
benchmarks/mixed_chunk.py --model /tmp/bench-m2 --pairs 4`, with the model of the serving
benchmark (`bench_serving.py`'s docstring says how to make it).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_serving import load_tokenizer, random_requests  # noqa: E402
from benchmarks.common import print_table, write_result  # noqa: E402
from benchmarks.serving_disagg import make_engine, run_inprocess  # noqa: E402

WORKLOADS: dict[str, dict[str, Any]] = {
    "short": {
        "input_len": 64,
        "output_len": 128,
        "range_ratio": 0.5,
        "num_prompts": 192,
        "concurrency": 64,
        "flags": [],
    },
    "long": {
        "input_len": 1024,
        "output_len": 64,
        "range_ratio": 0.9,
        "num_prompts": 48,
        "concurrency": 16,
        "flags": ["--chunked-prefill-size", "256"],
    },
}
COLUMNS = [
    "workload",
    "pair",
    "mixed",
    "output_tok_s",
    "ttft_p50_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "prefill_steps",
    "mixed_steps",
    "decode_steps",
]


def _requests(tokenizer: Any, spec: dict[str, Any], seed: int) -> list:
    ns = argparse.Namespace(
        num_prompts=spec["num_prompts"],
        random_input_len=spec["input_len"],
        random_output_len=spec["output_len"],
        random_range_ratio=spec["range_ratio"],
    )
    return random_requests(ns, tokenizer, seed)


def _row(workload: str, pair: int, mixed: bool, res: dict[str, Any]) -> dict[str, Any]:
    steps = res["steps"]
    return {
        "workload": workload,
        "pair": pair,
        "mixed": mixed,
        "output_tok_s": res["output_throughput"],
        "ttft_p50_ms": res["median_ttft_ms"],
        "itl_p50_ms": res["median_itl_ms"],
        "itl_p99_ms": res["p99_itl_ms"],
        "mean_e2e_ms": res["mean_e2e_latency_ms"],
        "prefill_steps": steps["prefill_steps"],
        "mixed_steps": steps["mixed_steps"],
        "decode_steps": steps["decode_steps"],
        "completed": res["completed"],
    }


def run_workload(name: str, model: str, flags: list[str], pairs: int, seed: int) -> list[dict]:
    spec = WORKLOADS[name]
    tokenizer = load_tokenizer(model)
    base = [*flags, *spec["flags"]]
    engines = {
        False: make_engine(model, base),
        True: make_engine(model, [*base, "--enable-mixed-chunk"]),
    }
    rows = []
    try:
        for k in range(pairs):
            requests = _requests(tokenizer, spec, seed + k)
            for mixed in (k % 2 == 1, k % 2 == 0):  # alternate who goes first
                res = run_inprocess(engines[mixed], requests, spec["concurrency"])
                assert res["completed"] == len(requests), res.get("first_error")
                rows.append(_row(name, k, mixed, res))
    finally:
        for engine in engines.values():
            engine.shutdown()
    return rows


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Per workload, medians over pairs of the on/off ratio of each figure."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["workload"] for r in rows):
        by_pair: dict[int, dict[bool, dict]] = {}
        for r in rows:
            if r["workload"] == name:
                by_pair.setdefault(r["pair"], {})[r["mixed"]] = r

        def ratio(key: str, by_pair: dict = by_pair) -> float:
            return float(np.median([p[True][key] / p[False][key] for p in by_pair.values()]))

        out[f"{name}_output_tok_s_on_vs_off"] = ratio("output_tok_s")
        out[f"{name}_itl_p50_on_vs_off"] = ratio("itl_p50_ms")
        out[f"{name}_itl_p99_on_vs_off"] = ratio("itl_p99_ms")
        out[f"{name}_ttft_p50_on_vs_off"] = ratio("ttft_p50_ms")
        out[f"{name}_mean_e2e_on_vs_off"] = ratio("mean_e2e_ms")
        out[f"{name}_steps_on_vs_off"] = float(
            np.median(
                [
                    sum(p[True][k] for k in ("prefill_steps", "mixed_steps", "decode_steps"))
                    / sum(p[False][k] for k in ("prefill_steps", "mixed_steps", "decode_steps"))
                    for p in by_pair.values()
                ]
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the tiny model)")
    ap.add_argument("--workloads", default="short,long")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (intra-op)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--engine-flags",
        default="--max-total-tokens 40000 --max-running-requests 64 --disable-overlap-schedule",
        help="flags for both engines (mixed chunk is added to one)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from services.engine_args import ensure_model

    model = ensure_model(args.model)
    flags = shlex.split(args.engine_flags)
    rows: list[dict] = []
    for name in args.workloads.split(","):
        rows += run_workload(name, model, flags, args.pairs, args.seed)
    print_table(rows, COLUMNS)
    summary = summarize(rows)
    for k, v in summary.items():
        print(f"{k}: {v:.3f}")
    path = write_result(
        "mixed_chunk",
        rows,
        summary,
        model=model,
        engine_flags=args.engine_flags,
        workloads={n: WORKLOADS[n] for n in args.workloads.split(",")},
        loadavg_after=os.getloadavg(),
    )
    print("wrote", path)


if __name__ == "__main__":
    main()
