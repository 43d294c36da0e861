"""Overlap scheduler on CPU: scheduler overhead, and overlap on vs off.

    python benchmarks/overlap.py [--quick] [--threads 1 2] [--reps 3]

1. Scheduler overhead with a null model runner (no compute, a fixed token): wall and CPU time
   per decode step, and per request admitted by a prefill step, at batch 1, 64, 256, 1024.
2. Step time with overlap off and on, against the forward + sampling time T_f and the
   scheduler's CPU work T_c, measured separately (T_c: the same requests on the null runner).
   The plain loop costs T_f + T_c per step; ideal overlap max(T_f, T_c). Throughput and
   inter-token latency (p50/p99) of whole runs, overlap on vs off, alternated, medians.
   * "device-sleep": the null runner whose forward waits T_f = T_c without using the CPU
     (GIL released): an emulated accelerator, which is what the CUDA executor faces.
   * "device-matmul": the null runner whose forward runs matmuls (GIL-free CPU compute)
     calibrated to T_f = T_c: a CPU model; it can only overlap if a second core is free.
   * "tiny" and "tiny+stop": a real (tiny, random) Llama; its forward is Python dispatch
     rather than compute (it holds the GIL), and T_f >> T_c even with stop strings checked
     every step. "wide": compute-bound layers (GIL released), still T_f >> T_c.

Each case runs three loops, alternated: plain (overlap off), overlap with the default CPU
executor (a device process, engine/overlap/process_executor.py) and overlap with the forward
thread (cpu_overlap_executor=thread; the `thread_*` columns). The device process needs a
second free core to overlap; the thread also needs the forward to spend its time inside
torch ops (which release the GIL) rather than in Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_result  # noqa: E402
from engine.config import EngineArgs  # noqa: E402
from engine.engine import build_scheduler  # noqa: E402
from engine.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from engine.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from engine.mem_cache.radix_cache import RadixCache  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.overlap.future_map import FutureMap  # noqa: E402
from engine.overlap.process_executor import ProcessExecutor  # noqa: E402
from engine.overlap.scheduler import OverlapScheduler  # noqa: E402
from engine.sampling.sampler import Sampler  # noqa: E402
from engine.sampling.sampling_batch_info import SamplingInfoCache  # noqa: E402
from engine.sampling.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler.scheduler import Scheduler  # noqa: E402

FIXED_TOKEN = 7
NULL_VOCAB = 64


class NullModelRunner:
    """The model runner with no model: every request samples FIXED_TOKEN (host work as the
    real runner's). Each forward first runs `compute_reps` fixed matmuls (GIL-free CPU
    compute) and then sleeps `sleep_s` (device time that uses no CPU)."""

    # the real runner's host work: index tensors, sampling inputs, the sampler
    build_forward_batch = ModelRunner.build_forward_batch
    sample = ModelRunner.sample
    forward_batch_generation = ModelRunner.forward_batch_generation

    def __init__(
        self, max_running: int, context_len: int, kv_tokens: int, compute_reps: int = 0,
        sleep_s: float = 0.0,
    ) -> None:
        self.device = torch.device("cpu")
        self.model_config = SimpleNamespace(
            context_len=context_len, eos_token_ids=(0,), vocab_size=NULL_VOCAB
        )
        self.req_to_token_pool = ReqToTokenPool(max_running + 1, context_len + 8)
        self.allocator = TokenToKVPoolAllocator(kv_tokens, 1)
        self.kv_pool = self.attn_backend = self.pooling = None
        self.sampler = Sampler(seed=0, device=self.device)
        self.sampling_cache = SamplingInfoCache()
        self._logits = torch.zeros(NULL_VOCAB)
        self._logits[FIXED_TOKEN] = 1.0
        self.compute_reps = compute_reps
        self.sleep_s = sleep_s
        self._a, self._w = torch.randn(64, 256), torch.randn(256, 256)

    def _compute(self) -> None:
        for _ in range(self.compute_reps):
            torch.mm(self._a, self._w)
        if self.sleep_s:
            time.sleep(self.sleep_s)

    def forward(self, fb: object, future_map: FutureMap | None = None) -> torch.Tensor:
        if future_map is not None:
            future_map.resolve_future(fb.input_ids)  # type: ignore[attr-defined]
        self._compute()
        return self._logits.expand(fb.batch_size, -1)  # type: ignore[attr-defined]


def _requests(
    n: int, vocab: int, max_new: int, stop: list[str] | None = None, **extra: object
) -> list:
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, stop=stop,
                            **extra)  # type: ignore[arg-type]  # fmt: skip
    params.normalize()
    return [
        (f"r{i}", [rng.randrange(8, vocab) for _ in range(rng.randint(16, 48))], params)
        for i in range(n)
    ]


LOOPS = ("plain", "process", "thread")  # no overlap; overlap with each CPU executor


def _null_scheduler(
    bs: int, loop: str, max_new: int, compute_reps: int = 0, tokenizer: object = None,
    sleep_s: float = 0.0,
) -> Scheduler:
    spec = (bs, 4096, bs * (64 + max_new + 8), compute_reps, sleep_s)
    runner = NullModelRunner(*spec)
    args = EngineArgs(
        model_path="null", max_running_requests=bs, chunked_prefill_size=-1,
        max_prefill_tokens=1 << 30, init_new_token_ratio=1.0,
        max_total_tokens=runner.allocator.size, cpu_overlap_executor="thread",
    )
    cache = RadixCache(runner.req_to_token_pool, runner.allocator, 1)
    if loop == "plain":
        return Scheduler(args, runner, cache, tokenizer)
    executor = None
    if loop == "process":  # the device process builds its own null runner, by module name
        cls = importlib.import_module("benchmarks.overlap").NullModelRunner
        fmap = FutureMap(runner.req_to_token_pool.size)
        executor = ProcessExecutor(runner, fmap, make_runner=functools.partial(cls, *spec))
    return OverlapScheduler(args, runner, cache, tokenizer, executor=executor)


def _model_scheduler(path: str, bs: int, loop: str, tokenizer: object = None) -> Scheduler:
    args = EngineArgs.from_kwargs(
        model_path=path, disable_overlap_schedule=loop == "plain", max_running_requests=bs,
        chunked_prefill_size=-1, max_prefill_tokens=1 << 20, init_new_token_ratio=1.0,
        cpu_overlap_executor="thread" if loop == "thread" else "process",
    )
    return build_scheduler(args, tokenizer)


def _timed_steps(scheduler: Scheduler, n: int) -> tuple[list[float], list[float]]:
    walls, cpus = [], []
    for _ in range(n):
        w, c = time.perf_counter(), time.process_time()
        scheduler.step()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return walls, cpus


def _close(scheduler: Scheduler) -> None:
    getattr(scheduler, "close", lambda: None)()


def null_overhead(batch_sizes: list[int], steps: int) -> list[dict]:
    rows = []
    for bs in batch_sizes:
        for loop in LOOPS:
            s = _null_scheduler(bs, loop, max_new=steps + 40)
            for rid, ids, p in _requests(bs, NULL_VOCAB, steps + 40):
                s.add_request(rid, ids, p)
            # One prefill step admits all of them; the overlap loop processes it one step
            # later, so admission = first two steps - one decode step, for both loops.
            w, _ = _timed_steps(s, 2)
            _timed_steps(s, 5)
            dw, dc = _timed_steps(s, steps)
            prefill = sum(w) - statistics.median(dw)
            rows.append({
                "batch": bs, "loop": loop,
                "decode_step_ms": 1e3 * statistics.median(dw),
                "decode_step_cpu_ms": 1e3 * statistics.median(dc),
                "prefill_ms": 1e3 * prefill, "admission_us": 1e6 * prefill / bs,
            })
            _close(s)
    return rows


def run_workload(scheduler: Scheduler, reqs: list) -> dict:
    """Every request at once; decode step times while all run; inter-token latencies."""
    for rid, ids, p in reqs:
        scheduler.add_request(rid, ids, p)
    arrivals: dict[str, list[float]] = defaultdict(list)
    steps: list[float] = []
    num_tokens = 0
    t0 = time.perf_counter()
    while scheduler.has_work():
        w = time.perf_counter()
        events = scheduler.step()
        now = time.perf_counter()
        if len(scheduler.running_batch) == len(reqs):
            steps.append(now - w)
        for ev in events:
            if ev.new_token_ids:
                arrivals[ev.rid].append(now)
                num_tokens += len(ev.new_token_ids)
    elapsed = time.perf_counter() - t0
    _close(scheduler)
    itl = [b - a for ts in arrivals.values() for a, b in zip(ts, ts[1:])]
    q = statistics.quantiles(itl, n=100)
    return {"step_ms": 1e3 * statistics.median(steps[2:-2]), "tok_s": num_tokens / elapsed,
            "itl_p50_ms": 1e3 * q[49], "itl_p99_ms": 1e3 * q[98], "seconds": elapsed}


def forward_time(make, reqs: list, reps: int = 15) -> float:  # noqa: ANN001
    """T_f: forward + sampling of the workload's full decode batch, alone (median seconds)."""
    s = make("plain")
    for rid, ids, p in reqs:
        s.add_request(rid, ids, p)
    _timed_steps(s, 4)
    batch = s.update_running_batch()
    assert batch is not None and len(batch) == len(reqs)
    mwb = batch.get_model_worker_batch()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        s.model_runner.forward_batch_generation(mwb)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def scheduler_time(reqs: list, tokenizer: object = None, steps: int = 30) -> float:
    """T_c: the plain loop's step on the null runner for the same requests (median seconds;
    each request asks for enough tokens to keep running through the measurement)."""
    s = _null_scheduler(len(reqs), False, steps + 8, tokenizer=tokenizer)
    for rid, ids, p in reqs:
        s.add_request(rid, ids, dataclasses.replace(p, max_new_tokens=steps + 8))
    _timed_steps(s, 4)
    return statistics.median(_timed_steps(s, steps)[0])


