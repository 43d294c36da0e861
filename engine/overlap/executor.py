"""The asynchronous device the overlap scheduler launches batches on; one interface, three kinds.

    launch_forward(mwb, slots, info) -> Launch  non-blocking: resolve the batch's placeholders
                                      from the FutureMap, run the forward; with `info`, also
                                      sample right behind it (see below)
    launch_sample(launch, info)       non-blocking: sample, store the tokens into the batch's
                                      FutureMap slots, copy them to the host
    wait(launch) -> GenerationBatchResult  block until the batch's host results are ready
    close()                           stop (idempotent)

Sampling right behind the forward is the normal case: the batch's results are then ready as
early as the device allows. A batch whose sampling needs the previous batch's tokens on the
host (a grammar's mask) is launched without `info`, and `launch_sample` follows once the
scheduler has processed that previous batch. (Penalties and bad words do not need that: their
counts and last tokens stay on the device, engine/sampling/penalty_slots.py.)

All kinds run device work strictly in launch order, which is what makes the FutureMap and the
early freeing of KV slots safe: a slot freed by the scheduler while a forward that writes it is
in flight is only handed to a batch launched later, whose writes come after.
`CudaStreamExecutor` (`cuda_executor.py`) uses a forward stream and a copy stream. On CPU,
`ProcessExecutor` (`process_executor.py`, the default) plays the device with a second process,
and `ThreadExecutor` (here, `cpu_overlap_executor="thread"`) with one forward thread, which
shares the scheduler's GIL. The scheduler loop above them is the same.

A `Launch` owns every tensor its device work reads until the scheduler has waited for it, so
nothing the device may still read is freed early (on CUDA, the caching allocator could
otherwise hand that memory to the next batch while the forward stream still reads it).
"""

from __future__ import annotations

import queue
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.model_runner import GenerationBatchResult
from engine.overlap.future_map import FutureMap, FutureSlots
from engine.profiling import ProfileOptions
from engine.sampling.sampler import sample_batch
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.scheduler.schedule_batch import ModelWorkerBatch

# How long a thread holding the GIL in pure Python keeps the forward thread waiting for it.
SWITCH_INTERVAL_S = 0.0002


@dataclass
class Launch:
    """One batch on the device: its inputs, its logits until sampled, then its host results."""

    mwb: ModelWorkerBatch
    slots: FutureSlots
    forward_batch: Any
    logits: torch.Tensor | None = None
    info: SamplingBatchInfo | None = None
    result: GenerationBatchResult | None = None  # host tensors, valid once `wait` returns
    error: BaseException | None = None
    keep_alive: list[Any] = field(default_factory=list)  # device tensors read by other streams
    done: Any = None  # executor-specific completion signal


class OverlapExecutor(ABC):
    def __init__(self, runner: Any, future_map: FutureMap) -> None:
        self.runner = runner
        self.future_map = future_map

    @abstractmethod
    def launch_forward(
        self, mwb: ModelWorkerBatch, slots: FutureSlots, info: SamplingBatchInfo | None
    ) -> Launch: ...

    @abstractmethod
    def launch_sample(self, launch: Launch, info: SamplingBatchInfo) -> None: ...

    @abstractmethod
    def wait(self, launch: Launch) -> GenerationBatchResult: ...

    @abstractmethod
    def close(self) -> None:
        """Stop; results still in flight are dropped. Idempotent."""

    def call(self, method: str, *args: Any) -> Any:
        """`runner.<method>(*args)` after the device work launched so far and before any
        launched later (a LoRA adapter's load or release, a weights update); its result, or
        its exception.
        Here (CUDA), at once: device work already launched is on the streams, where what
        the call enqueues follows it."""
        return getattr(self.runner, method)(*args)

    def start_profile(self, options: ProfileOptions) -> bool:
        """Profile the device's side too, if it runs in another process (ProcessExecutor):
        whether it does. A forward thread of this process is in this process's profile."""
        return False

    def stop_profile(self, path: str) -> str | None:
        """Stop the device's profile and write its trace to `path`; None, or why not."""
        return "no device profile"

    def _sample(self, launch: Launch) -> Any:
        """Sample and store into the FutureMap (on whatever stream/thread is current)."""
        assert launch.logits is not None and launch.info is not None
        out = sample_into_map(
            self.runner, self.future_map, launch.logits, launch.info, launch.mwb, launch.slots
        )
        launch.logits = None  # the largest tensor of the batch: free it as soon as possible
        return out


def sample_into_map(
    runner: Any, future_map: FutureMap, logits: torch.Tensor, info: SamplingBatchInfo,
    mwb: ModelWorkerBatch, slots: FutureSlots,
) -> Any:  # fmt: skip
    """Sample a batch's next tokens and store them into its FutureMap slots (device work)."""
    out = sample_batch(runner.sampler, logits, info, mwb)
    future_map.store_to_map(slots, out.next_token_ids)
    return out


