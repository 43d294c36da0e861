"""The GPU's idle time per decode step, read off the kernel timeline: torch.profiler around a
window of steady decode steps (`Profiled`), the trace's kernels merged into busy and idle time
(`timeline_summary`), and the scheduler driven step by step to record that window (`drive`)."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks import common
from benchmarks.gpu_common import Ctx, sync

BUBBLE_US = 20.0  # gaps this long between kernels are host stalls ("bubbles"), reported apart


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by a set of [start, end) intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def gaps(intervals: list[tuple[float, float]]) -> list[float]:
    """The idle gaps between the merged intervals, in order."""
    out, end = [], None
    for s, e in sorted(intervals):
        if end is not None and s > end:
            out.append(s - end)
        end = e if end is None else max(end, e)
    return out


def timeline_summary(events: list[dict], num_steps: int) -> dict[str, Any]:
    """Device busy / idle over the kernels of a chrome trace (times in us)."""
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    copies = [e["dur"] for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    if not kernels:
        cats = sorted({str(e.get("cat")) for e in events if e.get("ph") == "X"})
        return {"kernel_count": 0, "idle_fraction": None, "categories": cats}
    window = max(e for _, e in kernels) - min(s for s, _ in kernels)
    busy = busy_union(kernels)
    holes = gaps(kernels)
    bubbles = [g for g in holes if g >= BUBBLE_US]
    by_name: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "kernel":
            by_name[e["name"][:90]] = by_name.get(e["name"][:90], 0.0) + e["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    steps = max(num_steps, 1)
    return {
        "kernel_count": len(kernels), "steps": num_steps, "window_ms": window / 1e3,
        "busy_ms": busy / 1e3, "idle_ms": (window - busy) / 1e3,
        "idle_fraction": (window - busy) / window if window > 0 else None,
        "step_ms": window / steps / 1e3, "busy_ms_per_step": busy / steps / 1e3,
        "idle_ms_per_step": (window - busy) / steps / 1e3,
        "bubble_count": len(bubbles), "bubble_ms_per_step": sum(bubbles) / steps / 1e3,
        "bubble_fraction": sum(bubbles) / window if window > 0 else None,
        "max_gap_us": max(holes, default=0.0), "memcpy_memset_ms": sum(copies) / 1e3,
        "top_kernels_ms": {k: v / 1e3 for k, v in top},
    }


class Profiled:
    """torch.profiler around a region: the kernel timeline, and with `table` a key_averages
    table written to results/<table>.txt. `cpu_ops=False` records kernels only (CUPTI), so
    the host runs at nearly full speed."""

    def __init__(self, ctx: Ctx, cpu_ops: bool, table: str | None = None) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CUDA] if ctx.cuda else []
        if cpu_ops or not ctx.cuda:
            acts.append(ProfilerActivity.CPU)
        self.ctx, self.table = ctx, table
        self.prof = profile(activities=acts)
        self.started = False

    def start(self) -> None:
        if not self.started:
            self.started = True
            sync(self.ctx)  # the window starts with no earlier work queued
            self.prof.start()

    def stop(self, num_steps: int) -> dict[str, Any] | None:
        if not self.started:
            return None
        sync(self.ctx)
        self.prof.stop()
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "trace.json")
            self.prof.export_chrome_trace(trace)
            with open(trace) as f:
                events = json.load(f).get("traceEvents", [])
        summary = timeline_summary(events, num_steps)
        if self.table:
            path = os.path.join(common.RESULTS_DIR, f"{self.table}.txt")
            os.makedirs(common.RESULTS_DIR, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"{' '.join(sys.argv)}\n{json.dumps(summary, indent=1)}\n\n")
                f.write(_key_table(self.prof, self.ctx.cuda))
            summary["table"] = os.path.basename(path)
        return summary


def _key_table(prof: Any, cuda: bool) -> str:
    avg = prof.key_averages()
    keys = ["self_device_time_total", "self_cuda_time_total"] if cuda else []
    for key in keys + ["self_cpu_time_total"]:
        try:
            return avg.table(sort_by=key, row_limit=40, max_name_column_width=70)
        except Exception:  # noqa: BLE001 - the key's name changed across torch versions
            continue
    return avg.table(row_limit=40)


# -- the GPU's step period from CUDA events --------------------------------------------------
class StepEvents:
    """The GPU's period per decode step, from events on the stream that runs the forwards,
    with no profiler attached (the `drive` protocol of `Profiled`: `start()`, `stop(steps)`).

    Why: a CUPTI trace slows the host. In the fourth GPU session the overlap loop at batch 64
    took 0.74 ms of host time per step unprofiled but 1.17 ms per step inside the
    kernel-only trace, whose idle fraction (0.43) was then mostly the profiler's. A
    host-bound loop's step period is the host's; events cost a few microseconds a step.

    Per launched batch, a mark on the forward stream before the launch (before its inputs
    are copied) and one after it (after sampling; after a deferred `launch_sample` too).
    `stop` reports `period_ms` (the mean time between consecutive launch marks: the device's
    step period; busy / period is the fraction of the step the GPU computes, with busy from
    a profiled run's kernels, `timeline`), and `gap_ms_per_step` (the mean time the stream
    ran dry between one batch's last mark and the next batch's first mark: idle the GPU
    certainly had; idle inside a step, between the batch's copies and its graph, is not in
    it). On a CPU the marks are host times (the device is synchronous there)."""

    def __init__(self, ctx: Ctx, engine: Any) -> None:
        self.ctx, self.sched = ctx, engine.scheduler
        self.started = False
        self.marks: list[tuple[str, Any]] = []  # ("launch" | "done", mark), in host order
        self._undo: list[tuple[Any, str]] = []

    def _mark(self, stream: Any) -> Any:
        if not self.ctx.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream())
        return event

    def _wrap(self, obj: Any, name: str, stream: Any, launches: bool) -> None:
        inner = getattr(obj, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if launches:
                self.marks.append(("launch", self._mark(stream)))
            out = inner(*args, **kwargs)
            self.marks.append(("done", self._mark(stream)))
            return out

        setattr(obj, name, call)  # an instance attribute: shadows the method
        self._undo.append((obj, name))

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        sync(self.ctx)
        executor = getattr(self.sched, "executor", None)
        if executor is not None:  # the overlap loop: its forward stream on a GPU
            stream = getattr(executor, "forward_stream", None)
            self._wrap(executor, "launch_forward", stream, launches=True)
            self._wrap(executor, "launch_sample", stream, launches=False)
        else:  # the plain loop: the current stream
            self._wrap(self.sched.model_runner, "forward_batch_generation", None, launches=True)

    def stop(self, num_steps: int) -> dict[str, Any] | None:
        if not self.started:
            return None
        for obj, name in self._undo:
            delattr(obj, name)
        self._undo.clear()
        sync(self.ctx)
        return step_periods(self.marks, self._elapsed_ms)

    def _elapsed_ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.ctx.cuda else 1e3 * (b - a)


def step_periods(marks: list[tuple[str, Any]], elapsed_ms: Any) -> dict[str, Any]:
    """`StepEvents`' arithmetic over its marks in host order (`elapsed_ms(a, b)`: b - a)."""
    launches = [i for i, (kind, _) in enumerate(marks) if kind == "launch"]
    if len(launches) < 2:
        return {"steps": len(launches), "period_ms": None, "gap_ms_per_step": None}
    first, last = marks[launches[0]][1], marks[launches[-1]][1]
    steps = len(launches) - 1  # whole periods between the first and the last launch
    gaps = []
    for prev, nxt in zip(launches, launches[1:]):
        done = [m for kind, m in marks[prev:nxt] if kind == "done"]
        if done:
            gaps.append(max(0.0, elapsed_ms(done[-1], marks[nxt][1])))
    return {
        "steps": steps,
        "period_ms": elapsed_ms(first, last) / steps,
        "gap_ms_per_step": sum(gaps) / steps,
        "max_gap_ms": max(gaps, default=0.0),
    }