def _model(name: str) -> str:
    from services.tiny_model import make_tiny_model

    path = os.path.join(tempfile.gettempdir(), f"sluice-bench-overlap-{name}")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_model(path, arch="llama", **MODELS[name])
    return path


MODELS = {
    "tiny": {"preset": "tiny"},
    "wide": {"preset": "tiny", "hidden_size": 1024, "num_layers": 1, "num_heads": 8,
             "num_kv_heads": 8, "intermediate_size": 4096, "vocab_size": 4096},
}
# sampling that reads the output so far (the overlap loop keeps what it needs on the device)
SAMPLING: dict[str, dict] = {
    "": {},
    "penalty": {"frequency_penalty": 0.5, "presence_penalty": 0.5},
    "badwords": {"bad_words_ids": [[9, 10], [11, 12, 13], [FIXED_TOKEN, 14]]},  # never complete
}
STOP = ["zzqx", "qxzz yy"]  # never matched: the check runs every step for every request


def compare(case: str, bs: int, max_new: int, reps: int) -> dict:
    """T_f, T_c, then plain and overlap runs alternated; medians."""
    tokenizer = None
    if case.startswith("device-sleep"):  # "device-sleep+<SAMPLING key>": every request has it
        reqs = _requests(bs, NULL_VOCAB, max_new, **SAMPLING[case.partition("+")[2]])
        t_c = scheduler_time(reqs)

        def make(loop: str) -> Scheduler:
            return _null_scheduler(bs, loop, max_new, sleep_s=t_c)  # T_f = T_c
    elif case == "device-matmul":
        reqs = _requests(bs, NULL_VOCAB, max_new)
        t_c = scheduler_time(reqs)
        compute = 1
        for _ in range(2):  # T_f = T_c (the forward also carries the runner's host work)
            t_f = forward_time(lambda lp, c=compute: _null_scheduler(bs, lp, max_new, c), reqs)
            compute = max(1, round(compute * t_c / t_f))

        def make(loop: str) -> Scheduler:
            return _null_scheduler(bs, loop, max_new, compute)
    else:
        from engine.tokenizer import load_tokenizer

        path = _model(case.split("+")[0])
        tokenizer = load_tokenizer(path)
        reqs = _requests(bs, tokenizer.vocab_size, max_new, STOP if "+stop" in case else None)
        t_c = scheduler_time(reqs, tokenizer)

        def make(loop: str) -> Scheduler:
            return _model_scheduler(path, bs, loop, tokenizer)
    t_f = forward_time(make, reqs)
    runs: dict[str, list[dict]] = {loop: [] for loop in LOOPS}
    for i in range(reps):  # rotate the order, so that load changes hit all alike
        for loop in LOOPS[i % 3:] + LOOPS[:i % 3]:
            runs[loop].append(run_workload(make(loop), reqs))
    off, on, thread = ({k: statistics.median(r[k] for r in runs[loop]) for k in runs[loop][0]}
                       for loop in LOOPS)
    return {
        "case": case, "batch": bs, "max_new_tokens": max_new, "threads": torch.get_num_threads(),
        "T_f_ms": 1e3 * t_f, "T_c_ms": 1e3 * t_c, "T_f_plus_T_c_ms": 1e3 * (t_f + t_c),
        "plain_step_ms": off["step_ms"], "overlap_step_ms": on["step_ms"],
        "overlap_step_vs_max_part": on["step_ms"] / (1e3 * max(t_f, t_c)),
        "plain_tok_s": off["tok_s"], "overlap_tok_s": on["tok_s"],
        "throughput_on_vs_off": on["tok_s"] / off["tok_s"],
        "decode_step_off_vs_on": off["step_ms"] / on["step_ms"],
        "plain_itl_p50_ms": off["itl_p50_ms"], "plain_itl_p99_ms": off["itl_p99_ms"],
        "overlap_itl_p50_ms": on["itl_p50_ms"], "overlap_itl_p99_ms": on["itl_p99_ms"],
        # the same with the forward thread as the device (cpu_overlap_executor="thread")
        "thread_step_ms": thread["step_ms"],
        "thread_step_vs_max_part": thread["step_ms"] / (1e3 * max(t_f, t_c)),
        "thread_on_vs_off": thread["tok_s"] / off["tok_s"],
        "runs": runs,
    }


