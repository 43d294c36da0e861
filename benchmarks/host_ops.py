"""Torch ops the host issues per decode step outside the model, this tree against a baseline
revision: what a GPU waits for in a host-bound step, counted where no GPU is needed.

    python benchmarks/host_ops.py [--base REV] [--batch-sizes 1 64] [--page-sizes 1 16]

On the H100 (benchmarks/results/gpu_overlap.json) the overlap loop at batch 64 was host
bound: 1.8 ms of host time per decode step against 0.96 ms of GPU work, and the profiler put
most of that host time inside torch ops (each op on a CUDA tensor is a launch or a copy, some
microseconds of host time each). This counts those ops on CPU, deterministically: a real
engine (a tiny Llama, head_dim 64, bfloat16) with the flashinfer backend over the stand-in
for flashinfer of tests/unit/test_flashinfer_indices.py and decode "graphs" replayed by the
CPU stand-in for CUDA graphs (`EagerGraphCapturer`), so that a decode step takes the GPU's
path: schedule, allocate, build the forward batch, load the graph's static inputs, plan
(page table + plan), replay, sample, process the results. A TorchDispatchMode counts every
aten op the scheduler thread dispatches during steady decode steps, except inside the model
(a graph replay on the GPU) and inside the stand-in's own methods (flashinfer's plan is C++
there). Triton launches are counted too (`triton_launches`): they are launches, not aten ops.

Views (slice, select, view, unbind...) cost host time but launch nothing; they are counted
apart (`views`). Not seen here: copies a GPU makes implicitly, e.g. of CPU index tensors that
index a CUDA tensor (`t[cpu_rows, cpu_cols] = v` copies both index tensors to the device
first; on CPU nothing is copied). The counts therefore understate code that indexes device
tensors with host indices, and an explicit `.to(device)` ("to") counts one op where that code
counted none. The counts are exact and repeatable, so one run per tree suffices; what they
save in microseconds depends on the GPU host and is measured in the GPU session.

Second count (table "reads"; with `--swa` for a sliding-window model with hybrid window
memory, `--hybrid-swa-memory`, instead): host reads of device memory in a serving-like run
(requests of different lengths arriving, chunked prefill into partly filled pages, finishing
at different steps, prefix cache on, page size 16; the allocator defers its checks as on
CUDA). Each read (`.item()`, `bool()`, `.tolist()`, `.cpu()` of a tensor, or an op whose
output size depends on the data: `unique`, `nonzero`...) waits for the device: on the GPU, a
round trip of some tens of microseconds. Counted: the aten ops that read, and the Tensor
methods that do, on the scheduler thread, except the step's sampled tokens (read once per
step by design: one step late with the overlap scheduler) and the allocator's amortized
`verify`. The stand-in's own methods are not counted (flashinfer's plan reads its host
tables, which are host memory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8  # steady decode steps counted per case


def child(root: str, bs: int, page_size: int, reads: str = "") -> dict[str, Any]:
    """Ops per steady decode step of `bs` requests, importing from `root` (`reads`, "plain"
    or "overlap": host reads of device memory per step of a serving-like run with that
    scheduler loop, see the module's docstring)."""
    sys.path.insert(0, root)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.set_num_threads(1)
    from engine.attention import flashinfer_backend as fib
    from engine.cuda_graph_runner import EagerGraphCapturer, _EagerGraph
    from engine.engine import Engine
    from engine.sampling.sampling_params import SamplingParams
    from tests.factories import tiny_model
    from tests.unit import test_flashinfer_indices as stand_in

    paused = [0]

    def pausing(fn):  # noqa: ANN001, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            paused[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                paused[0] -= 1

        return wrapper

    for cls in (stand_in.BatchPrefillWithRaggedKVCacheWrapper,
                stand_in.BatchPrefillWithPagedKVCacheWrapper,
                stand_in.BatchDecodeWithPagedKVCacheWrapper):  # fmt: skip
        for name in ("plan", "forward", "forward_return_lse"):
            if name in vars(cls):
                setattr(cls, name, pausing(vars(cls)[name]))
    fib.load_flashinfer = lambda device: stand_in.FAKE_FLASHINFER
    _EagerGraph.replay = pausing(_EagerGraph.replay)

    ops: Counter[str] = Counter()
    launches = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if not paused[0]:
                ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    try:  # Triton launches (the page-table kernel), counted where they are made
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run

        def counted_run(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if not paused[0]:
                launches[0] += 1
            paused[0] += 1
            try:
                return run(self, *args, **kwargs)
            finally:
                paused[0] -= 1

        InterpretedFunction.run = counted_run
    except ImportError:
        pass

    reads, swa = reads.removesuffix("+swa"), reads.endswith("+swa")
    model = (tiny_model("mistral", head_dim=64, sliding_window=SWA_WINDOW) if swa
             else tiny_model("llama", head_dim=64))  # fmt: skip
    engine = Engine(model_path=model, device="cpu", dtype="bfloat16",
                    attention_backend="flashinfer", disable_overlap_schedule=reads != "overlap",
                    cpu_overlap_executor="thread", max_running_requests=max(bs, 8),
                    page_size=page_size, disable_radix_cache=not reads,
                    chunked_prefill_size=READS_CHUNK if reads else None,
                    **({"hybrid_swa_memory": True} if swa else {}))  # fmt: skip
    runner = engine.scheduler.model_runner
    runner.use_cuda_graph = True
    runner.graph_capturer_factory = lambda device: EagerGraphCapturer()
    _use_kernels(runner)
    sched = engine.scheduler
    if reads:
        for alloc in (sched.pools.allocator, getattr(sched.pools.allocator, "swa", None)):
            if alloc is not None:  # as on CUDA (an attribute of this tree's allocators)
                alloc.defer_checks = True
        if reads == "overlap":  # the CUDA executor's host path: launches on this thread
            from benchmarks.host_overhead import _inline_executor

            sched.executor.close()
            sched.executor = _inline_executor(sched)
        return _count_reads(sched, engine, bs, paused, 2 * SWA_WINDOW if swa else 0)
    params = SamplingParams(max_new_tokens=STEPS + 12, temperature=0.0, ignore_eos=True)
    params.normalize()
    for i in range(bs):
        sched.add_request(f"r{i}", [5 + (i * 7 + j) % 90 for j in range(20 + i % 13)], params)
    counted, triton_launches, steps, seen = Counter(), 0, 0, 0
    while sched.has_work() and steps < STEPS:
        before, before_launches = ops.copy(), launches[0]
        with torch.inference_mode(), Count():
            sched.step()
        last = sched.last_batch
        if last is not None and last.forward_mode.is_decode() and len(last.reqs) == bs:
            seen += 1
            if seen > 1:  # (the first captures the graphs)
                counted += ops - before
                triton_launches += launches[0] - before_launches
                steps += 1
    engine.shutdown()
    assert steps == STEPS, f"only {steps} steady decode steps"
    n = steps
    per_step = {k: v / n for k, v in sorted(counted.items(), key=lambda kv: -kv[1])}
    views = sum(v for k, v in per_step.items() if k in VIEW_OPS)
    total = sum(per_step.values())
    return {"ops": total - views, "views": views, "triton_launches": triton_launches / n,
            "by_op": per_step}


READS_CHUNK = 40  # chunked prefill: chunks end inside a page of 16
SWA_WINDOW = 24  # --swa: the window of the sliding-window model (hybrid window memory)
READ_OPS = {"_local_scalar_dense", "is_nonzero", "_unique2", "unique_dim", "unique_consecutive",
            "nonzero", "masked_select", "equal"}  # fmt: skip


def _count_reads(sched: Any, engine: Any, bs: int, paused: list[int], longer: int = 0
                 ) -> dict[str, Any]:  # fmt: skip
    """Host reads of device memory per scheduler step of a serving-like run: `bs` requests
    of 20..92 prompt tokens (a shared 32-token prefix for half of them) and 2..24 (+ `longer`:
    the sliding-window model's requests decode past their window) new tokens, a third at the
    start, the rest two per step."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from engine.sampling.sampling_params import SamplingParams

    where: Counter[str] = Counter()
    # (.numpy() is left out: a CUDA tensor refuses it, so it only ever reads host memory)
    methods = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__")
    allowed = ("process_batch_result", "verify")  # the step's tokens; the amortized checks
    active = [False]

    def reading(name: str, fn: Any) -> Any:
        def wrapper(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if active[0] and not paused[0]:
                _record(where, name, allowed)
            return fn(self, *args, **kwargs)

        return wrapper

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            name = func.overloadpacket.__name__
            if not paused[0] and name in READ_OPS:
                _record(where, f"{name} (aten)", allowed)
            return func(*args, **(kwargs or {}))

    saved = {m: getattr(torch.Tensor, m) for m in methods}
    for m in methods:
        setattr(torch.Tensor, m, reading(m, saved[m]))
    prompts = [([7] * 32 if i % 2 else []) + [5 + (i * 7 + j) % 90 for j in range(20 + i * 11 % 61)]
               for i in range(bs)]  # fmt: skip
    pending = list(range(bs))
    steps = 0

    def admit(n: int) -> None:
        for i in pending[:n]:
            params = SamplingParams(max_new_tokens=2 + i * 5 % 23 + longer, temperature=0.0,
                                    ignore_eos=True)  # fmt: skip
            params.normalize()
            sched.add_request(f"r{i}", prompts[i], params)
        del pending[:n]

    try:
        admit(bs // 3)
        while sched.has_work() or pending:
            admit(2)
            active[0] = True
            with torch.inference_mode(), Reads():
                sched.step()
            active[0] = False
            steps += 1
    finally:
        for m in methods:
            setattr(torch.Tensor, m, saved[m])
        engine.shutdown()
    return {"steps": steps, "reads": sum(where.values()), "by_site": dict(where.most_common())}


def _record(where: Any, name: str, allowed: tuple[str, ...]) -> None:
    """Count a read at its innermost call site in engine/ (not in kernels/: launches), unless
    that is a function `allowed` names."""
    import traceback

    frames = [f for f in traceback.extract_stack()[:-2] if f"{os.sep}engine{os.sep}" in f.filename]
    if not frames or frames[-1].name in allowed:
        return
    f = frames[-1]
    where[f"{name} {os.path.basename(f.filename)}:{f.name}"] += 1


VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "unbind", "alias", "as_strided",
            "detach", "expand", "t", "transpose", "unsqueeze", "squeeze", "reshape", "split",
            "narrow", "permute", "lift_fresh", "_reshape_alias", "numpy_T", "unfold"}


def _use_kernels(runner: Any) -> None:
    """The page table takes its GPU path (the Triton kernel, here interpreted) where this tree
    has one: `compiled_on` is false on CPU."""
    try:
        from engine.attention import page_table
    except ImportError:
        return
    if getattr(page_table, "page_ids", None) is not None:
        page_table.compiled_on = lambda x: True


def measure(root: str, bs: int, page_size: int, reads: str = "") -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", root, str(bs), str(page_size),
           reads or "-"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "PYTHONPATH": root}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=root)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the baseline git revision")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--name", default="host_ops", help="results file benchmarks/results/NAME.json")
    ap.add_argument("--requests", type=int, default=24,
                    help="requests of the serving-like run that counts host reads")
    ap.add_argument("--swa", action="store_true",
                    help="count host reads with a sliding-window model and hybrid window memory "
                         "(--hybrid-swa-memory) instead, its requests decoding past the window; "
                         "no ops table")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        root, bs, page_size, reads = args.child
        print(json.dumps(child(root, int(bs), int(page_size), reads.strip("-"))))
        return
    sys.path.insert(0, ROOT)
    from benchmarks.common import base_worktree, print_table, write_result

    rows, detail, read_rows = [], {}, []
    with base_worktree(ROOT, args.base) as (base, revs):
        for model, suffix in [("mistral-swa", "+swa") if args.swa else ("llama", "")]:
            for page_size in args.page_sizes:
                for loop in ("plain", "overlap"):
                    ours, theirs = (measure(root, args.requests, page_size, loop + suffix)
                                    for root in (ROOT, base))  # fmt: skip
                    read_rows.append({"model": model, "loop": loop, "requests": args.requests,
                                      "page_size": page_size, "steps": ours["steps"],
                                      "reads": ours["reads"], "base_steps": theirs["steps"],
                                      "base_reads": theirs["reads"]})  # fmt: skip
                    detail[f"reads_{loop}_page{page_size}{suffix}"] = {
                        "tree": ours["by_site"], "base": theirs["by_site"]}
                    print_table(read_rows[-1:], list(read_rows[-1]))
        for page_size in [] if args.swa else args.page_sizes:
            for bs in args.batch_sizes:
                ours, theirs = measure(ROOT, bs, page_size), measure(base, bs, page_size)
                detail[f"bs{bs}_page{page_size}"] = {"tree": ours["by_op"], "base": theirs["by_op"]}
                rows.append({"batch": bs, "page_size": page_size,
                             "ops": ours["ops"], "base_ops": theirs["ops"],
                             "views": ours["views"], "base_views": theirs["views"],
                             "triton": ours["triton_launches"],
                             "base_triton": theirs["triton_launches"]})
                print_table(rows[-1:], list(rows[-1]))
    if rows:
        print_table(rows, list(rows[0]))
    print_table(read_rows, list(read_rows[0]))
    summary = {f"bs{r['batch']}_page{r['page_size']}_launches": r["ops"] + r["triton"]
               for r in rows}
    summary.update({f"bs{r['batch']}_page{r['page_size']}_base_launches":
                    r["base_ops"] + r["base_triton"] for r in rows})
    for r in read_rows:
        tag = f"{r['loop']}_page{r['page_size']}{'_swa' if r['model'] != 'llama' else ''}"
        summary[f"{tag}_host_reads"] = r["reads"]
        summary[f"{tag}_base_host_reads"] = r["base_reads"]
    results = {**revs, "steps": STEPS, "cases": rows, "reads": read_rows, "detail": detail}
    print(write_result(args.name, results, summary, notes=__doc__.split("\n\n")[1]))


if __name__ == "__main__":
    main()
