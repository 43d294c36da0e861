"""Host time of a CUDA graph launch while the same graph still runs (the overlap loop's case).

    python benchmarks/gpu_graph_launch.py [--kernels 150] [--gpu-ms 1.0] [--launches 200]

With the overlap scheduler a decode step launches its graph while the previous step's, of the
same batch size and so the same graph, still runs on the GPU; cuGraphLaunch orders a launch
behind any previous launch of the same executable graph. If the driver blocks the host for
that, the host's step is tied to the GPU's and what the host does after the launch shows as
idle GPU time. (The third GPU session's overlap run at batch 256 had about one bubble a
step, 0.38 ms of idle GPU a step, with a scheduler whose own host work measures far less
than the GPU's step; a cProfile of an earlier run had 0.62 ms a step under
`CUDAGraph.replay`, though its cumulative times were not consistent.)

A graph of `--kernels` small kernels plus one matmul sized so that a replay takes about
`--gpu-ms` on the GPU; host time of `replay()` (median over `--launches`) when:

* `idle`: the GPU has finished everything before each launch;
* `same`: one replay of the same graph in flight (the overlap loop: launch, then wait for the
  previous replay's event);
* `alternate`: one in flight, alternating two captures of the same work (what a second graph
  per batch size would do, if `same` blocks);
* `same_queued`: launches back to back, nothing waited for (how deep the queue may grow).

Writes benchmarks/results/gpu_graph_launch.json (CUDA only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.common import print_table, write_result  # noqa: E402


def _capture(step: Callable[[], None], stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph


def _work(kernels: int, size: int) -> Callable[[], None]:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(size, size, device="cuda", dtype=torch.bfloat16)
    small = torch.zeros(4096, device="cuda")

    def step() -> None:
        torch.mm(a, b, out=c)
        for _ in range(kernels):
            small.add_(1.0)

    return step


def _gpu_ms(graph: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _launches(graphs: list[torch.cuda.CUDAGraph], n: int, mode: str) -> list[float]:
    """Host seconds of each `replay()` call."""
    host: list[float] = []
    previous: torch.cuda.Event | None = None
    torch.cuda.synchronize()
    for i in range(n):
        graph = graphs[i % len(graphs)]
        if mode == "idle":
            torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        host.append(time.perf_counter() - t)
        if mode in ("same", "alternate"):
            done = torch.cuda.Event()
            done.record()
            if previous is not None:
                previous.synchronize()  # one replay left in flight, as in the overlap loop
            previous = done
    torch.cuda.synchronize()
    return host


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=150)
    ap.add_argument("--gpu-ms", type=float, default=1.0)
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--name", default="gpu_graph_launch")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_graph_launch: needs CUDA")
        return 2
    stream = torch.cuda.Stream()
    size = 1024
    while True:  # a matmul that brings a replay to about --gpu-ms
        step = _work(args.kernels, size)
        graph = _capture(step, stream)
        ms = _gpu_ms(graph)
        if ms >= args.gpu_ms or size >= 16384:
            break
        size *= 2
    twin = _capture(step, stream)
    rows: list[dict[str, Any]] = []
    for mode in ("idle", "same", "alternate", "same_queued"):
        graphs = [graph, twin] if mode == "alternate" else [graph]
        host = _launches(graphs, args.launches, mode)
        rows.append({"mode": mode, "host_us_median": 1e6 * statistics.median(host),
                     "host_us_p90": 1e6 * sorted(host)[int(0.9 * len(host))],
                     "gpu_ms_per_replay": ms, "kernels": args.kernels + 1, "matmul": size})
    print_table(rows, list(rows[0]))
    by = {r["mode"]: r["host_us_median"] for r in rows}
    summary = {"graph_launch_host_us_idle": by["idle"], "graph_launch_host_us_same": by["same"],
               "graph_launch_host_us_alternate": by["alternate"],
               "same_graph_launch_blocks": by["same"] > 0.5 * 1e3 * ms}
    write_result(args.name, rows, summary, device=torch.cuda.get_device_name(), args=vars(args))
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
