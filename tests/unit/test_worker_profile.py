"""The worker's torch profiler (services/worker_profile.py): the trace it writes, its step
ranges, the ops of other threads (the overlap scheduler's forward thread), the stop after
`num_steps`, and what it refuses."""

from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path

import torch

from services.worker_profile import StepProfiler
from shared.messages import ProfileReqMsg


def start_msg(out: Path, **fields: object) -> ProfileReqMsg:
    return ProfileReqMsg("q", "r", "start", output_dir=str(out), **fields)  # type: ignore[arg-type]


def trace_names(path: str) -> list[str]:
    with gzip.open(path, "rt") as f:
        return [e.get("name", "") for e in json.load(f)["traceEvents"]]


def other_thread_mm() -> None:
    a = torch.ones(8, 8)
    thread = threading.Thread(target=lambda: torch.mm(a, a), name="sluice-forward")
    thread.start()
    thread.join()


def test_a_trace_has_each_step_and_the_ops_of_every_thread(tmp_path: Path) -> None:
    prof = StepProfiler("w0", str(tmp_path / "default"))
    ok, note = prof.start(start_msg(tmp_path, profile_id="p1", activities=["CPU"]))
    path = str(tmp_path / "p1-worker-w0.trace.json.gz")
    assert ok and path in note and prof.active
    def step() -> None:
        torch.ones(4).add_(1)
        other_thread_mm()

    for n in (1, 2):
        prof.run_step(n, step)
    ok, note, paths = prof.stop()
    assert ok and paths == [path] and not prof.active
    names = trace_names(path)
    assert "sluice step 1" in names and "sluice step 2" in names
    assert "aten::add_" in names and "aten::mm" in names
    ok, note, paths = prof.stop()
    assert (ok, paths) == (False, []) and "not profiling" in note


def test_it_stops_by_itself_after_num_steps_into_the_default_folder(tmp_path: Path) -> None:
    prof = StepProfiler("w1", str(tmp_path / "made"))
    ok, note = prof.start(ProfileReqMsg("q", "r", "start", num_steps=2, profile_id="auto"))
    assert ok and "for 2 steps" in note
    assert prof.run_step(7, lambda: "out") == "out"
    assert prof.active
    prof.run_step(8, lambda: None)
    assert not prof.active
    names = trace_names(str(tmp_path / "made" / "auto-worker-w1.trace.json.gz"))
    assert "sluice step 7" in names and "sluice step 8" in names


def test_what_it_refuses(tmp_path: Path) -> None:
    prof = StepProfiler("w2", str(tmp_path))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for fields, why in [
        ({"activities": ["TPU"]}, "unknown activities"),
        ({"profile_id": "../up"}, "profile_id"),
        ({"num_steps": -1}, "num_steps"),
        ({"output_dir": str(blocker / "sub")}, "cannot make"),
    ]:
        msg = ProfileReqMsg("q", "r", "start", **fields)  # type: ignore[arg-type]
        ok, note = prof.start(msg)
        assert not ok and why in note, (fields, note)
        assert not prof.active
    ok, _ = prof.start(start_msg(tmp_path, activities=["CPU", "GPU"]))
    assert ok
    ok, note = prof.start(start_msg(tmp_path))
    assert not ok and "already profiling" in note
    assert prof.stop()[0]