def parallelism_probe(reps: int = 60) -> dict:
    """Whether this process gets two cores right now: the same GIL-free matmuls on two
    threads, one after the other vs at once. 2.0 = two free cores; 1.0 = one core's worth
    (a busy shared machine: the scheduler gives each busy session an equal share)."""
    a, w = torch.randn(256, 512), torch.randn(512, 512)

    def compute() -> None:
        torch.set_num_threads(1)
        for _ in range(reps):
            torch.mm(a, w)

    t = time.perf_counter()
    compute()
    compute()
    serial = time.perf_counter() - t
    t = time.perf_counter()
    thread = threading.Thread(target=compute)
    thread.start()
    compute()
    thread.join()
    both = time.perf_counter() - t
    return {"serial_s": serial, "concurrent_s": both, "speedup": serial / both,
            "loadavg": os.getloadavg()}


NOTES = [
    "The plain loop costs T_f + T_c per decode step; the overlap loop max(T_f, T_c) at best. "
    "On CPU the overlap loop's device is by default a second process (cpu_overlap_executor="
    "process): scheduler and forward each have an interpreter of their own, so they run at "
    "once when two cores are free. parallelism_probe.speedup is what two threads of GIL-free "
    "matmuls got at the time (2.0 = two free cores, 1.0 = one core's worth); with one core's "
    "worth the overlap loop can only lose.",
    "T_c is the plain loop's step on the null runner: it includes the host side of the "
    "forward (index tensors, sampling inputs, the sampler), which the process loop moves to "
    "the device process, so overlap_step_vs_max_part can be below 1.",
    "thread_* columns: the same loop with a forward thread as the device "
    "(cpu_overlap_executor=thread). It shares the scheduler's GIL: after every torch op the "
    "forward thread must take the GIL back from a scheduler busy in Python (tens of "
    "microseconds per hand-off on this VM, hundreds of ops per forward), so it loses on CPU "
    "models; it only overlaps a device that needs no Python (device-sleep).",
    "device-sleep emulates an accelerator (the forward waits without using the CPU), which "
    "is what the CUDA executor faces.",
    "tiny / tiny+stop: a small model's forward is Python dispatch of many small ops and "
    "T_f >> T_c unless stop strings are checked every step (tiny+stop): overlap can save at "
    "most T_c / (T_f + T_c) (SGLang issue #2558 is the GPU analogue: small models, where the "
    "overhead is not the scheduler's).",
    "wide: compute-bound layers, T_f >> T_c: nothing to hide.",
    "threads=2 rows (when run): two intra-op threads on a busy 2-core machine make every "
    "matmul many times slower in the plain loop; those ratios measure that pathology.",
    "Small batches: the process loop pays a pickled message and a pipe round trip per step "
    "(null runner, bs 1: 0.40 vs 0.17 ms). On CPU, --disable-overlap-schedule is the better "
    "choice for latency at batch 1 or when fewer than two cores are free.",
]

