"""What disaggregation costs, measured in one run (`bench_serving.py --measure-disaggregation`).

1. In-process: `engine.Engine` with the model and engine flags, driven closed-loop at
   `--max-concurrency` (a new request is admitted when one finishes); per-token times come
   from the scheduler's step events, so TTFT, ITL and throughput mean the same as over HTTP.
2. Services: `sluice serve` with the same model and flags, started here; the same requests
   (token ids, greedy, ignore_eos) sent over HTTP with the same concurrency.
   1 and 2 run as `--repeats` pairs on fresh prompts each, alternating which goes first.
   The summary compares each side's best run (a shared machine only ever slows a run
   down), and gives the median of the within-pair ratios beside it.
   Control: 1 again beside processes that burn as much CPU as the services other than the
   worker (and the client) burned during 2; with `--engine-cores`, 1 and 2 are pinned
   instead and the control is skipped (both in `benchmarks/disagg_cores.py`).
3. Detokenizers: throughput and scaling with N processes (`benchmarks/disagg_detok.py`).

Both sides trace their scheduler steps (`engine/scheduler/step_trace.py`; the worker's
`--step-trace`), which says where added time goes: the worker's full decode steps against
the in-process engine's, the loop's own time between steps, and how many prefill steps the
same requests took (requests that arrive staggered through router and tokenizer are
prefilled in more, smaller steps, each one a pause for every running request).

Writes `benchmarks/results/<--result-name>.json` (summary: `services_vs_inprocess` = output
throughput ratio, `added_itl_p50_ms`, `detok_tok_s_per_process`, the control's ratio, the
CPU each service used and the step-trace figures) and a PNG of the scaling.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil

from benchmarks.bench_serving import (
    Output,
    Request,
    load_tokenizer,
    make_requests,
    print_summary,
    run_requests,
    summarize,
)
from benchmarks.common import RESULTS_DIR, print_table, write_result
from benchmarks.disagg_cores import (
    Pinning,
    cpu_by_kind,
    cpu_neighbour,
    engine_cores,
    neighbour_cores,
    pin_services,
)
from benchmarks.disagg_detok import detok_scaling, detok_tok_s, plot_scaling
from engine.scheduler.step_trace import StepTrace, read_trace
from engine.scheduler.step_trace import summarize as summarize_steps
from shared.redis_server import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- 1. in-process ------------------------------------------------------------------------------
def make_engine(model: str, flags: list[str]) -> Any:
    from engine.engine import Engine
    from services.engine_args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    engine = Engine(
        **dataclasses.asdict(engine_args_from(parser.parse_args(["--model", model, *flags])))
    )
    engine.generate(input_ids=[[11, 12, 13, 14]], sampling_params={"max_new_tokens": 4})
    return engine


def run_inprocess(engine: Any, requests: list[Request], concurrency: int) -> dict:
    from engine.sampling.sampling_params import SamplingParams

    engine.flush_cache()
    trace = StepTrace()
    outputs, duration = _closed_loop(
        engine.scheduler, requests, concurrency, SamplingParams, trace
    )
    res = summarize(outputs, duration)
    res["steps"] = summarize_steps(trace.rows, concurrency)
    return res


def _closed_loop(
    sched: Any, requests: list[Request], concurrency: int, params_cls: Any, trace: StepTrace
) -> tuple[list[Output], float]:
    outputs = [Output(prompt_len=r.prompt_len) for r in requests]
    queue = deque(enumerate(requests))
    active: dict[str, tuple[int, float]] = {}
    last: dict[str, float] = {}

    def admit() -> None:
        while queue and len(active) < concurrency:
            i, req = queue.popleft()
            p = params_cls.from_dict(
                {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True}
            )
            p.verify()
            sched.add_request(f"b{i}", req.prompt_ids, p.normalize())
            active[f"b{i}"] = (i, time.perf_counter())

    start = time.perf_counter()
    admit()
    while active:
        step_start = time.perf_counter()
        events = sched.step()
        now = time.perf_counter()
        trace.add(step_start, now, sched.last_batch, len(events))
        for ev in events:
            i, t0 = active[ev.rid]
            out = outputs[i]
            if ev.new_token_ids:
                if out.ttft == 0.0:
                    out.ttft = now - t0
                else:
                    out.itl.append(now - last[ev.rid])
                last[ev.rid] = now
            if ev.finished_reason is not None:
                out.latency, out.output_len, out.success = now - t0, len(ev.req.output_ids), True
                del active[ev.rid]
        admit()
    return outputs, time.perf_counter() - start


# -- 2. services ----------------------------------------------------------------------------------
@contextlib.contextmanager
def serving(
    model: str, flags: list[str], args: argparse.Namespace
) -> Iterator[tuple[str, psutil.Process]]:
    """`sluice serve` with the same model and engine flags; yields its URL and process."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--tokenizers",
        str(args.tokenizers),
        "--detokenizers",
        str(args.detokenizers),
        *flags,
    ]
    env = dict(os.environ)
    env["SLUICE_WORKER_STEP_TRACE"] = args.step_trace_path
    if args.pinning is not None:  # one torch thread per engine core, as in-process
        env["OMP_NUM_THREADS"] = str(len(args.pinning.engine))
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, proc, timeout_s=600)
        yield base, psutil.Process(proc.pid)
    finally:
        _stop(proc)


