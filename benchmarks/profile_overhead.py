"""What `/start_profile` costs: the engine's throughput with the torch profiler on (as the
worker runs it: services/worker_profile.py, over every thread and the device process) against
off, side by side, and how long writing the traces takes and how big they are.

    python benchmarks/profile_overhead.py [--model /tmp/bench-m2] [--reps 3]

Per CPU overlap executor (the default device process, and the forward thread): the same
batch of greedy requests (`--prompts` x `--tokens`, ignore_eos) is generated with the
profiler off and on, alternated `--reps` times; the medians' ratio is the overhead. The
traces' writing (after the stop) is timed apart, as the worker pays it once per profile.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_result  # noqa: E402
from engine.engine import Engine  # noqa: E402
from services.worker_profile import StepProfiler  # noqa: E402
from shared.messages import ProfileReqMsg  # noqa: E402

COLUMNS = ["executor", "off_s", "on_s", "on_vs_off", "write_s", "trace_mb", "tok_s_off"]


def run(engine: Engine, prompts: list[str], tokens: int) -> float:
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - start


def measure(model: str, executor: str, args: argparse.Namespace) -> dict:
    prompts = [f"request {i} asks about the weather in city {i}" for i in range(args.prompts)]
    off, on, writes, sizes = [], [], [], []
    engine = Engine(model_path=model, cpu_overlap_executor=executor, max_total_tokens=40000,
                    max_running_requests=64)  # fmt: skip
    with engine, tempfile.TemporaryDirectory() as out:
        run(engine, prompts[:2], 4)  # warm up
        for rep in range(args.reps):
            off.append(run(engine, prompts, args.tokens))
            prof = StepProfiler("bench", out, engine.scheduler.executor)
            ok, note = prof.start(ProfileReqMsg("q", "r", "start", profile_id=f"{executor}{rep}",
                                                activities=["CPU"]))  # fmt: skip
            assert ok, note
            on.append(run(engine, prompts, args.tokens))
            start = time.perf_counter()
            ok, note, paths = prof.stop()
            assert ok, note
            writes.append(time.perf_counter() - start)
            sizes.append(sum(os.path.getsize(p) for p in paths) / 1e6)
    off_s, on_s = statistics.median(off), statistics.median(on)
    return {"executor": executor, "off_s": off_s, "on_s": on_s, "on_vs_off": on_s / off_s,
            "write_s": statistics.median(writes), "trace_mb": statistics.median(sizes),
            "tok_s_off": args.prompts * args.tokens / off_s}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the tiny model)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (intra-op)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from services.engine_args import ensure_model

    model = ensure_model(args.model)
    rows = [measure(model, executor, args) for executor in ("process", "thread")]
    print_table(rows, COLUMNS)
    summary = {f"profiled_vs_not_{r['executor']}": r["on_vs_off"] for r in rows}
    summary |= {f"trace_write_s_{r['executor']}": r["write_s"] for r in rows}
    notes = ["CPU activity only; gzipped Chrome traces; medians over reps, off and on "
             "alternated; the write is the stop's (both traces for the device process)"]
    print(write_result("profile_overhead", rows, summary, model=model, prompts=args.prompts,
                       tokens=args.tokens, reps=args.reps, notes=notes))  # fmt: skip


if __name__ == "__main__":
    main()