def event_idle_fraction(busy_ms_per_step: float | None, period_ms: float | None) -> float | None:
    """The GPU's idle fraction of an unprofiled step: 1 - busy / period (busy from a
    profiled run's kernels, the period from `StepEvents`)."""
    if not busy_ms_per_step or not period_ms:
        return None
    return max(0.0, 1.0 - busy_ms_per_step / period_ms)


# -- driving the scheduler --------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    seconds: float
    num_tokens: int
    decode_step_s: list[float]  # wall time of each step while every request decodes
    token_times: list[float]  # arrival time of each token of the first request
    timeline: dict[str, Any] | None = None


def steady_decode(sched: Any, num_requests: int) -> bool:
    """Whether the step just taken was a decode step of all `num_requests` requests."""
    last = sched.last_batch
    return (last is not None and last.forward_mode.is_decode()
            and len(sched.running_batch) == num_requests)


def drive(
    engine: Any, prompts: list[list[int]], max_new: int,
    profiler: Profiled | None = None, window: tuple[int, int] = (0, 0),
) -> Run:
    """All prompts at once, steps until every request is done. With a profiler, it records
    steady decode steps window[0] .. window[0] + window[1] - 1."""
    from engine.sampling.sampling_params import SamplingParams

    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    params.normalize()
    rids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts):
        sched.add_request(rid, ids, params)
    steps: list[float] = []
    first: list[float] = []
    tokens, tl = 0, None
    t0 = time.perf_counter()
    while sched.has_work():
        if profiler is not None and window[1] and len(steps) == window[0]:
            profiler.start()  # idempotent: until the next steady step
        w = time.perf_counter()
        events = sched.step()
        now = time.perf_counter()
        if steady_decode(sched, len(prompts)):
            steps.append(now - w)
            if profiler is not None and window[1] and len(steps) == window[0] + window[1]:
                tl = profiler.stop(window[1])
        for ev in events:
            tokens += len(ev.new_token_ids)
            if ev.rid == rids[0]:
                first.extend([now] * len(ev.new_token_ids))
    seconds = time.perf_counter() - t0
    if profiler is not None and window[1] and tl is None:
        tl = profiler.stop(max(len(steps) - window[0], 1))
    return Run(seconds, tokens, steps, first, tl)


