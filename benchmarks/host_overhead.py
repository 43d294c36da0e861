"""Scheduler host time per decode step, this tree against a baseline revision, side by side.

    python benchmarks/host_overhead.py [--base REV] [--batch-sizes 1 64 256] [--reps 5]
        [--loops plain overlap inline] [--name host_overhead]

What a GPU waits for when the model is fast: everything the scheduler does on the host for one
decode step (choose the batch, allocate KV slots, build the index and sampling tensors, sample,
turn the tokens into request progress), measured with the null model runner of
`benchmarks/overlap.py` (no compute, every request samples one fixed token; the real runner's
`build_forward_batch` and `sample`). With CUDA graphs and the overlap scheduler this is the
floor of a decode step on the GPU, and where it exceeds the forward the GPU idles (issue 5's
`gpu_idle_fraction_overlap`).

The baseline revision (default: HEAD) is checked out into a temporary git worktree; each
measurement is a child process that imports either tree, and the two alternate, `--reps` times
per case, so both see the same machine state. Loops: "plain" (overlap off), "overlap" (the
overlap scheduler with the forward-thread executor, whose forward is the null runner's: the
overlap loop's bookkeeping plus the GIL hand-offs with that thread) and "inline" (the overlap
scheduler with an executor that does the null forward and the sampling at launch, on the
scheduler thread: the host path of the CUDA executor, which launches from the scheduler thread
and has no second thread, without the kernel launches); also "process" (the CPU default: the
device process, whose null forward answers over a pipe) and "worker" (the plain loop plus
what a served worker's scheduler thread adds to each step: the step's record for its I/O
process, `step_records`, packed for the pipe); and "io" (no scheduler: the worker's I/O
process turning such a record into the detokenizers' packed `StepOutputMsg`, which it must
do at the pace of the steps). Per case: the median step of each
child (over `--steps` steps after a warm-up), then the median over the repetitions; the ratio
is this tree / baseline (< 1: less host time per step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(root: str, loop: str, bs: int, steps: int) -> float:
    """Median wall time (s) of a decode step of `bs` requests, importing from `root`."""
    sys.path.insert(0, root)
    if loop == "io":
        return _io_step(bs, steps)
    import torch

    torch.set_num_threads(1)
    from benchmarks.overlap import NULL_VOCAB, _close, _null_scheduler, _requests

    kind = loop if loop in ("plain", "process") else "plain" if loop == "worker" else "thread"
    scheduler = _null_scheduler(bs, kind, steps + 60)
    if loop == "inline":
        scheduler.executor.close()
        scheduler.executor = _inline_executor(scheduler)
    record = _worker_record() if loop == "worker" else None
    for rid, ids, params in _requests(bs, NULL_VOCAB, steps + 60):
        scheduler.add_request(rid, ids, params)
    for _ in range(10):  # the prefill and the first decode steps
        scheduler.step()
    walls = []
    for step in range(steps):
        t = time.perf_counter()
        events = scheduler.step()
        if record is not None:
            record(step, events)
        walls.append(time.perf_counter() - t)
    _close(scheduler)
    return statistics.median(walls)


def _io_step(bs: int, steps: int) -> float:
    """Median wall time (s) of the worker's I/O process turning a decode step's record of
    `bs` requests (one token each) into the detokenizers' message, packed (this tree's code;
    a tree from before plain rows gets the same rows as row records)."""
    import services.worker_requests as wr

    infos = {f"req-{i:032x}": wr.ReqInfo("router-0", True, True, 100) for i in range(bs)}
    rids = list(infos)
    windows = wr.Windows() if hasattr(wr, "Windows") else None
    walls = []
    for step in range(steps + 20):
        if windows is not None:
            args = ([], infos, "w0", step, [rids, [step] * bs, [7] * bs, [0] * bs], windows)
        else:
            window = list(range(max(0, step - 6), step))
            args = ([(rid, step, [7], window, None, 0, None, None, None) for rid in rids],
                    infos, "w0", step)  # fmt: skip
        t = time.perf_counter()
        wr.step_message(*args).to_msg()
        walls.append(time.perf_counter() - t)
    return statistics.median(walls[20:])


def _worker_record() -> object:
    """What the worker's scheduler thread adds to a step: the step's events as its record
    for the I/O process, packed as the pipe's `write_record` packs it (this tree's code)."""
    import msgpack

    import services.worker_requests as wr

    class Ours(dict):  # the worker's table of running requests: all of them
        def __contains__(self, rid: object) -> bool:
            return True

    active = Ours()
    if hasattr(wr, "step_records"):
        def record(step: int, events: list) -> bytes:  # noqa: E306
            rows, plain, _ = wr.step_records(events, active)
            return msgpack.packb(["step", step, rows, plain])
    else:  # a tree from before plain rows: the worker's loop then
        def record(step: int, events: list) -> bytes:  # noqa: E306
            rows = [wr.row_record(e) for e in events if e.rid in active]
            return msgpack.packb(["step", step, rows])
    return record


def _inline_executor(scheduler: object) -> object:
    """The CUDA executor's host path on CPU: launches do their (null) device work at once, on
    the calling thread; `wait` has nothing left to wait for."""
    from engine.model_runner import GenerationBatchResult
    from engine.overlap.executor import Launch, OverlapExecutor

    class InlineExecutor(OverlapExecutor):
        def launch_forward(self, mwb, slots, info):  # noqa: ANN001, ANN202
            fb = self.runner.build_forward_batch(mwb)
            launch = Launch(mwb, slots, fb, logits=self.runner.forward(fb, self.future_map))
            if info is not None:
                self.launch_sample(launch, info)
            return launch

        def launch_sample(self, launch, info):  # noqa: ANN001, ANN202
            launch.info = info
            out = self._sample(launch)
            launch.result = GenerationBatchResult(out.next_token_ids, out.logprobs,
                                                  out.top_logprobs)

        def wait(self, launch):  # noqa: ANN001, ANN202
            return launch.result

        def close(self) -> None:
            pass

    return InlineExecutor(scheduler.model_runner, scheduler.future_map)  # type: ignore[attr-defined]


def measure(root: str, loop: str, bs: int, steps: int) -> float:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", root, loop, str(bs), str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=root)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base", default="HEAD", help="the baseline git revision")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--loops", nargs="+", default=["plain", "overlap", "inline"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--name", default="host_overhead",
                    help="results file benchmarks/results/NAME.json")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        root, loop, bs, steps = args.child
        print(child(root, loop, int(bs), int(steps)))
        return
    sys.path.insert(0, ROOT)
    from benchmarks.common import base_worktree, print_table, write_result

    rows = []
    with base_worktree(ROOT, args.base) as (base, revs):
        for loop in args.loops:
            for bs in args.batch_sizes:
                ours, theirs = [], []
                for _ in range(args.reps):  # alternated
                    ours.append(measure(ROOT, loop, bs, args.steps))
                    theirs.append(measure(base, loop, bs, args.steps))
                ratios = [a / b for a, b in zip(ours, theirs)]
                rows.append({"loop": loop, "batch": bs,
                             "step_us": 1e6 * statistics.median(ours),
                             "base_step_us": 1e6 * statistics.median(theirs),
                             "ratio": statistics.median(ratios),
                             "ratio_min": min(ratios), "ratio_max": max(ratios)})
                print_table(rows[-1:], list(rows[-1]))
    print_table(rows, list(rows[0]))
    summary = {f"{r['loop']}_bs{r['batch']}_vs_base": r["ratio"] for r in rows}
    results = {**revs, "steps": args.steps, "reps": args.reps, "cases": rows}
    print(write_result(args.name, results, summary, notes=__doc__.split("\n\n")[1]))


if __name__ == "__main__":
    main()
