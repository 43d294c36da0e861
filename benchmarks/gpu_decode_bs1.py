"""decode-bs1: ms per output token of one request on a Llama-3.2-1B shaped random model, CUDA
graphs on and off (and on with flashinfer's decode kernels in place of Triton's, with the
linear layers on cuBLAS, `gemv_backend="torch"`, with and without programmatic dependent
launches, on the Triton GEMV without them, and with the layers' fused kernels off,
`disable_layer_kernels`), against bytes per token / HBM bandwidth (datasheet and measured
copy bandwidth; see gpu_bench.py). The default on CUDA: the Triton GEMV at one row, with
PDL on Hopper."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any

import torch

from benchmarks.common import print_table
from benchmarks.gpu_common import (
    Ctx,
    build_model,
    finish,
    make_engine,
    random_prompts,
    release,
    sync,
    vocab_size,
)
from benchmarks.gpu_timeline import Profiled, drive, timeline

# Datasheet HBM bandwidth, first match on the device name (bytes/s).
DATASHEET_BW = [("H200", 4.8e12, "H200 SXM datasheet 4.8 TB/s"),
                ("H100 NVL", 3.9e12, "H100 NVL datasheet 3.9 TB/s"),
                ("H100 PCIe", 2.0e12, "H100 PCIe datasheet 2.0 TB/s"),
                ("H100", 3.35e12, "H100 SXM5 80GB HBM3 datasheet 3.35 TB/s")]


def decode_bs1(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    path = build_model(ctx, "llama-3.2-1b")
    prompt_len, new = (16, 24) if ctx.quick else (128, args.decode_tokens)
    vocab = vocab_size(path)
    bw_measured = measure_copy_bandwidth(ctx)
    bw_sheet, bw_name = _datasheet_bw(ctx)
    rows, results = [], {"model": "llama-3.2-1b shape", "dtype": ctx.dtype,
                         "prompt_len": prompt_len, "new_tokens": new,
                         "copy_bandwidth_measured_Bps": bw_measured,
                         "datasheet_bandwidth_Bps": bw_sheet, "datasheet_bandwidth": bw_name}
    # (label, CUDA graphs, engine overrides): the default (flashinfer prefill, Triton decode
    # where Triton compiles; the Triton GEMV with PDL on Hopper), the linear layers on cuBLAS
    # (the default before the fourth GPU session) with and without PDL, the GEMV without
    # PDL, flashinfer's decode (auto: its tensor-core kernel for 32/8 heads) and its
    # CUDA-core decode kernel, and eager
    fi_decode = {"decode_attention_backend": "flashinfer"}
    configs = [("cuda_graph", True, {}),
               ("cuda_graph_cublas", True, {"gemv_backend": "torch"}),
               ("cuda_graph_flashinfer_decode", True, fi_decode),
               ("cuda_graph_cuda_core_decode", True,
                {**fi_decode, "flashinfer_decode_tensor_cores": "off"}),
               ("cuda_graph_triton_gemv", True, {"gemv_backend": "triton", "enable_pdl": False}),
               ("cuda_graph_torch_layers", True, {"disable_layer_kernels": True}),
               ("cuda_graph_merge_kernel", True, {"triton_decode_merge": "kernel"}),
               ("cuda_graph_cublas_pdl", True, {"gemv_backend": "torch", "enable_pdl": True}),
               ("no_cuda_graph", False, {})]
    configs = [c for c in configs if c[0] in args.decode_configs
               and (ctx.cuda or not {"decode_attention_backend", "gemv_backend",
                                     "disable_layer_kernels", "triton_decode_merge",
                                     "enable_pdl"}
                    & set(c[2]))]
    # (CPU: no flashinfer; the GEMV would run in the interpreter, a second a token)
    assert configs and configs[0][0] == "cuda_graph", "the cuda_graph config is the result"
    for label, graphs, overrides in configs:
        with make_engine(ctx, path, disable_cuda_graph=not graphs, **overrides) as engine:
            weight_bytes = _weight_bytes(engine)
            kv_bytes = _kv_bytes_per_token(engine) * (prompt_len + new / 2)
            drive(engine, random_prompts(vocab, 1, prompt_len, ctx.seed + 7), 8)  # warm-up
            per_token = []
            for rep in range(1 if ctx.quick else 3):
                run = drive(engine, random_prompts(vocab, 1, prompt_len, ctx.seed + rep), new)
                per_token.append(_ms_per_token(run.token_times))
            ms = statistics.median(per_token)
            window = (4, 8) if ctx.quick else (16, 64)
            row = _roofline_row(label, ms, weight_bytes + kv_bytes, bw_sheet, bw_measured)
            row["ms_per_token_runs"] = per_token
            row["gpu_timeline"] = timeline(ctx, engine, random_prompts(vocab, 1, prompt_len, 99),
                                           new, window)
            if ctx.profile:
                table = Profiled(ctx, cpu_ops=True, table=ctx.name(f"decode_bs1_{label}_profile"))
                row["profile"] = drive(engine, random_prompts(vocab, 1, prompt_len, 98), new,
                                       table, window).timeline
            results["weight_bytes"], results["kv_bytes_read_per_token"] = weight_bytes, kv_bytes
        del engine  # its KV pool holds most of the GPU's memory
        release(ctx)
        results[label] = row
        rows.append(row)
    print_table(rows, ["config", "ms_per_token", "roofline_ms", "roofline_fraction",
                       "roofline_fraction_measured_bw"])
    best = results["cuda_graph"]
    summary = {"decode_bs1_ms_per_token": best["ms_per_token"],
               "decode_bs1_roofline_fraction": best["roofline_fraction"],
               "decode_bs1_roofline_fraction_measured_bw": best["roofline_fraction_measured_bw"]}
    for label in ("cuda_graph_cublas", "cuda_graph_flashinfer_decode",
                  "cuda_graph_cuda_core_decode", "cuda_graph_triton_gemv",
                  "cuda_graph_torch_layers", "cuda_graph_merge_kernel", "cuda_graph_cublas_pdl"):
        if label in results:  # (below 1: the default is faster)
            summary[f"decode_bs1_default_vs_{label.removeprefix('cuda_graph_')}"] = (
                best["ms_per_token"] / results[label]["ms_per_token"])
    return finish(ctx, "decode_bs1", results, summary)


def _roofline_row(label: str, ms: float, nbytes: float, sheet: float | None,
                  measured: float) -> dict[str, Any]:
    sheet_ms = 1e3 * nbytes / sheet if sheet else None
    measured_ms = 1e3 * nbytes / measured
    return {"config": label, "ms_per_token": ms, "bytes_per_token": nbytes,
            "roofline_ms": sheet_ms, "roofline_fraction": sheet_ms / ms if sheet_ms else None,
            "roofline_ms_measured_bw": measured_ms,
            "roofline_fraction_measured_bw": measured_ms / ms}


def _ms_per_token(times: list[float]) -> float:
    """Mean inter-token time of steady decode (the first 4 intervals are left out)."""
    steady = times[4:] if len(times) > 8 else times
    return 1e3 * (steady[-1] - steady[0]) / max(len(steady) - 1, 1)


def measure_copy_bandwidth(ctx: Ctx) -> float:
    """A device-to-device copy of 1 GiB (64 MiB on a CPU): bytes read plus bytes written per
    second, over 10 copies after 3 warm-ups (CUDA events on a GPU)."""
    n = (1 << 30) if ctx.cuda else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(ctx)
    if ctx.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / 10
    else:
        t = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        seconds = (time.perf_counter() - t) / 10
    del src, dst
    release(ctx)
    return 2 * n / seconds


def _datasheet_bw(ctx: Ctx) -> tuple[float | None, str | None]:
    if not ctx.cuda:
        return None, None
    name = torch.cuda.get_device_name(0)
    for key, bw, label in DATASHEET_BW:
        if key in name:
            return bw, label
    return None, None


def _weight_bytes(engine: Any) -> int:
    """Bytes of the parameters, each storage once (a tied lm_head is the embedding). From
    the loaded model, or from the checkpoint's tensors in the engine's dtype where the model
    lives in another process (CPU overlap)."""
    runner = engine.scheduler.model_runner
    if runner.model is not None:
        seen, total = set(), 0
        for t in runner.model.parameters():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total
    import glob

    from safetensors import safe_open

    size = torch.empty((), dtype=runner.dtype).element_size()
    total = 0
    for path in glob.glob(os.path.join(engine.args.model_path, "*.safetensors")):
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total * size


def _kv_bytes_per_token(engine: Any) -> int:
    from engine.mem_cache.kv_pool import KVPool

    mc = engine.scheduler.model_runner.model_config
    dtype = engine.scheduler.model_runner.dtype
    return KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