def run_services(
    base: str, serve: psutil.Process, requests: list[Request], args: argparse.Namespace
) -> dict:
    """The workload over HTTP, on an empty prefix cache as in-process (`POST /flush_cache`);
    also the CPU (in cores) each kind of service used meanwhile."""
    flush = urllib.request.Request(base + "/flush_cache", method="POST")
    with urllib.request.urlopen(flush, timeout=30) as resp:  # idle here: a refusal raises
        resp.read()
    run_args = copy.copy(args)
    run_args.backend, run_args.tokenize_prompt, run_args.disable_stream = "sluice", True, False
    traced = _trace_lines(args.step_trace_path)
    before, start = cpu_by_kind(serve), time.perf_counter()
    outputs, duration = asyncio.run(run_requests(run_args, base, requests, "default"))
    after, wall = cpu_by_kind(serve), time.perf_counter() - start
    res = summarize(outputs, duration)
    res["cpu_cores"] = {k: (after[k] - before.get(k, 0.0)) / wall for k in after}
    _trace_lines(args.step_trace_path, settle_s=0.3)  # the worker writes it when idle
    rows = read_trace(args.step_trace_path, skip=traced)
    res["steps"] = summarize_steps(rows, args.max_concurrency)
    return res


def _trace_lines(path: str, settle_s: float = 0.0) -> int:
    """Lines in the worker's step trace; with `settle_s`, once it stopped growing."""
    def count() -> int:
        if not os.path.exists(path):
            return 0
        with open(path) as f:
            return sum(1 for _ in f)

    n = count()
    while settle_s:
        time.sleep(settle_s)
        n, last = count(), n
        if n == last:
            break
    return n


