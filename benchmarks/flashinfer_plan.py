"""Host time of planning a batch with flashinfer: the backend's fast re-plans of decode and
paged prefill wrappers (engine/attention/flashinfer_plan.py) against flashinfer's own `plan`,
side by side in one run.

    python benchmarks/flashinfer_plan.py [--batch-sizes 1 64 256] [--reps 200]
        [--device cpu|cuda] [--name flashinfer_plan]

On a CPU machine (the default): flashinfer's own Python (the installed package, as CI installs
it) with its C++ planners replaced by ones that do nothing, so what is timed is the Python both
paths run on the host before every decode forward, not the planner's scheduling arithmetic in
C++, which both paths call once with the same arguments (tests/unit/test_flashinfer_plan.py).
With `--device cuda` (`gpu_session.sh flashinfer-plan`): the real planners and host-to-device
copies, host time still (each call timed without waiting for the device).
Per case, the median over `--reps` alternating calls of each path:

* `plan_us`: planning one decode wrapper over a ready page table (`DecodePlanner.plan`, fast,
  against flashinfer's `plan`);
* `batch_us`: the backend's whole decode planning of a batch, as before every graph replay
  (`init_forward_metadata_replay_cuda_graph`: host tables and plan; the graph writes the page
  ids itself, `cuda_graph_prologue`, as on a GPU) or every eager decode
  (`init_forward_metadata`: host tables, page ids, plan). On CPU the page ids are gathered
  with torch ops, where a GPU runs one Triton launch (engine/attention/page_table.py), so
  the eager rows hold more host time than the GPU's would. Graph rows also give
  `batch_us_ids_at_replay`: the replay writing the page ids itself, as it did before the
  graphs wrote them (fast re-plans on in both).

Extend batches plan flashinfer's paged prefill wrapper over the cached prefixes (every batch
with a prefix-cache hit, a later prefill chunk, or decode rows mixed in). Its `plan` makes the
same Python `max` twice, over the query and the context lengths; the public
`max_token_per_sequence` spares the first, no public argument the second, and the backend
re-plans the wrapper itself (`PrefillPlanner`). `extend` rows, for batches of one prompt chunk
and bs - 1 decode rows: the backend's plan (`extend_us`), flashinfer's with the argument (how
the backend planned before; `extend_saved_us` is the difference) and without it.

Cases: GQA group 4 (32 query heads, 8 KV heads: Llama-3.2-1B; flashinfer's tensor-core decode
kernel, which the backend picks from group 4) and MHA (12 and 12: GPT-2; the CUDA-core kernel),
head_dim 64, page size 16, contexts of 128 to 1024 tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE_SIZE = 16
HEAD_DIM = 64
HEADS = {"gqa4": (32, 8), "mha": (12, 12)}


def _setup(fi: Any, heads: tuple[int, int], bs: int, graph: bool, seed: int,
           device: str) -> dict[str, Any]:  # fmt: skip
    """A flashinfer backend over a one-layer pool, and a decode batch of `bs` requests."""
    from engine.attention import flashinfer_backend as fib
    from engine.attention.base import create_attention_backend
    from engine.forward_batch import ForwardBatch, ForwardMode
    from engine.mem_cache.kv_pool import KVPool

    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(128, 1025, (bs,), generator=gen)
    width = 1024
    pages = torch.randperm(bs * width // PAGE_SIZE + 1, generator=gen)[: bs * width // PAGE_SIZE]
    req_to_token = (pages.view(bs, -1).repeat_interleave(PAGE_SIZE, 1) * PAGE_SIZE
                    + torch.arange(PAGE_SIZE).repeat(width // PAGE_SIZE)).to(device, torch.int32)
    pool = KVPool(bs * width + PAGE_SIZE, 1, heads[1], HEAD_DIM, torch.bfloat16, device=device,
                  page_size=PAGE_SIZE)  # fmt: skip
    config = argparse.Namespace(num_heads=heads[0], num_kv_heads=heads[1], head_dim=HEAD_DIM,
                                sliding_windows=(None,), attn_logit_cap=None)  # fmt: skip
    fib.load_flashinfer = lambda device: fi
    with _host_memory(device):
        backend = create_attention_backend("flashinfer", device=device, model_config=config,
                                           kv_pool=pool, page_size=PAGE_SIZE,
                                           workspace_bytes=128 << 20)  # fmt: skip
        seq_lens_cpu = lens.tolist()
        lens = lens.to(device)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs,
            input_ids=torch.zeros(bs, dtype=torch.int64, device=device),
            positions=lens - 1, out_cache_loc=torch.zeros(bs, dtype=torch.int64, device=device),
            req_pool_indices=torch.arange(bs, device=device), seq_lens=lens,
            seq_lens_cpu=seq_lens_cpu, req_to_token=req_to_token, kv_pool=pool,
            attn_backend=backend,
        )  # fmt: skip
        if graph:
            backend.init_cuda_graph_state(max_bs=bs, max_context_len=width)
            backend.graph_page_ids = True  # (a GPU's default; the CPU's torch gather is not)
            backend.init_forward_metadata_capture_cuda_graph(fb)
    plan_batch = (backend.init_forward_metadata_replay_cuda_graph if graph
                  else backend.init_forward_metadata)  # fmt: skip
    plan_batch(fb)  # the first full plan of the eager wrapper
    wrapper = backend.metadata.wrapper
    table = backend._context_table(fb, None, wrapper._paged_kv_indices_buf if graph else None)
    scalars = backend._plan_scalars()

    def plan_one() -> None:
        backend.decode_planner.plan(wrapper, table, fb.seq_lens_cpu, heads[0], heads[1],
                                    HEAD_DIM, PAGE_SIZE, **scalars)  # fmt: skip

    return {"backend": backend, "plan_one": plan_one, "plan_batch": lambda: plan_batch(fb)}


def _host_memory(device: str) -> Any:
    """On CPU, wrappers are made with plain memory for pinned (tests/flashinfer_cpu.py)."""
    from tests.flashinfer_cpu import unpinned

    return unpinned() if device == "cpu" else contextlib.nullcontext()


def _extend_case(fi: Any, bs: int, reps: int, device: str) -> dict[str, Any]:
    """The paged prefill plan of a batch of one 100-token chunk and bs - 1 decode rows over
    20-page contexts, alternating three ways: the backend's (`PrefillPlanner`: fast re-plans
    after the first), flashinfer's `plan` with `max_token_per_sequence` (how the backend
    planned before), and without it."""
    from engine.attention.flashinfer_plan import PrefillPlanner
    from engine.attention.page_table import PageTable

    with _host_memory(device):
        wrappers = [fi.BatchPrefillWithPagedKVCacheWrapper(
            torch.zeros(128 << 20, dtype=torch.uint8, device=device), "NHD", backend="fa2"
        ) for _ in range(3)]  # fmt: skip
    qo_lens = [1] * (bs - 1) + [100]
    qo_indptr = torch.tensor([0, *itertools.accumulate(qo_lens)], dtype=torch.int32)
    table = PageTable(torch.arange(bs + 1, dtype=torch.int32) * 20,
                      torch.arange(20 * bs, dtype=torch.int32, device=device),
                      torch.full((bs,), 7, dtype=torch.int32))  # fmt: skip
    heads = (*HEADS["gqa4"], HEAD_DIM, PAGE_SIZE)
    scalars = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    planner = PrefillPlanner(fi)

    def flashinfers(wrapper: Any, **extra: Any) -> None:
        wrapper.plan(qo_indptr, table.indptr, table.indices, table.last_page_len, *heads,
                     causal=False, **scalars, **extra)  # fmt: skip

    ways = [lambda: planner.plan(wrappers[0], qo_indptr, table, qo_lens, *heads, causal=False,
                                 **scalars),
            lambda: flashinfers(wrappers[1], max_token_per_sequence=max(qo_lens)),
            lambda: flashinfers(wrappers[2])]  # fmt: skip
    times: list[list[float]] = [[], [], []]
    for i in range(3 * reps + 15):
        _settle(device, i)
        t = time.perf_counter()
        ways[i % 3]()
        if i >= 15:
            times[i % 3].append(time.perf_counter() - t)
    fast, given, plain = (1e6 * statistics.median(t) for t in times)
    return {"batch": bs, "extend_us": fast, "extend_us_flashinfer_given_max_q": given,
            "extend_us_flashinfer": plain, "extend_saved_us": given - fast,
            "extend_fast_plans": planner.fast_plans}


def _settle(device: str, i: int) -> None:
    """Every 16 calls on a GPU, wait for the copies the plans queued (outside the timing)."""
    if device != "cpu" and i % 16 == 0:
        torch.cuda.synchronize()


def _median_us(setup: dict[str, Any], what: str, reps: int, device: str
               ) -> tuple[float, float, int]:  # fmt: skip
    """Median microseconds of `what` with the fast re-plan on and off (alternating calls), and
    the fast plans made while on."""
    planner = setup["backend"].decode_planner
    fn = setup[what]
    times: dict[bool, list[float]] = {True: [], False: []}
    fast_before = planner.fast_plans
    for i in range(2 * reps + 10):
        on = i % 2 == 0
        planner.enabled = on
        _settle(device, i)
        t = time.perf_counter()
        fn()
        if i >= 10:
            times[on].append(time.perf_counter() - t)
    planner.enabled = True
    return (1e6 * statistics.median(times[True]), 1e6 * statistics.median(times[False]),
            planner.fast_plans - fast_before)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--device", default="cpu",
                    help="cpu (flashinfer's C++ planners stubbed out) or cuda (the real ones)")
    ap.add_argument("--name", default=None,
                    help="results file benchmarks/results/NAME.json (default flashinfer_plan, "
                         "gpu_flashinfer_plan on a GPU)")
    args = ap.parse_args()
    device = args.device
    name = args.name or ("flashinfer_plan" if device == "cpu" else "gpu_flashinfer_plan")
    sys.path.insert(0, ROOT)
    torch.set_num_threads(1)
    import flashinfer

    from benchmarks.common import print_table, versions, write_result
    from engine.attention.flashinfer_plan import fast_replan_supported
    from tests.flashinfer_cpu import NullPlanner, stubbed_planners

    if not fast_replan_supported(flashinfer):
        sys.exit(f"flashinfer {flashinfer.__version__}: the fast re-plan does not run on it")
    rows = []
    stub = stubbed_planners(flashinfer, NullPlanner()) if device == "cpu" else (
        contextlib.nullcontext())  # fmt: skip
    with stub:
        for heads_name, heads in HEADS.items():
            for graph in (True, False):
                for bs in args.batch_sizes:
                    setup = _setup(flashinfer, heads, bs, graph, bs, device)
                    row: dict[str, Any] = {"heads": heads_name, "graph": graph, "batch": bs}
                    for what, key in (("plan_one", "plan"), ("plan_batch", "batch")):
                        fast, slow, n_fast = _median_us(setup, what, args.reps, device)
                        row.update({f"{key}_us": fast, f"{key}_us_flashinfer": slow,
                                    f"{key}_saved_us": slow - fast,
                                    f"{key}_fast_plans": n_fast})  # fmt: skip
                    if graph:
                        setup["backend"].graph_page_ids = False
                        row["batch_us_ids_at_replay"] = _median_us(
                            setup, "plan_batch", args.reps, device)[0]  # fmt: skip
                    rows.append(row)
                    print_table(rows[-1:], list(row))
        extend_rows = [_extend_case(flashinfer, bs, args.reps, device)
                       for bs in args.batch_sizes]  # fmt: skip
    print_table(rows, ["heads", "graph", "batch", "plan_us", "plan_us_flashinfer",
                       "batch_us", "batch_us_flashinfer", "batch_saved_us",
                       "batch_us_ids_at_replay"])
    print_table(extend_rows, list(extend_rows[0]))
    summary = {}
    for r in rows:
        tag = f"{r['heads']}_{'graph' if r['graph'] else 'eager'}_bs{r['batch']}"
        summary[f"{tag}_plan_flashinfer_vs_fast"] = r["plan_us_flashinfer"] / r["plan_us"]
        summary[f"{tag}_batch_saved_us"] = r["batch_saved_us"]
        if r["graph"]:
            summary[f"{tag}_ids_in_graph_saved_us"] = r["batch_us_ids_at_replay"] - r["batch_us"]
    for r in extend_rows:
        summary[f"extend_bs{r['batch']}_plan_saved_us"] = r["extend_saved_us"]
    results = {"device": device, "planners": "stubbed" if device == "cpu" else "flashinfer's",
               "page_size": PAGE_SIZE, "head_dim": HEAD_DIM, "reps": args.reps,
               "flashinfer": versions("flashinfer-python"), "cases": rows,
               "extend": extend_rows}  # fmt: skip
    print(write_result(name, results, summary, notes=__doc__.split("\n\n")[2]))


if __name__ == "__main__":
    main()
