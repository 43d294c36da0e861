"""A trace of scheduler steps: when each started and ended, what it ran, how many events.

For profiling where the time goes (`sluice worker --step-trace FILE`, and the in-process
side of `benchmarks/serving_disagg.py`): rows are kept in memory and appended to the file
by `flush()` (the worker flushes whenever it goes idle), one line per step:
`start end kind events`, times from `time.perf_counter()` in seconds, kind "prefill",
"mixed" (a prefill batch that also carries the running requests' decode step, with
`--enable-mixed-chunk`), "decode" or "idle" (a step that ran no batch, e.g. only reported an
abort).
"""

from __future__ import annotations

import statistics
from typing import Any, NamedTuple

MAX_GAP_S = 0.05  # a longer pause between steps is the loop waiting for work, not overhead


class StepRecord(NamedTuple):
    start: float
    end: float
    kind: str
    events: int


def batch_kind(batch: Any) -> str:
    if batch is None:
        return "idle"
    if not batch.forward_mode.is_extend():
        return "decode"
    return "mixed" if getattr(batch, "decoding_reqs", None) else "prefill"


class StepTrace:
    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.rows: list[StepRecord] = []

    def add(self, start: float, end: float, batch: Any, events: int) -> None:
        self.rows.append(StepRecord(start, end, batch_kind(batch), events))

    def flush(self) -> None:
        if self.path is None or not self.rows:
            return
        with open(self.path, "a") as f:
            f.writelines(f"{r.start:.6f} {r.end:.6f} {r.kind} {r.events}\n" for r in self.rows)
        self.rows = []


def read_trace(path: str, skip: int = 0) -> list[StepRecord]:
    """The rows of a trace file after its first `skip` lines."""
    with open(path) as f:
        lines = f.read().splitlines()[skip:]
    return [StepRecord(float(a), float(b), k, int(n)) for a, b, k, n in map(str.split, lines)]


def summarize(rows: list[StepRecord], full_batch: int) -> dict[str, Any]:
    """Counts and time per kind; the median decode step with `full_batch` requests or more
    (comparable across runs whose batches fill differently); the median gap between
    back-to-back steps (the loop's own work)."""
    out: dict[str, Any] = {"steps": len(rows)}
    for kind in ("prefill", "mixed", "decode"):
        mine = [r for r in rows if r.kind == kind]
        out[f"{kind}_steps"] = len(mine)
        out[f"{kind}_time_s"] = sum(r.end - r.start for r in mine)
    # steps that prefill, mixed or not: each is a pause for the running requests' tokens
    out["extend_steps"] = out["prefill_steps"] + out["mixed_steps"]
    out["extend_time_s"] = out["prefill_time_s"] + out["mixed_time_s"]
    full = [r.end - r.start for r in rows if r.kind == "decode" and r.events >= full_batch]
    gaps = [b.start - a.end for a, b in zip(rows, rows[1:]) if 0 <= b.start - a.end < MAX_GAP_S]
    out["full_decode_steps"] = len(full)
    out["full_decode_step_ms_p50"] = statistics.median(full) * 1e3 if full else None
    out["gap_ms_p50"] = statistics.median(gaps) * 1e3 if gaps else None
    return out
