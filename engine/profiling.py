"""The torch profiler as the engine runs it: over every thread of the process (the overlap
scheduler's forward thread included), with the activities a user names ("CPU", "GPU",
"MEM"), its trace written in Chrome's format (gzipped when the path ends in .gz; Perfetto and
chrome://tracing open it). The worker's `/start_profile` (services/worker_profile.py) runs one
in the scheduler's process and, through the overlap executor, one in a device process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileOptions:
    activities: Sequence[str] = ("CPU", "GPU")  # SGLang's default
    record_shapes: bool = False
    with_stack: bool = False


def _all_threads() -> object | None:
    """Kineto's option to record the ops of every thread, not only the one that started the
    profiler (without it the overlap scheduler's forward thread is missing)."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):  # an older torch: this thread's ops only
        return None


def start_profiler(options: ProfileOptions) -> tuple[torch.profiler.profile, str]:
    """A started profiler; and a note when "GPU" was asked for without a CUDA device."""
    activities, note = [ProfilerActivity.CPU], ""
    if "GPU" in options.activities:
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        else:
            note = " (no CUDA device: CPU only)"
    prof = torch.profiler.profile(
        activities=activities,
        record_shapes=options.record_shapes,
        with_stack=options.with_stack,
        profile_memory="MEM" in options.activities,
        experimental_config=_all_threads(),
    )
    prof.start()
    return prof, note


def write_trace(prof: torch.profiler.profile, path: str) -> str | None:
    """Stop `prof` and write its trace to `path`; None, or why it could not be written."""
    start = time.perf_counter()
    try:
        prof.stop()
        prof.export_chrome_trace(path)
    except Exception as exc:  # noqa: BLE001 - (a full disk, a profiler torch refused) one answer
        logger.exception("writing the trace to %s failed", path)
        return f"writing the trace to {path} failed: {type(exc).__name__}: {exc}"
    logger.info("trace written to %s in %.1f s", path, time.perf_counter() - start)
    return None
