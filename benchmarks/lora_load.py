"""LoRA adapters loaded and unloaded while the engine serves: how long a load and an unload
take, and what they cost the requests running meanwhile, side by side in one run.

    python benchmarks/lora_load.py [--layers 4] [--rank 16] [--every 8] [--threads 2]

A random Llama of the `small` preset's shape (hidden 1024, GQA 16/4, intermediate 2816) with
`--layers` layers and random rank-`--rank` adapters on all seven projections
(`sluice make-tiny-lora`), in-process with the engine's defaults (the overlap loop; on CPU its
device process), `enable_lora`, adapter `a1` loaded at start.

* Latency: `--loads` loads of fresh names (`Engine.load_lora_adapter`: the folder read, the
  weights placed; through the device process) and as many unloads, the engine idle.
* Serving: `--requests` prompts of `--context` tokens and `--output` greedy tokens
  (`ignore_eos`), half on `a1` and half on the base model, submitted at once and stepped to
  the end; arm "steady" does nothing else, arm "churn" loads an adapter every `--every`
  steps and unloads it `--every` steps later (adapters no request uses: the requests' tokens
  must be the same in both arms). The arms alternate, `--repeat` rounds, the fastest run of
  each counts: wall time, output tokens/s, the median time from one step's return to the
  next's (`median_step_ms`; in churn, the steps not followed by an update) and that of a step
  plus the update after it (`median_step_with_update_ms`).
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


from benchmarks.common import parse_arm_args, print_table, small_model, write_result  # noqa: E402


def serve(engine: Any, prompts: list, args: Any, churn: list[str] | None) -> dict[str, Any]:
    """One run of all prompts, stepped here; with `churn`, its adapters loaded and unloaded
    in turn every `args.every` steps."""
    sched = engine.scheduler
    engine.flush_cache()
    params = engine._params(
        {"max_new_tokens": args.output, "temperature": 0.0, "ignore_eos": True}, len(prompts), {}
    )
    outs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        sched.add_request(f"r{i}", prompt, p, lora_name="a1" if i % 2 else None)
        outs[f"r{i}"] = []
    steps, gaps, last, loaded, updates = 0, [], t0, None, 0
    update_gaps = []  # of the steps followed by an update: step and update together
    while sched.has_work():
        for event in sched.step():
            outs[event.rid] += event.new_token_ids
        steps += 1
        updating = churn is not None and steps % args.every == 0 and sched.has_work()
        if updating:
            if loaded is None:
                loaded = churn[updates // 2 % len(churn)]
                engine.load_lora_adapter("churn", loaded)
            else:
                engine.unload_lora_adapter("churn")
                loaded = None
            updates += 1
        now = time.perf_counter()
        (update_gaps if updating else gaps).append(now - last)
        last = now
    if loaded is not None:
        engine.unload_lora_adapter("churn")
    wall = time.perf_counter() - t0
    tokens = [outs[f"r{i}"] for i in range(len(prompts))]
    return {"wall_s": wall, "tokens": tokens, "median_gap_ms": 1e3 * statistics.median(gaps),
            "median_update_gap_ms": 1e3 * statistics.median(update_gaps) if update_gaps else None,
            "updates": updates}  # fmt: skip


def latency(engine: Any, folders: list[str], n: int) -> dict[str, float]:
    loads, unloads = [], []
    for i in range(n):
        t0 = time.perf_counter()
        engine.load_lora_adapter(f"lat{i}", folders[i % len(folders)])
        t1 = time.perf_counter()
        engine.unload_lora_adapter(f"lat{i}")
        engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1})  # (release)
        loads.append(t1 - t0)
        unloads.append(time.perf_counter() - t1)
    return {"load_ms_median": 1e3 * statistics.median(loads), "load_ms_max": 1e3 * max(loads),
            "unload_and_1_token_ms_median": 1e3 * statistics.median(unloads)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=96)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--every", type=int, default=8, help="steps between two adapter updates")
    ap.add_argument("--loads", type=int, default=8, help="timed loads of the latency part")
    args = parse_arm_args(ap)
    from engine.engine import Engine
    from services.tiny_lora import make_tiny_lora

    path = small_model(args.layers, args.seed)
    folders = [
        make_tiny_lora(path, f"{path}-lora{i}-r{args.rank}", rank=args.rank, seed=i)
        for i in range(1, 5)
    ]
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, 30000) for _ in range(args.context)] for _ in range(args.requests)
    ]
    engine = Engine(
        model_path=path, skip_tokenizer_init=True, enable_lora=True, max_lora_rank=args.rank,
        lora_paths=(f"a1={folders[0]}",),
        max_total_tokens=args.requests * (args.context + args.output) + 256,
    )  # fmt: skip
    try:
        lat = latency(engine, folders[1:], args.loads)
        print(lat, flush=True)
        serve(engine, prompts, args, None)  # warm-up
        runs: dict[str, list[dict[str, Any]]] = {"steady": [], "churn": []}
        for i in range(args.repeat):
            runs["steady"].append(serve(engine, prompts, args, None))
            runs["churn"].append(serve(engine, prompts, args, folders[1:]))
            print(f"round {i + 1}: " + " ".join(
                f"{k} {v[-1]['wall_s']:.2f}s" for k, v in runs.items()), flush=True)  # fmt: skip
    finally:
        engine.shutdown()
    rows = []
    for arm, results in runs.items():
        best = min(results, key=lambda r: r["wall_s"])
        rows.append({
            "arm": arm, "wall_s": best["wall_s"],
            "output_tok_s": sum(map(len, best["tokens"])) / best["wall_s"],
            "median_step_ms": best["median_gap_ms"],
            "median_step_with_update_ms": best["median_update_gap_ms"],
            "adapter_updates": best["updates"], "tokens": best["tokens"],
        })  # fmt: skip
    same = rows[0]["tokens"] == rows[1]["tokens"]
    table = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
    print_table(table, ["arm", "wall_s", "output_tok_s", "median_step_ms",
                        "median_step_with_update_ms", "adapter_updates"])  # fmt: skip
    summary = {
        **lat,
        "churn_vs_steady_throughput": rows[1]["output_tok_s"] / rows[0]["output_tok_s"],
        "step_with_update_vs_steady_step": rows[1]["median_step_with_update_ms"]
        / rows[0]["median_step_ms"],
        "same_tokens": same,
    }
    print(summary)
    print("wrote", write_result("lora_load", table, summary, config=vars(args)))
    if not same:
        raise SystemExit("loading and unloading other adapters changed the requests' tokens")


if __name__ == "__main__":
    main()