COLUMNS = ["case", "batch", "threads", "T_f_ms", "T_c_ms", "plain_step_ms", "overlap_step_ms",
           "overlap_step_vs_max_part", "decode_step_off_vs_on", "throughput_on_vs_off",
           "thread_step_vs_max_part", "thread_on_vs_off",
           "plain_itl_p99_ms",
           "overlap_itl_p99_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    probe_before = parallelism_probe()
    print("parallelism probe:", probe_before)
    sizes = [1, 64] if args.quick else [1, 64, 256, 1024]
    null = null_overhead(sizes, steps=10 if args.quick else 30)
    print_table(null, ["batch", "loop", "decode_step_ms", "decode_step_cpu_ms",
                       "prefill_ms", "admission_us"])
    cases = [("device-sleep", 64, 32), ("device-matmul", 64, 32), ("tiny", 16, 16)]
    if not args.quick:
        cases = [("device-sleep", 64, 256), ("device-sleep", 256, 192),
                 ("device-matmul", 64, 256), ("device-matmul", 256, 192), ("tiny", 64, 128),
                 ("tiny+stop", 256, 96), ("wide", 16, 64)]
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for case, bs, max_new in cases:
            if threads > 1 and case.startswith("device"):
                continue  # its compute is one-thread matmuls or none either way
            rows.append(compare(case, bs, max_new, 1 if args.quick else args.reps))
            print_table(rows[-1:], COLUMNS)
    print_table(rows, COLUMNS)
    def row(case: str) -> dict:  # the largest batch of a case, 1 thread
        return max((r for r in rows if r["case"] == case and r["threads"] == 1),
                   key=lambda r: r["batch"])

    cpu_model, emulated = row("device-matmul"), row("device-sleep")
    summary = {
        # the CPU model (forward = GIL-free matmuls, T_f = T_c)
        "overlap_on_vs_off": cpu_model["throughput_on_vs_off"],
        "overlapped_step_vs_max_part": cpu_model["overlap_step_vs_max_part"],
        "null_step_ms_bs256": next(
            r["decode_step_ms"] for r in null if r["batch"] == 256 and r["loop"] == "plain"
        ) if 256 in sizes else None,
        "headline_case": {k: cpu_model[k] for k in ("case", "batch", "threads")},
        # an emulated accelerator (the forward waits T_f = T_c without using the CPU)
        "emulated_device_on_vs_off": emulated["throughput_on_vs_off"],
        "emulated_device_step_vs_max_part": emulated["overlap_step_vs_max_part"],
        "all_cases_on_vs_off": {
            f"{r['case']}/bs{r['batch']}/t{r['threads']}": r["throughput_on_vs_off"] for r in rows
        },
        "all_cases_thread_executor_on_vs_off": {
            f"{r['case']}/bs{r['batch']}/t{r['threads']}": r["thread_on_vs_off"] for r in rows
        },
    }
    torch.set_num_threads(1)
    probes = {"before": probe_before, "after": parallelism_probe()}
    summary["parallelism_probe_speedup"] = [p["speedup"] for p in probes.values()]
    name = "overlap_quick" if args.quick else "overlap"
    results = {"null_runner": null, "models": rows, "parallelism_probe": probes}
    print(write_result(name, results, summary, notes=NOTES))


if __name__ == "__main__":
    main()
