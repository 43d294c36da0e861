"""Where the disaggregation benchmark's processes run, and how much CPU each kind used.

`--engine-cores 0` pins the in-process engine and the worker's scheduler thread to the given
cores (one torch thread each) and the client, every other service and the worker's Redis I/O
process to the remaining cores (`Pinning`, `engine_cores`, `pin_services`): the model's
compute then gets the same cores on both sides, as on a GPU host where it runs on the device
and the services have cores of their own; the CPU-neighbour control is skipped. Without
it all processes share all cores (on a small machine, what the services cost is then mostly
the CPU they take from the worker's matmuls).

The control without pinning: the in-process engine beside processes that burn as much CPU as
the services other than the worker (and the client) burned (`cpu_by_kind`, `neighbour_cores`,
`cpu_neighbour`). On a small machine, what disaggregation costs is mostly that CPU; the
control says how much of the gap it explains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psutil


# -- pinning (--engine-cores) --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Pinning:
    engine: set[int]  # the in-process engine, the worker
    rest: set[int]  # the client, the router, tokenizers, detokenizers, redis

    @classmethod
    def parse(cls, spec: str | None) -> Pinning | None:
        if not spec:
            return None
        engine = {int(c) for c in spec.split(",")}
        rest = set(os.sched_getaffinity(0)) - engine
        if not engine <= set(os.sched_getaffinity(0)) or not rest:
            raise SystemExit(f"--engine-cores {spec}: need a subset of the cores, leaving some")
        return cls(engine, rest)


def pin(pid: int, cores: set[int], others: set[int] | None = None) -> None:
    """Every thread of `pid` (threads created later inherit their creator's affinity); with
    `others`, only the main thread on `cores` and the other threads on `others`."""
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cores if others is None or tid == pid else others)


@contextlib.contextmanager
def engine_cores(pinning: Pinning | None, engine: Any = None) -> Iterator[None]:
    """This process on the engine's cores, with one torch thread per core, then back. The
    engine's device process (CPU overlap loop), if any, stays there. (Not every child of
    this process: `sluice serve` is one too.)"""
    if pinning is None:
        yield
        return
    import torch

    threads = torch.get_num_threads()
    pin(os.getpid(), pinning.engine)
    device = getattr(getattr(engine, "scheduler", None), "executor", None)
    if getattr(device, "_proc", None) is not None:
        pin(device._proc.pid, pinning.engine)
    torch.set_num_threads(len(pinning.engine))
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        pin(os.getpid(), pinning.rest)


def pin_services(serve: psutil.Process, pinning: Pinning) -> dict[str, list[int]]:
    """The worker's scheduler thread (and its device process, if any) on the engine's cores,
    as the engine runs in-process; everything else on the rest: the other services, this
    client, the worker's I/O process and any other thread of the worker (on a GPU host they
    run on other cores than the thread that drives the GPU)."""
    placed: dict[str, list[int]] = {}
    for p, kind in service_kinds(serve, "serve").items():
        args = " ".join(p.cmdline()).split()
        if kind != "worker" or "services.worker_io" in args:  # the worker's I/O process too
            pin(p.pid, pinning.rest)
            cores = pinning.rest
        elif "worker" in args:  # the worker itself
            pin(p.pid, pinning.engine, others=pinning.rest)
            cores = pinning.engine
        else:  # its forkserver and device process
            pin(p.pid, pinning.engine)
            cores = pinning.engine
        placed[f"{kind}:{p.pid}"] = sorted(cores)
    pin(os.getpid(), pinning.rest)
    return placed


# -- CPU by service kind, and the CPU-neighbour control ------------------------------------------
def cpu_by_kind(serve: psutil.Process) -> dict[str, float]:
    """CPU seconds by service kind (the benchmark client is this process)."""
    out = {"client": sum(psutil.Process().cpu_times()[:2])}
    for p, kind in service_kinds(serve, "other", include_serve=False).items():
        try:
            cpu = sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:
            continue
        out[kind] = out.get(kind, 0.0) + cpu
    return out


_KINDS = ("router", "worker", "detokenizer", "tokenizer", "redis-server")


def service_kinds(
    serve: psutil.Process, default: str, include_serve: bool = True
) -> dict[psutil.Process, str]:
    """Each process of `sluice serve` by kind (from its command line); a worker's children
    (the forkserver and device process of the CPU overlap loop) count as the worker."""
    procs = [serve, *serve.children(recursive=True)] if include_serve else serve.children(True)
    kinds = {}
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            args = " ".join(p.cmdline()).split()  # `services.cli worker`, `/x/redis-server`
            kinds[p] = next(
                (k for k in _KINDS if any(a == k or a.endswith("/" + k) for a in args)), default
            )
    by_pid = {p.pid: k for p, k in kinds.items()}
    for p in kinds:
        with contextlib.suppress(psutil.NoSuchProcess):
            if any(by_pid.get(a.pid) == "worker" for a in p.parents()):
                kinds[p] = "worker"
    return kinds


def neighbour_cores(services: dict) -> float:
    """CPU the services used beside the worker (the client included: it shares the box)."""
    return sum(v for k, v in services["cpu_cores"].items() if k != "worker")


@contextlib.contextmanager
def cpu_neighbour(cores: float) -> Iterator[None]:
    """Processes keeping `cores` CPUs busy in 10 ms slices: the control for `services`, the
    in-process engine with as much CPU taken beside it as the other services took."""
    procs, left = [], cores
    while left > 0.01:
        duty = min(1.0, left)
        left -= duty
        procs.append(subprocess.Popen([sys.executable, "-c", _BURN, str(duty)]))
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


_BURN = """import sys, time
duty = float(sys.argv[1])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.01 * duty:
        pass
    time.sleep(0.01 * (1 - duty))
"""

