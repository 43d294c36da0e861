"""overlap: decode at batch 64 and 256, the overlap scheduler on vs off: throughput of whole
runs, host step time, the GPU's idle time per decode step (see gpu_bench.py), and where the
host's step goes (`gpu_timeline.host_split`: launching, the graph launch inside it, waiting
for the previous batch, the rest)."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks.common import print_table
from benchmarks.gpu_common import (
    Ctx,
    build_model,
    finish,
    make_engine,
    random_prompts,
    release,
    vocab_size,
)
from benchmarks.gpu_timeline import (
    Profiled,
    StepEvents,
    drive,
    event_idle_fraction,
    host_split,
    timeline,
)


def overlap(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    path = build_model(ctx, args.overlap_preset)
    sizes = [4, 8] if ctx.quick else args.batch_sizes
    prompt_len, new = (16, 24) if ctx.quick else (128, 160)
    window = (4, 12) if ctx.quick else (16, 96)
    vocab = vocab_size(path)
    rows: list[dict[str, Any]] = []
    for on in (True, False):
        with make_engine(ctx, path, disable_overlap_schedule=not on,
                         max_running_requests=max(sizes)) as engine:
            for bs in sizes:
                rows.append(_overlap_case(ctx, engine, vocab, bs, on, prompt_len, new, window))
        del engine  # its KV pool holds most of the GPU's memory
        release(ctx)
    results: dict[str, Any] = {"model": f"{args.overlap_preset} shape", "dtype": ctx.dtype,
                               "prompt_len": prompt_len, "new_tokens": new, "cases": rows}
    summary: dict[str, Any] = {}
    per_bs = {}
    for bs in sizes:
        on_row, off_row = (next(r for r in rows if r["batch"] == bs and r["overlap"] == o)
                           for o in (True, False))
        per_bs[bs] = {"throughput_on_vs_off": on_row["tok_s"] / off_row["tok_s"],
                      "idle_fraction_on": on_row["idle_fraction"],
                      "idle_fraction_off": off_row["idle_fraction"],
                      "idle_fraction_on_profiled": on_row["idle_fraction_profiled"]}
    results["on_vs_off"] = per_bs
    idle = [v["idle_fraction_on"] for v in per_bs.values() if v["idle_fraction_on"] is not None]
    summary["gpu_idle_fraction_overlap"] = max(idle) if idle else None
    summary["overlap_on_vs_off_throughput"] = {
        f"bs{bs}": v["throughput_on_vs_off"] for bs, v in per_bs.items()}
    print_table(rows, ["batch", "overlap", "tok_s", "host_step_ms", "gpu_step_ms",
                       "gpu_busy_ms_per_step", "idle_fraction", "gap_ms_per_step",
                       "profiled_step_ms", "idle_fraction_profiled"])
    print_table(rows, ["batch", "overlap", "host_step_ms", "host_launch_forward_ms",
                       "host_graph_launch_ms", "host_wait_ms", "host_other_ms"])
    return finish(ctx, "overlap", results, summary)


def _overlap_case(ctx: Ctx, engine: Any, vocab: int, bs: int, on: bool, prompt_len: int,
                  new: int, window: tuple[int, int]) -> dict[str, Any]:
    def prompts(seed: int) -> list[list[int]]:
        return random_prompts(vocab, bs, prompt_len, seed)

    drive(engine, prompts(ctx.seed + 100 + bs), min(new, 16))  # warm-up
    engine.flush_cache()
    run = drive(engine, prompts(ctx.seed + bs), new)
    engine.flush_cache()
    tl = timeline(ctx, engine, prompts(ctx.seed + 200 + bs), new, window)
    engine.flush_cache()
    events = drive(engine, prompts(ctx.seed + 500 + bs), new, StepEvents(ctx, engine),
                   window).timeline or {}
    busy = tl.get("busy_ms_per_step")
    row = {"batch": bs, "overlap": on, "tokens": run.num_tokens,
           "tok_s": run.num_tokens / run.seconds,
           "seconds": run.seconds, "host_step_ms": 1e3 * statistics.median(run.decode_step_s),
           "gpu_step_ms": events.get("period_ms"), "gpu_busy_ms_per_step": busy,
           # the unprofiled step: busy (the profiled run's kernels) over the events' period
           "idle_fraction": event_idle_fraction(busy, events.get("period_ms")),
           "gap_ms_per_step": events.get("gap_ms_per_step"),
           # inside the kernel-only trace, whose host is slower (`StepEvents`)
           "profiled_step_ms": tl.get("step_ms"),
           "idle_fraction_profiled": tl.get("idle_fraction"),
           "bubble_fraction_profiled": tl.get("bubble_fraction"),
           "gpu_timeline": tl, "step_events": events}
    engine.flush_cache()
    row.update(host_split(engine, prompts(ctx.seed + 400 + bs), new))
    if ctx.profile:
        engine.flush_cache()
        name = ctx.name(f"overlap_bs{bs}_{'on' if on else 'off'}_profile")
        row["profile"] = drive(engine, prompts(ctx.seed + 300 + bs), new,
                               Profiled(ctx, True, name), window).timeline
    engine.flush_cache()
    return row
