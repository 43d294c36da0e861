"""Decode attention backends side by side: the decode step time of each backend named for
decode (`decode_attention_backend`; prefill keeps the engine's default), over batch x context
shapes from batch 1 at 8k tokens to batch 256 at 512, in one run on one model.

    python benchmarks/gpu_decode_backends.py [--backends flashinfer triton] [--new-tokens 64]
    python benchmarks/gpu_decode_backends.py --device cpu --quick --backends torch_native

Model: a random Llama-3.2-1B shape in bfloat16 (32 query heads over 8 KV heads of 64), CUDA
graphs and the overlap scheduler on (the defaults). Per case: all prompts at once (random
tokens, `context` long), greedy decode of `--new-tokens`; the step time is the median wall
time of the steps in which every request decodes (prefill excluded), so tok/s = batch / step.
The ratio columns divide each backend's step time by the first backend's, per case.

Results: results/gpu_decode_backends.json (`_quick` in quick mode).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402
from benchmarks.gpu_common import (  # noqa: E402
    Ctx,
    build_model,
    finish,
    make_engine,
    random_prompts,
    release,
    vocab_size,
)
from benchmarks.gpu_timeline import drive  # noqa: E402

CASES = ((1, 8192), (8, 8192), (32, 4096), (64, 2048), (128, 1024), (256, 512))
QUICK_CASES = ((1, 64), (4, 32))


def run(ctx: Ctx, backends: list[str], new_tokens: int) -> dict[str, Any]:
    path = build_model(ctx, "llama-3.2-1b")
    vocab = vocab_size(path)
    cases = QUICK_CASES if ctx.quick else CASES
    new = 8 if ctx.quick else new_tokens
    rows: list[dict[str, Any]] = []
    for backend in backends:
        max_bs = max(b for b, _ in cases)
        with make_engine(ctx, path, decode_attention_backend=backend,
                         max_running_requests=max_bs) as engine:  # fmt: skip
            drive(engine, random_prompts(vocab, 2, 32, ctx.seed + 1), 8)  # warm-up
            for batch, context in cases:
                engine.flush_cache()
                prompts = random_prompts(vocab, batch, context, ctx.seed + batch)
                result = drive(engine, prompts, new)
                step_s = statistics.median(result.decode_step_s)
                rows.append({"backend": backend, "batch": batch, "context": context,
                             "step_ms": 1e3 * step_s, "tok_s": batch / step_s,
                             "steps": len(result.decode_step_s)})  # fmt: skip
                print(rows[-1], flush=True)
        del engine
        release(ctx)
    first = {(r["batch"], r["context"]): r["step_ms"] for r in rows if r["backend"] == backends[0]}
    for r in rows:
        r[f"vs_{backends[0]}"] = r["step_ms"] / first[(r["batch"], r["context"])]
    common.print_table(rows, ["backend", "batch", "context", "step_ms", "tok_s",
                              f"vs_{backends[0]}"])  # fmt: skip
    results = {"model": "llama-3.2-1b shape", "dtype": ctx.dtype, "new_tokens": new,
               "backends": backends, "cases": rows}  # fmt: skip
    summary = {f"decode_{r['backend']}_bs{r['batch']}_ctx{r['context']}_vs_{backends[0]}":
               r[f"vs_{backends[0]}"] for r in rows if r["backend"] != backends[0]}  # fmt: skip
    return finish(ctx, "decode_backends", results, summary)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--quick", action="store_true", help="a tiny model and two small cases")
    ap.add_argument("--backends", nargs="+", default=["flashinfer", "triton"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model-dir", default="/tmp/sluice-gpu-bench")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    ctx = Ctx(device=args.device, quick=args.quick, profile=False,
              dtype=args.dtype or ("bfloat16" if cuda else "float32"), attention_backend=None,
              engine_args={}, model_dir=args.model_dir)  # fmt: skip
    return run(ctx, args.backends, args.new_tokens)


if __name__ == "__main__":
    main()
