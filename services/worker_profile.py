"""The torch profiler around a worker's scheduler steps: SGLang's `POST /start_profile` and
`POST /stop_profile` (vLLM's too, whose take no body), which the router fans out to every
live worker (services/router_profile.py).

A start profiles the scheduler's process, all its threads (engine/profiling.py: the
overlap scheduler's forward thread with its CUDA kernels on a GPU), and, when the overlap
executor runs the model in a device process (the CPU default), that process too. Each
scheduler step is a range named `sluice step N`. The traces are written at the stop, or after
`num_steps` steps: `{output_dir}/{profile_id}-worker-{id}.trace.json.gz`, and the device
process's beside it, ending `-device.trace.json.gz`. `output_dir` defaults to the worker's
`--profile-dir` (`SLUICE_TORCH_PROFILER_DIR`, as `SGLANG_TORCH_PROFILER_DIR`). Writing a
trace blocks the worker's loop while it lasts, as in SGLang.

A start while profiling, a stop while not, an activity other than CPU, GPU and MEM, an
unsafe `profile_id` and a folder that cannot be made are refused with the reason; "GPU"
without CUDA profiles the CPU only, and says so.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

from torch.profiler import record_function

from engine.profiling import ProfileOptions, start_profiler, write_trace
from shared.messages import ProfileReqMsg
from shared.messages.worker import PROFILE_ACTIVITIES

logger = logging.getLogger(__name__)

T = TypeVar("T")
_SAFE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


class StepProfiler:
    def __init__(self, worker_id: str, default_dir: str, executor: Any = None) -> None:
        """`executor`: the overlap scheduler's (its device process is profiled too)."""
        self.worker_id, self.default_dir, self.executor = worker_id, default_dir, executor
        self._prof: Any = None
        self._path = ""
        self._device_path = ""  # "" unless the device process profiles too
        self._steps_left = 0  # 0: until the stop

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self, msg: ProfileReqMsg) -> tuple[bool, str]:
        """Start profiling as `msg` says; (started, what happened)."""
        if self._prof is not None:
            return False, f"already profiling to {self._path} (POST /stop_profile first)"
        options = ProfileOptions(msg.activities or ProfileOptions.activities,
                                 msg.record_shapes, msg.with_stack)  # fmt: skip
        unknown = [a for a in options.activities if a not in PROFILE_ACTIVITIES]
        if unknown:
            return False, f"unknown activities {unknown} (use {', '.join(PROFILE_ACTIVITIES)})"
        if msg.num_steps < 0:
            return False, f"num_steps must be at least 1, got {msg.num_steps}"
        profile_id = msg.profile_id or str(int(time.time()))
        if not _SAFE_ID.fullmatch(profile_id):
            return False, "profile_id must be 1-128 letters, digits, '.', '_' or '-'"
        out_dir = os.path.abspath(msg.output_dir or self.default_dir)
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as exc:
            return False, f"cannot make {out_dir}: {exc}"
        base = os.path.join(out_dir, f"{profile_id}-worker-{self.worker_id}")
        try:
            self._prof, note = start_profiler(options)
        except Exception as exc:  # noqa: BLE001 - e.g. another profiler is on: refused
            logger.exception("starting the profiler")
            return False, f"the profiler did not start: {type(exc).__name__}: {exc}"
        self._path, self._device_path = base + ".trace.json.gz", ""
        try:
            if self.executor is not None and self.executor.start_profile(options):
                self._device_path = base + "-device.trace.json.gz"
        except RuntimeError as exc:  # (the device process is gone: the batches fail too)
            note += f" (the device process is not profiled: {exc})"
        self._steps_left = msg.num_steps
        until = f"for {msg.num_steps} steps" if msg.num_steps else "until /stop_profile"
        paths = " and ".join(p for p in (self._path, self._device_path) if p)
        logger.info("profiling %s to %s%s", until, paths, note)
        return True, f"Start profiling {until}; the traces go to {paths}{note}."

    def run_step(self, number: int, step: Callable[[], T]) -> T:
        """Scheduler step `number` (`step()`, while active), as its range in the trace; the
        stop after the last of `num_steps`."""
        with record_function(f"sluice step {number}"):
            out = step()
        if self._steps_left:
            self._steps_left -= 1
            if not self._steps_left:
                self.stop()
        return out

    def stop(self) -> tuple[bool, str, list[str]]:
        """Stop and write the traces; (stopped, what happened, the files written)."""
        if self._prof is None:
            return False, "not profiling (POST /start_profile first)", []
        prof, self._prof = self._prof, None
        failures, paths = [], []
        why = write_trace(prof, self._path)
        if why:
            failures.append(why)
        else:
            paths.append(self._path)
        if self._device_path:
            try:
                why = self.executor.stop_profile(self._device_path)
            except RuntimeError as exc:
                why = str(exc)
            if why:
                failures.append(f"device: {why}")
            else:
                paths.append(self._device_path)
        if failures:
            return False, "; ".join(failures), paths
        return True, f"Stop profiling; the traces are in {' and '.join(paths)}.", paths
