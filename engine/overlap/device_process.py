"""The device side of `ProcessExecutor` (process_executor.py): the process that plays the
GPU on CPU, what travels to it and how it runs its jobs.

`device_main` builds the model runner there (`make_runner`), adopts the scheduler's request
rows (shared memory) and then runs one message at a time, in launch order: a forward, with
or without its sampling, or the deferred sampling of a forward already run. A failing batch
is answered with its traceback and the device lives on.

Messages are pickled; tensors travel as numpy arrays (`pack`/`unpack`), and a
`SamplingBatchInfo` identical to the one sent last as the marker `SAME_INFO`.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engine.config import EngineArgs, ModelConfig
from engine.model_runner import ModelRunner
from engine.overlap.executor import sample_into_map
from engine.overlap.future_map import FutureMap, FutureSlots
from engine.profiling import start_profiler, write_trace
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.scheduler.schedule_batch import ModelWorkerBatch

logger = logging.getLogger(__name__)


class DeviceError(RuntimeError):
    """An exception raised in the device process (its traceback is the message)."""


# -- what travels ----------------------------------------------------------------------------------
SAME_INFO = "same-info"  # in place of a SamplingBatchInfo: the one the device received last


def device_batch(mwb: ModelWorkerBatch) -> ModelWorkerBatch:
    """What the device reads of a batch: index lists, not the requests' Python objects."""
    return dataclasses.replace(
        mwb,
        out_cache_loc=mwb.out_cache_loc.numpy(),
        kv_transfers=None
        if mwb.kv_transfers is None
        else [(kind, src.numpy(), dst.numpy()) for kind, src, dst in mwb.kv_transfers],
        sampling_params=[],
        output_ids=[],
        prompt_ids=[],
        decode_rows=None,  # (a tensor: the device process rebuilds the rows from the lists)
    )


def pack(obj: Any) -> Any:
    """Tensors (also inside dataclasses, e.g. `SamplingBatchInfo`) as numpy arrays, which
    pickle as raw bytes; `unpack` reverses it."""
    if isinstance(obj, torch.Tensor):
        return _Array(obj.numpy())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: pack(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return _Record(type(obj), fields)
    return obj


def unpack(obj: Any) -> Any:
    if isinstance(obj, _Array):
        return torch.from_numpy(obj.array)
    if isinstance(obj, _Record):
        return obj.cls(**{k: unpack(v) for k, v in obj.fields.items()})
    return obj


@dataclasses.dataclass
class _Array:
    array: np.ndarray


@dataclasses.dataclass
class _Record:
    cls: type
    fields: dict[str, Any]


def engine_device_runner(args: EngineArgs) -> ModelRunner:
    """The engine's model runner (model, KV pool, sampler), built in the device process."""
    return ModelRunner(ModelConfig.from_args(args), args)


# -- the device process ----------------------------------------------------------------------------
def device_main(
    conn: Any,
    make_runner: Callable[[], Any],
    rows: torch.Tensor,
    max_bs: int,
    threads: int,
    swa_map: torch.Tensor | None = None,
) -> None:
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            runner = make_runner()
            runner.req_to_token_pool.req_to_token = rows  # the scheduler's, shared
            if swa_map is not None:  # hybrid sliding-window memory: the scheduler's slot map
                runner.allocator.full_to_swa = swa_map
            device = Device(runner, max_bs)
    except BaseException:  # noqa: BLE001 - reported to the scheduler, which raises it
        conn.send_bytes(pickle.dumps(("error", -1, traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", -1)))
    with torch.inference_mode():
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the scheduler is gone
                return
            if msg[0] == "close":
                return
            if msg[0] == "call":
                answer = device.call(msg)
            elif msg[0].startswith("profile_"):
                answer = device.profile(msg)
            else:
                answer = device.run(msg)
            if answer is not None:
                conn.send_bytes(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))


class Device:
    """Jobs in arrival (= launch) order; logits of a batch whose sampling is deferred wait
    here for its `sample` message."""

    def __init__(self, runner: Any, max_bs: int) -> None:
        self.runner = runner
        self.future_map = FutureMap(max_bs, runner.device)
        self.unsampled: dict[int, tuple[torch.Tensor, ModelWorkerBatch, FutureSlots]] = {}
        self.last_info: SamplingBatchInfo | None = None
        self.profiler: Any = None  # a torch profiler, between profile_start and profile_stop

    def profile(self, msg: tuple) -> tuple | None:
        """("profile_start", -1, ProfileOptions), or ("profile_stop", -1, path), which is
        answered ("profiled", -1, None or why no trace was written)."""
        if msg[0] == "profile_start":
            if self.profiler is None:
                try:
                    self.profiler = start_profiler(msg[2])[0]
                except Exception:  # noqa: BLE001 - no profile; the stop says so
                    logger.exception("starting the device's profiler")
            return None
        prof, self.profiler = self.profiler, None
        why = "the device was not profiling" if prof is None else write_trace(prof, msg[2])
        return ("profiled", -1, why)

    def call(self, msg: tuple) -> tuple:
        """("call", -1, method, args): `runner.<method>(*args)`, answered ("called", -1,
        result, None) or ("called", -1, None, (error type, message))."""
        _, _, method, args = msg
        try:
            return ("called", -1, getattr(self.runner, method)(*args), None)
        except Exception as exc:  # noqa: BLE001 - the caller raises it; the device lives on
            logger.info("device call %s failed: %s", method, exc)
            return ("called", -1, None, (type(exc).__name__, str(exc)))

    def _info(self, packed: Any) -> SamplingBatchInfo:
        if packed != SAME_INFO:
            self.last_info = unpack(packed)
        assert self.last_info is not None, "SAME_INFO before any info"
        return self.last_info

    def run(self, msg: tuple) -> tuple | None:
        lid = msg[1]
        try:
            # first: the scheduler counts this info as received even if the batch fails
            info = None if msg[-1] is None else self._info(msg[-1])
            if msg[0] == "forward":
                _, _, mwb, slots, _ = msg
                logits = self._forward(mwb)
                if info is None:
                    self.unsampled[lid] = (logits, mwb, slots)
                    return None
                return self._sample(lid, logits, mwb, slots, info)
            assert info is not None
            logits, mwb, slots = self.unsampled.pop(lid)
            return self._sample(lid, logits, mwb, slots, info)
        except Exception:  # noqa: BLE001 - the batch fails, the device lives on
            self.unsampled.pop(lid, None)
            return ("error", lid, traceback.format_exc())

    def _forward(self, mwb: ModelWorkerBatch) -> torch.Tensor:
        mwb.out_cache_loc = torch.from_numpy(mwb.out_cache_loc)
        if mwb.kv_transfers is not None:
            mwb.kv_transfers = [(kind, torch.from_numpy(src), torch.from_numpy(dst))
                                for kind, src, dst in mwb.kv_transfers]  # fmt: skip
        return self.runner.forward(self.runner.build_forward_batch(mwb), self.future_map)

    def _sample(
        self, lid: int, logits: torch.Tensor, mwb: ModelWorkerBatch, slots: FutureSlots,
        info: SamplingBatchInfo,
    ) -> tuple:  # fmt: skip
        out = sample_into_map(self.runner, self.future_map, logits, info, mwb, slots)
        logprobs = None if out.logprobs is None else out.logprobs.numpy()
        ids = out.next_token_ids.numpy()
        return ("result", lid, ids, logprobs, out.top_logprobs, out.prompt_logprobs)
