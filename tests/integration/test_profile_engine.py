"""The worker's profiler over a real engine (services/worker_profile.py, engine/profiling.py):
the model's ops are in the traces whichever CPU overlap executor runs them, a forward thread
(the scheduler process's trace) or a device process (a trace of its own)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from engine.engine import Engine
from services.worker_profile import StepProfiler
from shared.messages import ProfileReqMsg
from tests.factories import tiny_model

MODEL_OPS = {"aten::linear", "aten::mm", "aten::addmm"}


def ops_by_thread(path: str) -> dict[object, set[str]]:
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    out: dict[object, set[str]] = {}
    for e in events:
        if str(e.get("name", "")).startswith("aten::"):
            out.setdefault(e.get("tid"), set()).add(e["name"])
    return out


@pytest.mark.parametrize("executor", ["process", "thread"])
def test_the_models_ops_are_profiled_wherever_the_forward_runs(
    executor: str, tmp_path: Path
) -> None:
    with Engine(model_path=tiny_model("llama"), cpu_overlap_executor=executor,
                max_total_tokens=4096, max_running_requests=8) as engine:  # fmt: skip
        prof = StepProfiler("w9", str(tmp_path), engine.scheduler.executor)
        ok, note = prof.start(ProfileReqMsg("q", "r", "start", profile_id="eng"))
        assert ok, note
        engine.generate(["profile the engine"], {"max_new_tokens": 4, "temperature": 0})
        ok, note, paths = prof.stop()
    assert ok, note
    main = str(tmp_path / "eng-worker-w9.trace.json.gz")
    if executor == "process":
        device = str(tmp_path / "eng-worker-w9-device.trace.json.gz")
        assert paths == [main, device]
        assert any(ops & MODEL_OPS for ops in ops_by_thread(device).values())
    else:
        assert paths == [main]
        by_thread = ops_by_thread(main)  # the forward thread's, beside the scheduler's
        assert len(by_thread) >= 2, by_thread.keys()
        assert any(ops & MODEL_OPS for ops in by_thread.values())
