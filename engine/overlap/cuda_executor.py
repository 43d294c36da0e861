"""`CudaStreamExecutor`: the overlap executor on a GPU (no thread; streams do the overlapping).

Streams and their order:

* the scheduler's current stream S: the scheduler's own device work (allocator, req_to_token
  writes) and the host-to-device copies of each batch's index lists and sampling tensors.
  Those copies are blocking for the host, but they wait only for S, which never holds model
  work, so they do not wait for the forward in flight;
* the forward stream F: placeholder resolution, forward, sampling, FutureMap store. Before
  each launch F waits for S (`wait_stream`, a device-side wait), so it sees every write the
  scheduler made for this batch. Nothing launched on F copies from pageable host memory
  (the driver may make such a copy wait for the stream, here for the batch in flight): the
  batch's lengths are read from its device tensors, and the attention plan's host tables
  are pinned (engine/attention/flashinfer_backend.py);
* the copy stream C: waits for F after sampling, copies the next-token ids (and logprobs)
  into pinned host memory, and records `copy_done`. The scheduler synchronizes on that event
  only when it processes the batch, one step later; nothing on the critical path calls
  `.tolist()` on a device tensor.

Writes the scheduler makes on S after a launch may run while F still computes that batch.
They touch only (a) rows of requests that finished while the batch was in flight (their
outputs are discarded) and (b) prefix slots that `cache_unfinished_req` re-points at the
cache's copy of the same tokens; neither changes a result that is used. KV slots freed
meanwhile are only written again by later batches on F, in order.

Exception: `top_logprobs` and prompt logprobs are gathered into Python lists by the sampler,
which synchronizes with F; batches that ask for them lose the overlap.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model_runner import GenerationBatchResult
from engine.overlap.executor import Launch, OverlapExecutor
from engine.overlap.future_map import FutureMap, FutureSlots
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.scheduler.schedule_batch import ModelWorkerBatch


class CudaStreamExecutor(OverlapExecutor):
    def __init__(self, runner: Any, future_map: FutureMap) -> None:
        super().__init__(runner, future_map)
        self.device = torch.device(runner.device)
        self.forward_stream = torch.cuda.Stream(self.device)
        self.copy_stream = torch.cuda.Stream(self.device)
        self.index = self.forward_stream.device_index  # (an int: torch's fast path)
        # the stream switches of every step (see `_OnStream`); torch's own context where the
        # scheduler thread's current device is another one (it switches devices too)
        same = torch.cuda.current_device() == self.index
        self.on_stream = _OnStream if same else torch.cuda.stream

    def launch_forward(
        self, mwb: ModelWorkerBatch, slots: FutureSlots, info: SamplingBatchInfo | None
    ) -> Launch:
        fb = self.runner.build_forward_batch(mwb)  # index lists -> device, on S
        self.forward_stream.wait_stream(torch.cuda.current_stream(self.index))
        with self.on_stream(self.forward_stream), torch.inference_mode():
            # the runner resolves the placeholders (inside the CUDA graph when it replays one)
            logits = self.runner.forward(fb, self.future_map)
        launch = Launch(mwb, slots, fb, logits=logits)
        if info is not None:
            self.launch_sample(launch, info)
        return launch

    def launch_sample(self, launch: Launch, info: SamplingBatchInfo) -> None:
        launch.info = info  # built on S, read on F: kept alive by the launch
        self.forward_stream.wait_stream(torch.cuda.current_stream(self.index))
        with self.on_stream(self.forward_stream), torch.inference_mode():
            out = self._sample(launch)
        self.copy_stream.wait_stream(self.forward_stream)
        with self.on_stream(self.copy_stream):
            ids = _to_pinned(out.next_token_ids)
            logprobs = _to_pinned(out.logprobs) if out.logprobs is not None else None
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        launch.keep_alive.append(out)  # read by C; freed once `done` has been waited for
        launch.result = GenerationBatchResult(ids, logprobs, out.top_logprobs, out.prompt_logprobs)
        launch.done = done

    def wait(self, launch: Launch) -> GenerationBatchResult:
        launch.done.synchronize()
        assert launch.result is not None
        return launch.result

    def close(self) -> None:
        torch.cuda.synchronize(self.device)


class _OnStream:
    """`with torch.cuda.stream(stream)` for a stream of the scheduler thread's current device,
    on the per-step path (three switches a step). torch's context looks the current device up
    twice a use through `torch.cuda._utils` (an availability check and environment reads each
    time: the second GPU session's host profile had ~10 such lookups a step); this reads the
    current stream of the stream's own device index and sets streams by id."""

    __slots__ = ("stream", "prev")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream

    def __enter__(self) -> None:
        self.prev = torch.cuda.current_stream(self.stream.device_index)
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_stream(self.prev)


def _to_pinned(src: torch.Tensor) -> torch.Tensor:
    """Start an asynchronous copy of `src` into fresh pinned host memory (on the current
    stream); the result is valid once an event recorded after it has completed."""
    dst = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
    dst.copy_(src, non_blocking=True)
    return dst
