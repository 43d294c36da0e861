"""The CUDA overlap executor on a GPU: launching a batch never waits for the device.

Before each step a sleep kernel of ~100 ms is queued on the executor's forward stream, behind
the batch in flight, so the device is busy for the whole step. The step's launch (index
copies on the scheduler's stream, attention plan, graph replay or eager kernels, sampling,
FutureMap store, the copy of the tokens to pinned memory) must still return at once: anything
that synchronizes with the forward stream (a copy from pageable host memory issued on it, an
`.item()` or `.tolist()` of a device tensor) would wait for the sleep. Only processing the
previous batch's results may wait, one step later.

Each case runs two identical rounds (the same prompts, the prefix cache flushed between
them), the first to compile and warm up: four requests decode while, at steps 2 and 4, two new
prompts and then the same two again (a prefix-cache hit: the extend reads a cached prefix)
arrive, so prefill launches happen behind a busy stream too. Greedy outputs under overlap are
checked elsewhere (test_cuda_graph_gpu, test_parity_gpu); this is about where the host waits.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import traceback

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine.config import EngineArgs, ModelConfig  # noqa: E402
from engine.engine import build_scheduler  # noqa: E402
from engine.forward_batch import ForwardMode  # noqa: E402
from engine.overlap.cuda_executor import CudaStreamExecutor  # noqa: E402
from engine.sampling.sampling_params import SamplingParams  # noqa: E402
from kernels.jit import interpreting  # noqa: E402
from tests.factories import mixed_prompts, tiny_model  # noqa: E402

if interpreting():
    pytest.skip("TRITON_INTERPRET is set: needs compiled kernels", allow_module_level=True)

SLEEP_MS = 100.0
WAITED_S = SLEEP_MS / 1e3 / 4  # a launch this long has waited for the sleep


def _sleep_cycles(ms: float) -> int:
    """Cycles of `torch.cuda._sleep` that keep the current stream busy for about `ms`."""
    probe = 10_000_000
    torch.cuda._sleep(probe)  # (first call: loads the kernel)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / start.elapsed_time(end))


def _params(max_new: int, penalized: bool = False) -> SamplingParams:
    words = [[11, 12], [13, 14, 15]]
    penalties = {"frequency_penalty": 0.5, "repetition_penalty": 1.2, "bad_words_ids": words}
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True,
                            **(penalties if penalized else {}))  # fmt: skip
    params.normalize()
    return params


CASES = [
    ("flashinfer", "bfloat16", 1, True, False),
    ("flashinfer", "bfloat16", 16, True, False),
    ("flashinfer", "bfloat16", 1, False, False),
    ("triton", "float32", 1, True, False),
    ("triton", "float32", 1, False, False),
    # penalties and bad words: counted and matched on the device
    # (engine/sampling/penalty_slots.py), not deferred
    ("flashinfer", "bfloat16", 16, True, True),
    ("triton", "float32", 1, True, True),
]


@pytest.mark.parametrize("backend,dtype,page_size,graphs,penalized", CASES)
def test_launch_does_not_wait_for_the_device(backend, dtype, page_size, graphs, penalized):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    # flashinfer's kernels take head_dim 64/128/256 (the small preset's 64; tiny's is 16)
    path = tiny_model("llama", preset="small" if backend == "flashinfer" else "tiny")
    args = EngineArgs.from_kwargs(
        model_path=path, device="cuda", dtype=dtype, attention_backend=backend,
        page_size=page_size, max_total_tokens=8192, max_running_requests=8,
        cuda_graph_bs=(1, 2, 4, 8), disable_cuda_graph=not graphs,
    )  # fmt: skip
    scheduler = build_scheduler(args, None)
    executor = scheduler.executor
    assert isinstance(executor, CudaStreamExecutor)
    launches: list[tuple[ForwardMode, float]] = []
    where: list[str] = []  # what a slow launch was doing: its stack, garbage collections
    launch_forward = executor.launch_forward
    gc_s = [0.0, 0.0]  # collection time so far, start of the running collection

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_s[1] = time.perf_counter()
        else:
            gc_s[0] += time.perf_counter() - gc_s[1]

    main = threading.get_ident()

    def snapshot() -> None:  # the launch still runs after half the bar: where is it?
        frame = sys._current_frames().get(main)
        if frame is not None:
            where.append("".join(traceback.format_stack(frame)[-12:]))

    def timed(*a: object) -> object:
        watch = threading.Timer(WAITED_S / 2, snapshot)
        gc_before, cpu, start = gc_s[0], time.thread_time(), time.perf_counter()
        watch.start()
        try:
            out = launch_forward(*a)
        finally:
            watch.cancel()
        seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
        launches.append((a[0].forward_mode, seconds))  # type: ignore[attr-defined]
        if seconds > WAITED_S:
            # the thread's CPU time tells a spinning wait in the driver (about the wall time)
            # from a thread the host did not run (far below it)
            where.append(f"^ {a[0].forward_mode.name} {seconds * 1e3:.1f} ms, this thread's "  # type: ignore[attr-defined]
                         f"CPU {cpu * 1e3:.1f} ms, garbage collection "
                         f"{(gc_s[0] - gc_before) * 1e3:.1f} ms")
        return out

    executor.launch_forward = timed  # type: ignore[method-assign]
    vocab = ModelConfig.from_pretrained(path).vocab_size
    cycles = _sleep_cycles(SLEEP_MS)
    gc.callbacks.append(on_gc)
    try:
        for rnd in range(2):  # round 0 compiles and warms up every path
            launches.clear()
            where.clear()
            assert scheduler.flush_cache()
            for i, ids in enumerate(mixed_prompts(vocab, n=4, seed=0, max_len=60)):
                scheduler.add_request(f"r{rnd}-{i}", ids, _params(12, penalized))
            wave = mixed_prompts(vocab, n=2, seed=1, max_len=60)
            for step in range(9):
                if step in (2, 4):  # new prompts, then the same again (cached prefixes)
                    for i, ids in enumerate(wave):
                        scheduler.add_request(f"r{rnd}-s{step}-{i}", list(ids),
                                              _params(4, penalized))  # fmt: skip
                with torch.cuda.stream(executor.forward_stream):
                    torch.cuda._sleep(cycles)  # the device is busy behind the batch in flight
                scheduler.step()
            while scheduler.has_work():
                scheduler.step()
        modes = {mode for mode, _ in launches}
        assert {ForwardMode.DECODE, ForwardMode.EXTEND} <= modes, modes
        waited = [(mode.name, round(s * 1e3, 1)) for mode, s in launches if s > WAITED_S]
        assert not waited, (
            f"launches that waited for the device (mode, ms): {waited}; where they were "
            "after half the bar:\n" + "\n".join(where)
        )
    finally:
        gc.callbacks.remove(on_gc)
        scheduler.close()
