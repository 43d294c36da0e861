"""The scheduler step trace: what it writes, reads back and sums up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.scheduler.step_trace import StepTrace, read_trace, summarize


def batch(extend: bool, decoding: int = 0) -> SimpleNamespace:
    mode = SimpleNamespace(is_extend=lambda: extend)
    return SimpleNamespace(forward_mode=mode, decoding_reqs=frozenset(range(decoding)))


def test_rows_are_written_on_flush_and_read_back(tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path / "steps.txt")
    trace = StepTrace(path)
    trace.add(1.0, 1.5, batch(True), 2)
    trace.add(1.5001, 1.52, batch(False), 2)
    assert not (tmp_path / "steps.txt").exists()  # nothing written until flushed
    trace.flush()
    trace.add(1.6, 1.61, None, 1)
    trace.add(1.7, 1.8, batch(True, decoding=3), 4)
    trace.flush()
    rows = read_trace(path)
    assert [(r.kind, r.events) for r in rows] == [
        ("prefill", 2), ("decode", 2), ("idle", 1), ("mixed", 4)
    ]
    assert rows[1].start == pytest.approx(1.5001) and rows[2].end == pytest.approx(1.61)
    assert [r.kind for r in read_trace(path, skip=2)] == ["idle", "mixed"]


def test_summary_counts_kinds_and_takes_full_decode_steps_and_gaps() -> None:
    trace = StepTrace()
    t = 0.0
    for kind, events, dur, gap in [
        (True, 3, 0.010, 0.0),
        (False, 4, 0.020, 0.001),
        (False, 4, 0.022, 0.001),
        (False, 2, 0.005, 0.003),  # not full: left out of the decode-step median
        (True, 1, 0.004, 1.0),  # after a long wait: not a loop gap
    ]:
        t += gap
        trace.add(t, t + dur, batch(kind), events)
        t += dur
    s = summarize(trace.rows, full_batch=4)
    assert (s["steps"], s["prefill_steps"], s["decode_steps"]) == (5, 2, 3)
    assert s["prefill_time_s"] == pytest.approx(0.014)
    assert (s["mixed_steps"], s["extend_steps"]) == (0, 2)
    assert s["full_decode_steps"] == 2
    assert s["full_decode_step_ms_p50"] == pytest.approx(21.0)
    assert s["gap_ms_p50"] == pytest.approx(1.0)
    assert summarize([], 4)["full_decode_step_ms_p50"] is None
