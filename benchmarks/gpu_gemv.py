"""The Triton GEMV (kernels/gemv.py) against torch's matmul (cuBLAS) at decode's small batches,
on Llama 3.2 1B's projections and lm_head: microseconds per call and the HBM bandwidth that is.

Per shape (qkv 3072 x 2048, o 2048 x 2048, gate_up 16384 x 2048, down 2048 x 8192, lm_head
128256 x 2048; bf16) and rows M (1, 2, 4, 8, 16): `F.linear`, `gemv` with `gemv_config`'s tile,
and the fastest tile of a sweep (every tile checked against `F.linear` first). Each timing
replays a CUDA graph of REPS calls cycling over enough copies of the weight to exceed 256 MB,
so every call reads its weight from HBM as a decode step does (one weight of 8 MB would
otherwise stay in the 50 MB L2). Bandwidth counts the weight, x and the output once.

The summary estimates a Llama 3.2 1B decode step's GEMM time at M = 1 (16 layers of qkv, o,
gate_up and down, and the lm_head) each way: what --gemv-backend triton could save of the
1.36 ms step, whose roofline is 0.74 ms.

Rows `down+silu`, `qkv+norm`, `gate_up+norm`: a projection with the kernel before it (the
MLP's SiLU-and-mul of the gate_up output [M, 16384]; the residual add and RMSNorm) three ways:
that kernel then `F.linear` (what `--gemv-backend torch` runs), that kernel then `gemv`, and
`gemv` with it in its prologue (one kernel; what `--gemv-backend triton` runs).

    python benchmarks/gpu_gemv.py [--rows 1 2 4 8 16] [--no-sweep]
    python benchmarks/gpu_gemv.py --quick --device cpu     # the interpreter: the code path only

Results: results/gpu_gemv.json (`_quick` in quick mode).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

if "--quick" in sys.argv and "cuda" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192), "lm_head": (128256, 2048)}  # fmt: skip
QUICK_SHAPES = {"qkv": (48, 256), "down": (32, 512)}
LAYERS = 16  # Llama 3.2 1B
PEAK_BW = 3.35e12  # H100 SXM5 HBM3, datasheet
COPY_BYTES = 256 << 20
REPS = 64


def sweep_configs(rows: int) -> list[dict[str, int]]:
    """Tiles for the one-row reduction (BLOCK_N x BLOCK_K <= 16384) or the dot."""
    if rows == 1:
        pairs = [(n, k) for n in (2, 4, 8, 16, 32) for k in (256, 512, 1024, 2048)
                 if n * k <= 16384]  # fmt: skip
        launch = itertools.product((2, 4, 8), (1, 2, 3))
    else:
        pairs = [(n, k) for n in (16, 32, 64) for k in (64, 128, 256)]
        launch = itertools.product((4, 8), (2, 3, 4))
    return [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s}
            for (n, k), (w, s) in itertools.product(pairs, list(launch))]  # fmt: skip


def time_us(fn: Callable[[int], Any], copies: int, cuda: bool, reps: int = REPS) -> float:
    """Microseconds per call of fn(i) (i: which weight copy, in turn), reps calls per CUDA
    graph replay, median of 5 replays; on CPU wall time of a few calls."""
    turn = itertools.cycle(range(copies))
    if not cuda:
        t = time.perf_counter()
        for _ in range(2):
            fn(next(turn))
        return 1e6 * (time.perf_counter() - t) / 2
    from benchmarks.gpu_fused_kernels import graph_us

    return graph_us(lambda: fn(next(turn)), reps)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = want.float().abs().max().clamp(min=1.0)
    return bool(((got.float() - want.float()).abs().max() / scale) < 2e-2)


Weights = tuple[torch.dtype, torch.Generator, list[torch.Tensor]]


def _weight_copies(n: int, k: int, device: str, cuda: bool, seed: int) -> Weights:
    """The dtype, a generator, and enough copies of a random [n, k] weight to exceed
    COPY_BYTES on a GPU (one on CPU)."""
    dt = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)
    copies = max(1, -(-COPY_BYTES // (n * k * dt.itemsize))) if cuda else 1
    weights = [torch.randn(n, k, dtype=dt, device=device, generator=gen) * 0.02
               for _ in range(copies)]  # fmt: skip
    return dt, gen, weights


def _print_row(row: dict[str, Any]) -> None:
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


def _release(weights: list[torch.Tensor], cuda: bool) -> None:
    weights.clear()
    if cuda:
        torch.cuda.empty_cache()


def run_shape(name: str, n: int, k: int, rows: list[int], args: argparse.Namespace,
              cuda: bool) -> list[dict[str, Any]]:  # fmt: skip
    from kernels.gemv import gemv, gemv_config
    from kernels.jit import next_pow2

    dt, gen, weights = _weight_copies(n, k, args.device, cuda, seed=0)
    nbytes, copies = n * k * dt.itemsize, len(weights)
    out = []
    for m in rows:
        x = torch.randn(m, k, dtype=dt, device=args.device, generator=gen)
        moved = nbytes + (m * k + m * n) * dt.itemsize

        def on_gemv(cfg: dict[str, int], reps: int = REPS, x: torch.Tensor = x) -> float:
            return time_us(lambda i: gemv(x, weights[i], config=cfg), copies, cuda, reps)

        t_torch = time_us(lambda i, x=x: F.linear(x, weights[i]), copies, cuda)
        config = gemv_config(m, n, k)
        t_gemv = on_gemv(config)
        row = {"shape": name, "n": n, "k": k, "rows": m, "torch_us": t_torch, "gemv_us": t_gemv,
               "gemv_config": config, "speedup": t_torch / t_gemv,
               "torch_TBps": moved / t_torch / 1e6, "gemv_TBps": moved / t_gemv / 1e6}
        if not args.no_sweep:
            want = F.linear(x, weights[0])
            timed = []
            configs = [c for c in sweep_configs(m) if c["BLOCK_K"] <= next_pow2(k)]
            for cfg in configs if cuda else configs[:2]:  # (the interpreter: the path only)
                if not _close(gemv(x, weights[0], config=cfg), want):
                    continue  # (none should be: kept out of the timings, and counted)
                timed.append((on_gemv(cfg, reps=max(copies, 16)), cfg))
            best_us, best = min(timed, key=lambda t: t[0])
            best_us = on_gemv(best)  # again, with as many calls as the others
            row.update({"best_us": best_us, "best_config": best, "best_speedup": t_torch / best_us,
                        "best_TBps": moved / best_us / 1e6, "swept": len(timed),
                        "wrong": len(configs if cuda else configs[:2]) - len(timed)})  # fmt: skip
        _print_row(row)
        out.append(row)
    _release(weights, cuda)
    return out


FUSED = {"down+silu": "down", "qkv+norm": "qkv", "gate_up+norm": "gate_up"}  # kind: shape


def run_fused(kind: str, n: int, k: int, rows: list[int], args: argparse.Namespace,
              cuda: bool) -> list[dict[str, Any]]:  # fmt: skip
    """A projection with what comes before it, three ways: the separate kernel then
    `F.linear` (--gemv-backend torch), the separate kernel then `gemv`, and `gemv` with it in
    the prologue (--gemv-backend triton). `down+silu`: SiLU-and-mul of gate_up's output, then
    down; `qkv+norm` / `gate_up+norm`: the residual add and RMSNorm, then the projection."""
    from kernels.activation import silu_and_mul
    from kernels.fused_norm import fused_add_rms_norm
    from kernels.gemv import RMSNormInput, gemv, gemv_config

    dt, gen, weights = _weight_copies(n, k, args.device, cuda, seed=1)
    copies = len(weights)
    out = []
    for m in rows:
        if kind == "down+silu":
            x = torch.randn(m, 2 * k, dtype=dt, device=args.device, generator=gen)

            def before(x: torch.Tensor) -> torch.Tensor:
                return silu_and_mul(x)

            prologue: dict[str, Any] = {"act": "silu_mul"}
        else:
            x = torch.randn(m, k, dtype=dt, device=args.device, generator=gen)
            res = torch.randn(m, k, dtype=dt, device=args.device, generator=gen)
            nw = torch.randn(k, dtype=dt, device=args.device, generator=gen)

            def before(x: torch.Tensor, res: torch.Tensor = res,
                       nw: torch.Tensor = nw) -> torch.Tensor:  # fmt: skip
                return fused_add_rms_norm(x, res, nw, 1e-5)[0]

            prologue = {"norm": RMSNormInput(nw, 1e-5, res, torch.empty_like(x))}
        tile = gemv_config(m, n, k, dt.itemsize, True)
        fused = gemv(x, weights[0], config=tile, **prologue)
        unfused = gemv(before(x), weights[0], config=tile)
        if kind == "down+silu":  # the same roundings (the norm's sum of squares may differ)
            assert torch.equal(fused, unfused), f"{kind}: fused != the two kernels"
        assert _close(fused, unfused), f"{kind}: fused != the two kernels"
        times = {
            "torch_us": lambda i, x=x, before=before: F.linear(before(x), weights[i]),
            "gemv_us": lambda i, x=x, before=before: gemv(before(x), weights[i]),
            "fused_us": lambda i, x=x, p=prologue: gemv(x, weights[i], **p),
        }
        row: dict[str, Any] = {"shape": kind, "n": n, "k": k, "rows": m}
        row.update({key: time_us(fn, copies, cuda) for key, fn in times.items()})
        row["fused_vs_torch"] = row["torch_us"] / row["fused_us"]
        row["fused_vs_gemv"] = row["gemv_us"] / row["fused_us"]
        _print_row(row)
        out.append(row)
    _release(weights, cuda)
    return out


def step_estimate(rows: list[dict[str, Any]], key: str) -> float:
    """A Llama 3.2 1B decode step's GEMM microseconds at M = 1 from the rows' `key` times."""
    at1 = {r["shape"]: r[key] for r in rows if r["rows"] == 1}
    layer = sum(at1.get(s, 0.0) for s in ("qkv", "o", "gate_up", "down"))
    return LAYERS * layer + at1.get("lm_head", 0.0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small shapes (the interpreter on CPU)")
    ap.add_argument("--rows", type=int, nargs="+", default=None)
    ap.add_argument("--no-sweep", action="store_true", help="gemv_config's tiles only")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rows_list = args.rows or ([1, 4] if args.quick else [1, 2, 4, 8, 16])
    rows: list[dict[str, Any]] = []
    for name, (n, k) in shapes.items():
        rows += run_shape(name, n, k, rows_list, args, cuda)
    fused: list[dict[str, Any]] = []
    for kind, shape in FUSED.items():
        if shape in shapes:
            fused += run_fused(kind, *shapes[shape], rows_list, args, cuda)
    common.print_table(rows, ["shape", "rows", "torch_us", "gemv_us", "speedup", "torch_TBps",
                              "gemv_TBps", *(() if args.no_sweep else ("best_us", "best_TBps"))])
    common.print_table(fused, ["shape", "rows", "torch_us", "gemv_us", "fused_us",
                               "fused_vs_torch", "fused_vs_gemv"])  # fmt: skip
    summary: dict[str, Any] = {}
    if not args.quick:
        summary["gemv_llama1b_step_gemm_us_torch"] = step_estimate(rows, "torch_us")
        summary["gemv_llama1b_step_gemm_us_triton"] = step_estimate(rows, "gemv_us")
        if not args.no_sweep:
            summary["gemv_llama1b_step_gemm_us_triton_best"] = step_estimate(rows, "best_us")
    for r in rows:
        summary[f"gemv_{r['shape']}_m{r['rows']}_speedup"] = r["speedup"]
    for r in fused:
        key = f"gemv_{r['shape'].replace('+', '_')}_m{r['rows']}_fused_vs"
        summary[f"{key}_torch"], summary[f"{key}_gemv"] = r["fused_vs_torch"], r["fused_vs_gemv"]
    name = "gpu_gemv" + ("_quick" if args.quick else "")
    device = {"name": torch.cuda.get_device_name(0) if cuda else "cpu (interpreter)"}
    path = common.write_result(name, {"rows": rows, "fused": fused,
                                      "copy_bytes": COPY_BYTES, "reps": REPS},
                               summary, device=device,
                               versions_extra=common.versions("triton"))  # fmt: skip
    print("wrote", path)
    for key, value in summary.items():
        print(f"{key}: {value}")
    return summary


if __name__ == "__main__":
    main()
