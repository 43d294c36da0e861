"""The fused elementwise kernels (kernels/fused_norm.py, activation.py, rotary.py) against the
torch code they replace, on a GPU.

1. Per op, Llama-3.2-1B decode shapes (one token, bf16, hidden 2048, intermediate 8192,
   32 + 8 heads of 64; greedy argmax over 128,256 float32 logits, batch 1 and 64): each op
   replayed `REPS` times in one CUDA graph, microseconds per op. Rows `greedy_bf16_*`: a
   decode graph's bf16 logits (GPT-2's 50,257 in rows of 50,304) to greedy tokens, as before
   (float32 conversion, argmax) against now (the argmax of the bf16 rows; the sampler,
   engine/sampling/sampler.py).
2. Whole engine, decode at batch 1 on a random Llama-3.2-1B shaped model with CUDA graphs
   (as benchmarks/gpu_decode_bs1.py): ms per output token and the GPU's busy time per step,
   with the fused kernels and with the layers on their torch code (--disable-layer-kernels).

    python -m benchmarks.gpu_fused_kernels [--attention-backend triton] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch

REPS = 200
MODEL_DIR = "/tmp/sluice-gpu-bench"


def graph_us(fn: Callable[[], Any], reps: int = REPS) -> float:
    """Microseconds per call of `fn`, `reps` calls captured in one CUDA graph, median of 5."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / reps)
    return statistics.median(times)


def op_table() -> list[dict[str, Any]]:
    from engine.layers.activation import silu_and_mul_torch
    from engine.layers.layernorm import rms_norm as rms_norm_torch
    from engine.layers.rotary import RotaryEmbedding, rotate_torch
    from kernels import fused_norm
    from kernels.activation import silu_and_mul
    from kernels.argmax import argmax_rows
    from kernels.rotary import apply_rotary

    dt, dev = torch.bfloat16, "cuda"
    x, res = torch.randn(2, 1, 2048, dtype=dt, device=dev)
    w = torch.randn(2048, dtype=dt, device=dev)
    gate_up = torch.randn(1, 2 * 8192, dtype=dt, device=dev)
    qkv = torch.randn(1, 48 * 64, dtype=dt, device=dev)
    qk = qkv[:, : 40 * 64].view(1, 40, 64)
    rope = RotaryEmbedding(64, 8192, {"rope_type": "default", "rope_theta": 500000.0})
    cache, pos = rope.cos_sin_cache.to(dev, dt), torch.tensor([1000], device=dev)
    logits1, logits64 = (torch.randn(b, 128256, device=dev) for b in (1, 64))  # float32
    gpt2 = {b: torch.randn(b, 50304, dtype=dt, device=dev)[:, :50257] for b in (64, 256)}
    ops = {
        "rms_norm": (lambda: rms_norm_torch(x, w, 1e-5), lambda: fused_norm.rms_norm(x, w, 1e-5)),
        "add_rms_norm": (
            lambda: rms_norm_torch(x + res, w, 1e-5),
            lambda: fused_norm.fused_add_rms_norm(x, res, w, 1e-5),
        ),
        "silu_and_mul": (lambda: silu_and_mul_torch(gate_up), lambda: silu_and_mul(gate_up)),
        "rotary": (
            lambda: rotate_torch(pos, qk, cache, 64),
            lambda: apply_rotary(pos, qk, cache, 64),
        ),
        "argmax_bs1": (lambda: torch.argmax(logits1, -1), lambda: argmax_rows(logits1)),
        "argmax_bs64": (lambda: torch.argmax(logits64, -1), lambda: argmax_rows(logits64)),
        **{
            f"greedy_bf16_bs{b}": (
                lambda x=x: argmax_rows(x.float()),  # "torch_us": the float32 conversion first
                lambda x=x: argmax_rows(x),
            )
            for b, x in gpt2.items()
        },
    }
    rows = []
    for name, (torch_fn, fused_fn) in ops.items():
        t_torch, t_fused = graph_us(torch_fn), graph_us(fused_fn)
        rows.append({"op": name, "torch_us": t_torch, "fused_us": t_fused,
                     "speedup": t_torch / t_fused})  # fmt: skip
    return rows


def decode_rows(backend: str | None, new_tokens: int) -> list[dict[str, Any]]:
    from benchmarks.gpu_common import Ctx, build_model, make_engine, random_prompts, release
    from benchmarks.gpu_timeline import drive, timeline

    ctx = Ctx(device="cuda", dtype="bfloat16", quick=False, profile=False,
              attention_backend=backend, engine_args={}, model_dir=MODEL_DIR)  # fmt: skip
    path = build_model(ctx, "llama-3.2-1b")
    rows = []
    for label, disabled in (("fused", False), ("torch", True)):
        with make_engine(ctx, path, disable_layer_kernels=disabled) as engine:
            prompts = random_prompts(32000, 1, 128, 7)
            drive(engine, prompts, 8)  # warm-up, captures the graphs
            per_token = []
            for rep in range(3):
                run = drive(engine, random_prompts(32000, 1, 128, rep), new_tokens)
                steady = run.token_times[4:]
                per_token.append(1e3 * (steady[-1] - steady[0]) / (len(steady) - 1))
            tl = timeline(ctx, engine, random_prompts(32000, 1, 128, 99), new_tokens, (16, 64))
            rows.append({"config": label, "ms_per_token": statistics.median(per_token),
                         "ms_per_token_runs": per_token, "gpu_timeline": tl})  # fmt: skip
        release(ctx)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "ops": op_table()}
    for row in out["ops"]:
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
    if not args.skip_decode:
        out["decode_bs1"] = decode_rows(args.attention_backend, args.decode_tokens)
        for row in out["decode_bs1"]:
            busy = {k: v for k, v in row["gpu_timeline"].items() if not isinstance(v, list)}
            print(row["config"], f"{row['ms_per_token']:.3f} ms/token", busy)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