def create_executor(runner: Any, future_map: FutureMap) -> OverlapExecutor:
    if torch.device(runner.device).type == "cuda":
        from engine.overlap.cuda_executor import CudaStreamExecutor

        return CudaStreamExecutor(runner, future_map)
    return ThreadExecutor(runner, future_map)


class ThreadExecutor(OverlapExecutor):
    """CPU: a forward thread plays the asynchronous device.

    Jobs (forward and sampling, or a deferred sampling) run on the thread in launch order
    while the scheduler thread processes the previous batch; torch ops release the GIL, so
    the two overlap as far as the model's time is spent inside ops rather than in Python.
    The thread reads only what its launch owns: the forward batch is built at launch on the
    scheduler thread, with a private copy of the request rows it reads (the scheduler edits
    `req_to_token` for the next batch meanwhile, and may free and reuse a row of a request
    that finished), plus the KV pool and the FutureMap, which only device work touches, in
    order.

    The GIL: after each op the forward thread must take the GIL back, and a thread that
    holds it in pure Python (the scheduler processing results) gives it up only after the
    interpreter's switch interval, 5 ms by default: the device would idle that long between
    ops. The executor lowers the (process-wide) interval to SWITCH_INTERVAL_S if it is higher.

    Intra-op threads: a new thread does not inherit the OpenMP/MKL thread count set by
    `torch.set_num_threads` in the thread that created it (it falls back to one per core),
    so the forward thread applies the creator's count itself (`num_threads`). That matters:
    on a busy 2-core machine a 2-thread matmul can be 100x slower than a 1-thread one, and a
    2-thread forward also competes with the scheduler thread for the cores.
    """

    def __init__(
        self, runner: Any, future_map: FutureMap, num_threads: int | None = None
    ) -> None:
        super().__init__(runner, future_map)
        self.num_threads = num_threads or torch.get_num_threads()
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._jobs: queue.SimpleQueue[tuple[Callable[[Launch], None], Launch] | None]
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="sluice-forward", daemon=True)
        self._thread.start()

    def launch_forward(
        self, mwb: ModelWorkerBatch, slots: FutureSlots, info: SamplingBatchInfo | None
    ) -> Launch:
        fb = self.runner.build_forward_batch(mwb)
        _private_rows(fb)
        launch = Launch(mwb, slots, fb, info=info, done=threading.Event())
        self._put(self._forward_and_sample if info is not None else self._forward, launch)
        return launch

    def launch_sample(self, launch: Launch, info: SamplingBatchInfo) -> None:
        launch.info = info
        self._put(self._sample_job, launch)

    def wait(self, launch: Launch) -> GenerationBatchResult:
        launch.done.wait()
        if launch.error is not None:
            raise RuntimeError("overlap executor: the batch failed on the device") from launch.error
        assert launch.result is not None
        return launch.result

    def call(self, method: str, *args: Any) -> Any:
        """On the forward thread, after the jobs queued before it; waits for it."""
        launch = Launch(None, None, None, done=threading.Event())  # type: ignore[arg-type]

        def job(launch: Launch) -> None:
            launch.result = getattr(self.runner, method)(*args)
            launch.done.set()

        self._put(job, launch)
        launch.done.wait()
        if launch.error is not None:
            raise launch.error
        return launch.result

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    # -- on the forward thread --------------------------------------------------------------------
    def _put(self, job: Callable[[Launch], None], launch: Launch) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("overlap executor: closed")
        self._jobs.put((job, launch))

    def _run(self) -> None:
        torch.set_num_threads(self.num_threads)
        with torch.inference_mode():
            while (item := self._jobs.get()) is not None:
                job, launch = item
                try:
                    job(launch)
                except BaseException as exc:  # reported to the scheduler by `wait`
                    launch.error = launch.error or exc
                    launch.done.set()

    def _forward(self, launch: Launch) -> None:
        # the runner resolves the placeholders (inside a CUDA graph when it replays one)
        launch.logits = self.runner.forward(launch.forward_batch, self.future_map)
        launch.forward_batch = None

    def _forward_and_sample(self, launch: Launch) -> None:
        self._forward(launch)
        self._sample_job(launch)

    def _sample_job(self, launch: Launch) -> None:
        if launch.error is None:
            out = self._sample(launch)
            launch.result = GenerationBatchResult(
                out.next_token_ids, out.logprobs, out.top_logprobs, out.prompt_logprobs
            )
        launch.done.set()


def _private_rows(fb: Any) -> None:
    """Point the forward batch at its own copy of the request rows it reads (row i of the
    copy is request i's row, cut to the longest sequence)."""
    width = max(fb.seq_lens_cpu)
    fb.req_to_token = fb.req_to_token[:, :width].index_select(0, fb.req_pool_indices)
    fb.req_pool_indices = torch.arange(fb.batch_size, device=fb.req_pool_indices.device)
