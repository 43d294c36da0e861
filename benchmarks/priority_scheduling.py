"""Priority scheduling on vs off, in-process, side by side: what it gives the urgent requests
and what it costs everything else.

    OMP_NUM_THREADS=1 python benchmarks/priority_scheduling.py --model /tmp/bench-m2 [--pairs 3]

A backlog of `--num-low` background requests (priority 0, `--low-input` prompt tokens ±25%,
`--low-output` output tokens, ignore_eos) is queued at once on an engine that runs at most
`--max-running` requests; then `--num-high` urgent requests (priority 100, `--high-input` /
`--high-output` tokens) arrive one every `--high-every` steps, from step `--high-start`.
Arrivals are counted in scheduler steps, so both sides see the same arrivals relative to
their progress; latencies are wall time from the request's arrival (its `add_request`) to
its first token (TTFT) and to its last token (e2e).

* `off`: the default scheduler (fcfs): an urgent request waits behind the whole backlog.
* `on`: `--enable-priority-scheduling` (SGLang's default threshold, 10): an urgent request
  goes to the head of the waiting queue, and preempts a running background request when no
  request slot or KV room is free (that one goes back to waiting, keeps its output, and is
  prefilled again when readmitted: the cost).

Both engines run with their CPU defaults (the overlap scheduler's device process) and are
built first; each pair runs them on fresh prompts, alternating which goes first. Reported
per run: the urgent requests' TTFT and e2e (p50, max), the background requests' e2e p50,
output throughput over the whole run, and the preemptions; as summary, medians over pairs
of off/on for the urgent TTFT and e2e, and on/off for throughput and background e2e.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_result  # noqa: E402

COLUMNS = ["pair", "way", "high_ttft_p50_ms", "high_ttft_max_ms", "high_e2e_p50_ms",
           "high_e2e_max_ms", "low_e2e_p50_s", "output_tok_s", "preempted"]  # fmt: skip


def build(model: str, on: bool, max_running: int) -> Any:
    from engine.config import EngineArgs
    from engine.engine import build_scheduler

    args = EngineArgs.from_kwargs(
        model_path=model, max_running_requests=max_running, enable_priority_scheduling=on
    )
    return build_scheduler(args)


def workload(ns: argparse.Namespace, vocab: int, seed: int) -> dict[int, list[tuple]]:
    """Step index → [(rid, prompt ids, max_new_tokens, priority)]."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(rng.randint(n * 3 // 4, n * 5 // 4))]

    arrivals: dict[int, list[tuple]] = {0: []}
    for i in range(ns.num_low):
        arrivals[0].append((f"low{i}", prompt(ns.low_input), ns.low_output, 0))
    for i in range(ns.num_high):
        step = ns.high_start + i * ns.high_every
        urgent = (f"high{i}", prompt(ns.high_input), ns.high_output, 100)
        arrivals.setdefault(step, []).append(urgent)
    return arrivals


def run(scheduler: Any, arrivals: dict[int, list[tuple]], on: bool) -> dict[str, Any]:
    from engine.sampling.sampling_params import SamplingParams

    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens = 0
    retractions0 = scheduler.stats.num_retractions
    last_step = max(arrivals)
    step = 0
    t0 = time.perf_counter()
    while step <= last_step or scheduler.has_work():
        for rid, ids, max_new, priority in arrivals.get(step, []):
            params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
            params.verify()
            scheduler.add_request(rid, ids, params.normalize(), priority if on else None)
            arrived[rid] = time.perf_counter()
        events = scheduler.step()
        now = time.perf_counter()
        for ev in events:
            if ev.new_token_ids:
                first.setdefault(ev.rid, now)
                tokens += len(ev.new_token_ids)
            if ev.finished_reason is not None:
                done[ev.rid] = now
        step += 1
    wall = time.perf_counter() - t0
    high = [r for r in arrived if r.startswith("high")]
    low = [r for r in arrived if r.startswith("low")]
    ttft = [1e3 * (first[r] - arrived[r]) for r in high]
    e2e = [1e3 * (done[r] - arrived[r]) for r in high]
    return {
        "high_ttft_p50_ms": float(np.median(ttft)),
        "high_ttft_max_ms": max(ttft),
        "high_e2e_p50_ms": float(np.median(e2e)),
        "high_e2e_max_ms": max(e2e),
        "low_e2e_p50_s": float(np.median([done[r] - arrived[r] for r in low])),
        "output_tok_s": tokens / wall,
        "preempted": scheduler.stats.num_retractions - retractions0,
        "steps": step,
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--num-low", type=int, default=48)
    p.add_argument("--low-input", type=int, default=128)
    p.add_argument("--low-output", type=int, default=96)
    p.add_argument("--num-high", type=int, default=8)
    p.add_argument("--high-input", type=int, default=64)
    p.add_argument("--high-output", type=int, default=16)
    p.add_argument("--high-start", type=int, default=20)
    p.add_argument("--high-every", type=int, default=25)
    p.add_argument("--result-name", default="priority_scheduling")
    ns = p.parse_args()

    from engine.config import ModelConfig

    vocab = ModelConfig.from_pretrained(ns.model).vocab_size
    engines = {way: build(ns.model, way == "on", ns.max_running) for way in ("off", "on")}
    rows: list[dict[str, Any]] = []
    try:
        for pair in range(ns.pairs):
            arrivals = workload(ns, vocab, seed=pair)
            order = ("off", "on") if pair % 2 == 0 else ("on", "off")
            for way in order:
                rows.append({"pair": pair, "way": way, **run(engines[way], arrivals, way == "on")})
                print_table(rows[-1:], COLUMNS)
    finally:
        for scheduler in engines.values():
            scheduler.close()
    print()
    rows.sort(key=lambda r: (r["pair"], r["way"]))
    print_table(rows, COLUMNS)

    def ratio(key: str, num: str, den: str) -> float:
        by_pair = {(r["pair"], r["way"]): r[key] for r in rows}
        return statistics.median(
            by_pair[(i, num)] / by_pair[(i, den)] for i in range(ns.pairs)
        )

    summary = {
        "high_ttft_off_over_on": ratio("high_ttft_p50_ms", "off", "on"),
        "high_e2e_off_over_on": ratio("high_e2e_p50_ms", "off", "on"),
        "throughput_on_over_off": ratio("output_tok_s", "on", "off"),
        "low_e2e_on_over_off": ratio("low_e2e_p50_s", "on", "off"),
        "preempted_per_run_on": statistics.median(r["preempted"] for r in rows if r["way"] == "on"),
    }
    print("\nsummary (medians over pairs):", summary)
    path = write_result(ns.result_name, rows, summary, settings=vars(ns))
    print("wrote", path)


if __name__ == "__main__":
    main()
