"""`ProcessExecutor`: the overlap executor on CPU, with a device *process* playing the GPU.

Why a process. `ThreadExecutor` plays the device with a second thread of the scheduler's
process, so the forward shares the GIL with the scheduler: every torch op of the forward
must take the GIL back from a scheduler thread busy in Python, and on a 2-core VM each such
hand-off costs tens of microseconds on both sides. A model's forward is hundreds of ops, so
the thread "device" loses more to hand-offs than the overlap saves (measured in
`benchmarks/overlap.py`: overlap on was 0.76-0.88x of off for CPU models). A process has its
own interpreter: the scheduler and the forward then really run at once, which is what an
accelerator gives the CUDA executor.

Split of state. The device process owns what only device work touches: the model, the KV
pool (and attention backend), the sampler and the FutureMap's token ring. The scheduler's
process keeps the host bookkeeping (request rows, KV slot allocator, prefix cache, the
FutureMap's slot cursor) and builds no device tensors. Device work runs in launch order, one
job at a time, exactly as on the forward thread, so the FutureMap and early-freeing
arguments of `executor.py` hold unchanged.

The request rows (`req_to_token`) are shared memory, as they are device memory shared by
the streams of the CUDA executor, and for the same reason it is safe: while a batch is on
the device, the scheduler only writes positions past that batch's sequence lengths, rows of
requests that finished meanwhile (whose results are discarded) and prefix entries that
`cache_unfinished_req` re-points at the cache's copy of the same tokens. (The thread
executor copies rows instead; that copy is a per-step cost this executor does not need.)

Per launch the scheduler sends one message (pickled; tensors travel as numpy arrays): the
ModelWorkerBatch without the per-request Python objects the device does not read, the batch's
FutureMap slots and, unless sampling is deferred (grammars), the `SamplingBatchInfo` — or,
when it is the very object sent last (the scheduler reuses one while the batch holds the same
requests: `SamplingInfoCache`), a marker that tells the device to reuse its copy (packing and
unpickling an info of 256 rows took ~90 us). The device answers with the host results of each
sampling, in order; `wait` reads answers until the batch's own has come. An exception on the
device comes back as an answer and is raised by `wait`; a device process that dies is reported
the same way.

The process is started from a forkserver (a clean process that imported torch and
transformers' config modules once, started on first use), so starting one costs a fork and
the model load (0.1 s for a tiny model; 2.7 s when each child imported transformers itself),
and nothing of the scheduler's threads or OpenMP state is inherited. `make_runner` is a
picklable zero-argument callable that builds the device's model runner there
(`engine_device_runner` with the engine's arguments).
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing as mp
import pickle
import sys
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - the tensors' ForkingPickler reductions

from engine.model_runner import GenerationBatchResult
from engine.overlap import device_process
from engine.overlap.device_process import (
    SAME_INFO,
    DeviceError,
    device_batch,
    device_main,
    engine_device_runner,
    pack,
)
from engine.overlap.executor import Launch, OverlapExecutor
from engine.overlap.future_map import FutureMap, FutureSlots
from engine.profiling import ProfileOptions
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.scheduler.schedule_batch import ModelWorkerBatch

START_TIMEOUT_S = 600.0  # loading a large model on CPU takes a while
CONFIG_PRELOAD = ("transformers.models.llama.configuration_llama",)  # (see `mp_context`)

_context: Any = None


def mp_context() -> Any:
    global _context
    if _context is None:
        ctx = mp.get_context("forkserver")
        # Before the server starts (later calls have no effect): what each child needs, and
        # not the default "__main__" (see `_start`). Reading a model's config imports most
        # of transformers (any model's config module pulls the same modules in; Llama's
        # stands for them): 3-4 s that each device process spent again before this.
        # torch._dynamo: a model's first op under a `torch.device` context (the rotary
        # tables') imports it, 0.6 s that each device process spent again before this.
        ctx.set_forkserver_preload(
            ["torch", "torch._dynamo", device_process.__name__, *CONFIG_PRELOAD]
        )
        _context = ctx
    return _context


def start_process(proc: Any) -> None:
    """Start `proc` without multiprocessing's "main module" fix-up: a forkserver child
    normally re-imports the parent's main script, which re-runs a script that builds an
    Engine at top level without an `if __name__ == "__main__":` guard (a new engine, a new
    device process, ...). The device process needs nothing from `__main__`: its target and
    runner factory are importable by module name."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        proc.start()
    finally:
        main.__dict__.update(saved)