def timeline(ctx: Ctx, engine: Any, prompts: list[list[int]], max_new: int,
             window: tuple[int, int]) -> dict[str, Any]:
    """The kernel timeline of `window` steady decode steps, recording kernels only; if that
    yields no kernel (a CUPTI quirk seen elsewhere), again with CPU ops (slower host)."""
    out = drive(engine, prompts, max_new, Profiled(ctx, cpu_ops=False), window).timeline or {}
    if ctx.cuda and not out.get("kernel_count"):
        engine.flush_cache()
        out = drive(engine, prompts, max_new, Profiled(ctx, cpu_ops=True), window).timeline or {}
        out["recorded_cpu_ops"] = True
    return out


# -- where a step's host time goes ------------------------------------------------------------
HOST_PHASES = ("launch_forward", "graph_launch", "wait")


def host_split(engine: Any, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    """Median host time per steady decode step (ms) in each phase, over one more run:
    `launch_forward` (the executor's launch: the batch's device inputs, the static rows, the
    graph launch), `graph_launch` (inside it: `CUDAGraph.replay`, the driver's
    cudaGraphLaunch), `wait` (the executor waiting for the previous batch's tokens: the
    host ahead of the GPU) and `other` (the step less launch and wait: scheduling, sampling
    launch, processing the previous batch's results). A host that launches a graph while
    the same graph still runs and blocks in the driver shows here as a long `graph_launch`
    and a short `wait`. Phases the engine has not (no graphs on a CPU; the plain loop has no
    executor) read 0."""
    sched = engine.scheduler
    totals = dict.fromkeys(HOST_PHASES, 0.0)
    undo: list[tuple[Any, str]] = []

    def timed(obj: Any, name: str, phase: str) -> None:
        inner = getattr(obj, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[phase] += time.perf_counter() - t

        setattr(obj, name, call)  # an instance attribute: shadows the method
        undo.append((obj, name))

    graphs = getattr(sched.model_runner, "graph_runner", None)
    for graph in (graphs.graphs.values() if graphs is not None else ()):
        timed(graph, "replay", "graph_launch")
    executor = getattr(sched, "executor", None)
    if executor is not None:
        timed(executor, "launch_forward", "launch_forward")
        timed(executor, "wait", "wait")
    per_step: list[dict[str, float]] = []
    step = sched.step

    def recorded_step() -> Any:
        for k in totals:
            totals[k] = 0.0
        t = time.perf_counter()
        out = step()
        wall = time.perf_counter() - t
        if steady_decode(sched, len(prompts)):
            per_step.append({"step": wall, **totals})
        return out

    sched.step = recorded_step
    try:
        drive(engine, prompts, max_new)
    finally:
        del sched.step
        for obj, name in undo:
            delattr(obj, name)
    if not per_step:
        return {}
    med = {k: 1e3 * statistics.median(s[k] for s in per_step) for k in HOST_PHASES}
    other = statistics.median(s["step"] - s["launch_forward"] - s["wait"] for s in per_step)
    return {f"host_{k}_ms": v for k, v in med.items()} | {
        "host_other_ms": 1e3 * other,
        "host_split_step_ms": 1e3 * statistics.median(s["step"] for s in per_step),
        "host_split_steps": len(per_step),
    }