def _wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sluice serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("sluice serve did not become healthy")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- the run --------------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Paired runs after one unmeasured warm-up pair, alternating which side goes first, each
    pair on fresh prompts, each run on an empty prefix cache. Then the detokenizers."""
    from services.engine_args import ensure_model

    extra = {"loadavg_before": os.getloadavg()}  # the machine may be shared: say how busy
    model = ensure_model(args.model)
    flags = shlex.split(args.engine_flags)
    args.max_concurrency = args.max_concurrency or 64
    tokenizer = load_tokenizer(model)
    args.pinning = Pinning.parse(args.engine_cores)
    args.step_trace_path = os.path.join(tempfile.mkdtemp(prefix="sluice-steps-"), "worker.txt")
    with engine_cores(args.pinning):
        engine = make_engine(model, flags)  # its device process, if any, starts here
    pairs = []
    try:
        with serving(model, flags, args) as (base, serve):
            if args.pinning is not None:
                extra["pinned"] = pin_services(serve, args.pinning)
                print("pinned:", extra["pinned"])
            # One unmeasured pass on each side first (SGLang's bench_serving warms up too): the
            # services' first full batch otherwise pays for the router's, tokenizer's and
            # worker's first use of their paths, which the in-process engine has done already.
            warm = make_requests(args, tokenizer, seed=args.seed + 10_000)[: args.max_concurrency]
            _run_pair(0, engine, base, serve, warm, args)
            for k in range(args.repeats):
                requests = make_requests(args, tokenizer, seed=args.seed + k)
                pair = _run_pair(k, engine, base, serve, requests, args)
                for name, res in pair.items():
                    print_summary(f"{name} (pair {k})", res)
                pairs.append(pair)
    finally:
        engine.shutdown()
    counts = [int(n) for n in args.detok_scaling.split(",")]
    detok = detok_scaling(model, counts, args.detok_steps, args.detok_batch, args.seed)
    print_table(
        [{"detokenizers": n, **v} for n, v in detok.items()],
        ["detokenizers", "tok_s", "tok_per_cpu_s"],
    )
    summary = _summary(pairs, detok, args.max_concurrency)
    print({k: v for k, v in summary.items() if k != "detok_scaling"})
    keys = (
        "dataset_name",
        "num_prompts",
        "random_input_len",
        "random_output_len",
        "random_range_ratio",
        "seed",
        "repeats",
        "engine_flags",
        "tokenizers",
        "detokenizers",
        "detok_steps",
        "detok_batch",
        "engine_cores",
    )
    extra["loadavg_after"] = os.getloadavg()
    path = write_result(
        args.result_name,
        {"pairs": pairs, "detokenizers": {str(n): v for n, v in detok.items()}},
        summary,
        workload={k: getattr(args, k) for k in keys},
        model=model,
        **extra,
    )
    print("wrote", path)
    png = os.path.join(RESULTS_DIR, f"{args.result_name}_detok_scaling.png")
    plot_scaling(detok_tok_s(detok), png, extra["loadavg_after"][0])
    return summary


def _run_pair(
    k: int,
    engine: Any,
    base: str,
    serve: psutil.Process,
    requests: list[Request],
    args: argparse.Namespace,
) -> dict[str, dict]:
    """In-process, services, and in-process beside a CPU neighbour as big as the services
    were (that one after the services run it copies); who goes first alternates."""
    concurrency = args.max_concurrency
    pair: dict[str, dict] = {}
    def inprocess() -> dict:
        with engine_cores(args.pinning, engine):
            return run_inprocess(engine, requests, concurrency)

    if k % 2 == 0:
        pair["inprocess"] = inprocess()
    pair["services"] = run_services(base, serve, requests, args)
    if args.pinning is None:  # pinned, the services' CPU is not the worker's
        with cpu_neighbour(neighbour_cores(pair["services"])):
            pair["inprocess_beside_neighbour"] = inprocess()
    if k % 2 == 1:
        pair["inprocess"] = inprocess()
    return pair


def _summary(pairs: list[dict], detok: dict[int, dict], concurrency: int) -> dict[str, Any]:
    """Headline figures from each side's best run (the one least slowed by other work on a
    shared machine: its throughput and that run's ITL/TTFT), and the medians over pairs of
    within-pair ratios beside them."""
    best = {
        side: max((p[side] for p in pairs), key=lambda r: r["output_throughput"])
        for side in pairs[0]
    }

    def ratio(a: str, b: str) -> float | None:
        if a not in best or b not in best:  # no control run (pinned)
            return None
        return best[a]["output_throughput"] / best[b]["output_throughput"]

    def paired(a: str, b: str) -> float | None:
        if a not in best or b not in best:
            return None
        return float(
            np.median([p[a]["output_throughput"] / p[b]["output_throughput"] for p in pairs])
        )

    def added(key: str) -> float:
        return best["services"][key] - best["inprocess"][key]

    kinds = best["services"]["cpu_cores"]
    tok_s = detok_tok_s(detok)
    return {
        "services_vs_inprocess": ratio("services", "inprocess"),
        "added_itl_p50_ms": added("median_itl_ms"),
        "added_ttft_p50_ms": added("median_ttft_ms"),
        "paired_median_added_itl_p50_ms": float(
            np.median([p["services"]["median_itl_ms"] - p["inprocess"]["median_itl_ms"]
                       for p in pairs])
        ),
        "services_output_tok_s": best["services"]["output_throughput"],
        "inprocess_output_tok_s": best["inprocess"]["output_throughput"],
        "inprocess_beside_neighbour_vs_inprocess": ratio("inprocess_beside_neighbour", "inprocess"),
        "services_vs_inprocess_beside_neighbour": ratio("services", "inprocess_beside_neighbour"),
        "paired_median_services_vs_inprocess": paired("services", "inprocess"),
        "paired_median_services_vs_inprocess_beside_neighbour": paired(
            "services", "inprocess_beside_neighbour"
        ),
        "neighbour_cores": neighbour_cores(best["services"]),
        "services_cpu_cores": dict(kinds),
        "detok_tok_s_per_process": tok_s.get(1, next(iter(tok_s.values()))),
        "detok_tok_per_cpu_s": float(np.median([v["tok_per_cpu_s"] for v in detok.values()])),
        "detok_scaling": {str(n): v for n, v in tok_s.items()},
        "concurrency": concurrency,
        "num_pairs": len(pairs),
        **_step_summary(pairs),
    }


def _step_summary(pairs: list[dict]) -> dict[str, float | None]:
    """Where the added time goes, from the step traces (medians over pairs): the worker's
    full decode steps against the in-process engine's, the loop's own time between steps,
    and how many prefill steps the same requests took (staggered arrivals split them)."""

    def per_pair(side: str, key: str) -> list[float]:
        return [p[side]["steps"][key] for p in pairs if p[side]["steps"][key] is not None]

    def ratio(key: str) -> float | None:
        r = [
            p["services"]["steps"][key] / p["inprocess"]["steps"][key]
            for p in pairs
            if p["services"]["steps"][key] and p["inprocess"]["steps"][key]
        ]
        return float(np.median(r)) if r else None

    def median(side: str, key: str) -> float | None:
        v = per_pair(side, key)
        return float(np.median(v)) if v else None

    return {
        "worker_full_decode_step_vs_inprocess": ratio("full_decode_step_ms_p50"),
        "worker_step_gap_ms_p50": median("services", "gap_ms_p50"),
        "inprocess_step_gap_ms_p50": median("inprocess", "gap_ms_p50"),
        "prefill_steps_services_vs_inprocess": ratio("extend_steps"),  # mixed ones included
        "prefill_time_services_vs_inprocess": ratio("extend_time_s"),
    }