class ProcessExecutor(OverlapExecutor):
    def __init__(
        self,
        runner: Any,
        future_map: FutureMap,
        make_runner: Callable[[], Any] | None = None,
        num_threads: int | None = None,
    ) -> None:
        """`runner`: the scheduler's (host-only) model runner, for its request rows;
        `make_runner`: builds the device's runner (default: the engine's, from `runner.args`)."""
        super().__init__(runner, future_map)
        make_runner = make_runner or functools.partial(engine_device_runner, runner.args)
        ctx = mp_context()
        self._conn, child = ctx.Pipe()
        threads = num_threads or torch.get_num_threads()
        rows = runner.req_to_token_pool.req_to_token.share_memory_()  # in place
        # hybrid sliding-window memory: the slot map too (the attention backend reads it)
        swa_map = getattr(runner.allocator, "full_to_swa", None)
        if swa_map is not None:
            swa_map.share_memory_()
        self._proc = ctx.Process(
            target=device_main,
            args=(child, make_runner, rows, future_map.max_bs, threads, swa_map),
            name="sluice-device",
            daemon=True,
        )
        start_process(self._proc)
        child.close()
        self._ids = itertools.count()
        self._waiting: dict[int, Launch] = {}  # launched, answer not read yet
        self._last_info: SamplingBatchInfo | None = None  # the device holds a copy of it
        self._closed = False
        self._profiled: str | None | bool = None  # a stop_profile's answer (False: waiting)
        self._called: tuple[Any, tuple[str, str] | None] | None = None  # a call's answer
        if not self._conn.poll(START_TIMEOUT_S):
            self.close()
            raise RuntimeError("overlap executor: the device process did not start")
        ready = self._recv()
        if ready[0] != "ready":
            self.close()
            raise RuntimeError(f"overlap executor: the device process failed to start:\n{ready[2]}")

    # -- launches -------------------------------------------------------------------------------
    def launch_forward(
        self, mwb: ModelWorkerBatch, slots: FutureSlots, info: SamplingBatchInfo | None
    ) -> Launch:
        lid = next(self._ids)
        launch = Launch(mwb, slots, None, done=lid)
        self._waiting[lid] = launch
        self._send(("forward", lid, device_batch(mwb), slots, self._info_message(info)))
        return launch

    def launch_sample(self, launch: Launch, info: SamplingBatchInfo) -> None:
        self._send(("sample", launch.done, self._info_message(info)))

    def _info_message(self, info: SamplingBatchInfo | None) -> Any:
        """The packed info, or SAME_INFO for the object sent last (which the device kept)."""
        if info is None:
            return None
        if info is self._last_info:
            return SAME_INFO
        self._last_info = info
        return pack(info)

    def call(self, method: str, *args: Any) -> Any:
        """In the device process, after the launches sent before it; waits for its answer
        (reading those of earlier launches on the way). A ValueError there is raised here
        with its message; any other error as a RuntimeError."""
        self._send(("call", -1, method, args), shared=True)
        self._called = None
        while self._called is None:
            if self._read_answer() == "gone":
                raise RuntimeError("overlap executor: the device process is gone")
        result, error = self._called
        if error is not None:
            kind, message = error
            raise (ValueError if kind == "ValueError" else RuntimeError)(message)
        return result

    def start_profile(self, options: ProfileOptions) -> bool:
        self._send(("profile_start", -1, options))
        return True

    def stop_profile(self, path: str) -> str | None:
        """Waits for the device to write its trace: the answers of earlier launches are
        read on the way (as `wait` reads them)."""
        self._send(("profile_stop", -1, path))
        self._profiled = False
        while self._profiled is False:
            if self._read_answer() == "gone":
                return "the device process is gone"
        return self._profiled

    def wait(self, launch: Launch) -> GenerationBatchResult:
        while launch.result is None and launch.error is None:
            self._read_answer()
        if launch.error is not None:
            last = (str(launch.error).strip().splitlines() or [""])[-1]  # a traceback's error
            msg = f"overlap executor: the batch failed on the device: {last}"
            raise RuntimeError(msg) from launch.error
        return launch.result

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._conn.send_bytes(pickle.dumps(("close",)))
        except OSError:  # already gone
            pass
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()

    # -- plumbing -------------------------------------------------------------------------------
    def _send(self, msg: tuple, shared: bool = False) -> None:
        """`msg` to the device process; `shared`: its tensors' data in shared memory, only
        their handles through the pipe (a call's weights: hundreds of MB)."""
        if self._closed:
            raise RuntimeError("overlap executor: closed")
        if shared:  # (torch.multiprocessing registers the tensors' reductions)
            data = ForkingPickler.dumps(msg, pickle.HIGHEST_PROTOCOL)
        else:
            data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._conn.send_bytes(data)
        except OSError as exc:
            raise RuntimeError("overlap executor: the device process is gone") from exc

    def _recv(self) -> tuple:
        try:
            return pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            code = self._proc.exitcode
            msg = f"overlap executor: the device process died (exit code {code})"
            raise RuntimeError(msg) from exc

    def _read_answer(self) -> str | None:
        try:
            answer = self._recv()
        except RuntimeError as exc:  # every batch still waiting failed with it
            for launch in self._waiting.values():
                launch.error = launch.error or exc
            self._waiting.clear()
            return "gone"
        kind, lid = answer[0], answer[1]
        if kind == "profiled":  # (a stop_profile's: None, or why no trace was written)
            self._profiled = answer[2]
            return None
        if kind == "called":  # (a call's: its result, and its error's type and message)
            self._called = (answer[2], answer[3])
            return None
        launch = self._waiting.pop(lid)
        if kind == "error":
            launch.error = DeviceError(answer[2])
        else:
            _, _, ids, logprobs, top, prompt = answer
            launch.result = GenerationBatchResult(
                torch.from_numpy(ids),
                None if logprobs is None else torch.from_numpy(logprobs),
                top,
                prompt,
            )
