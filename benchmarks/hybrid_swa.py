"""Hybrid sliding-window memory: the same KV bytes, with and without it, side by side.

    python benchmarks/hybrid_swa.py [--layers 6] [--window 512] [--ratio 0.25]

A random Gemma 3 text model of the `small` preset's shape (hidden 1024, GQA 16/4) with
`--layers` layers (five windowed for each global one, as Gemma 3) and a `--window`-token
window; `--requests` prompts of `--context` tokens, `--output` greedy tokens each
(`ignore_eos`), all submitted at once. Both arms get the KV bytes that `--plain-tokens`
tokens take without hybrid memory; with it, those bytes buy more full-pool tokens (the
windowed layers' pool is `--ratio` as long), so more requests run at once.

Reported per arm: KV bytes allocated (summed over the pool's buffers), full-pool tokens,
window-pool tokens, the most requests in one decode batch, retractions, wall time and
output/total tokens per second; then hybrid/plain ratios. The engine runs in-process with
overlap off (both arms alike). Both arms must generate the same tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import count_decode_batches, print_table, write_result  # noqa: E402


def full_tokens_for(path: str, plain_tokens: int, ratio: float) -> int:
    """Full-pool tokens whose hybrid pools take the bytes of `plain_tokens` plain ones."""
    from engine.config import ModelConfig

    mc = ModelConfig.from_pretrained(path)
    windowed = sum(w is not None for w in mc.sliding_windows)
    per_plain = mc.num_layers
    per_hybrid = (mc.num_layers - windowed) + ratio * windowed
    return int(plain_tokens * per_plain / per_hybrid)


def run_arm(path: str, prompts: list[list[int]], output: int, hybrid: bool, args: Any) -> dict:
    from engine.engine import Engine

    tokens = full_tokens_for(path, args.plain_tokens, args.ratio) if hybrid else args.plain_tokens
    with Engine(
        model_path=path,
        attention_backend="torch_native",
        disable_overlap_schedule=True,
        skip_tokenizer_init=True,
        chunked_prefill_size=args.chunk,
        max_total_tokens=tokens,
        hybrid_swa_memory=hybrid,
        swa_full_tokens_ratio=args.ratio,
    ) as engine:
        scheduler = engine.scheduler
        pool = scheduler.model_runner.kv_pool
        kv_bytes = sum(b.numel() * b.element_size() for b in pool.k_buffer + pool.v_buffer)
        batch_sizes = count_decode_batches(scheduler)
        params = {"max_new_tokens": output, "temperature": 0.0, "ignore_eos": True}
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t0
        alloc = scheduler.pools.allocator
        retractions = scheduler.stats.num_retractions
    out_tokens = sum(len(o["output_ids"]) for o in outs)
    return {
        "hybrid": hybrid,
        "kv_bytes": kv_bytes,
        "full_tokens": alloc.size,
        "window_tokens": getattr(alloc, "swa_size", alloc.size),
        "max_decode_batch": max(batch_sizes, default=0),
        "retractions": retractions,
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + sum(len(p) for p in prompts)) / wall,
        "tokens": [o["output_ids"] for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--context", type=int, default=1536, help="prompt tokens per request")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--plain-tokens", type=int, default=6144, help="KV budget, in plain tokens")
    ap.add_argument("--ratio", type=float, default=0.25, help="swa_full_tokens_ratio")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from services.tiny_model import make_tiny_model

    name = f"sluice-bench-hybrid-swa-{args.window}-{args.layers}l-5to1"
    path = os.path.join(tempfile.gettempdir(), name)
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_model(
            path, arch="gemma3_text", preset="small", seed=args.seed,
            sliding_window=args.window, num_layers=args.layers,
            max_position_embeddings=max(4096, 2 * args.context),
            layer_types=[  # Gemma 3's pattern: five windowed layers, then a global one
                "full_attention" if i % 6 == 5 else "sliding_attention"
                for i in range(args.layers)
            ],
        )  # fmt: skip
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 30000) for _ in range(args.context)] for _ in range(args.requests)]
    rows = []
    for hybrid in (False, True):
        res = run_arm(path, prompts, args.output, hybrid, args)
        rows.append(res)
        print(f"hybrid={hybrid}: {res['wall_s']:.1f} s", flush=True)
    columns = [
        "hybrid", "kv_bytes", "full_tokens", "window_tokens", "max_decode_batch", "retractions",
        "wall_s", "output_tok_s", "total_tok_s",
    ]  # fmt: skip
    table = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
    print_table(table, columns)
    plain, hyb = rows
    summary = {
        "kv_bytes_hybrid_over_plain": hyb["kv_bytes"] / plain["kv_bytes"],
        "full_tokens_hybrid_over_plain": hyb["full_tokens"] / plain["full_tokens"],
        "max_batch_hybrid_over_plain": hyb["max_decode_batch"] / max(1, plain["max_decode_batch"]),
        "throughput_hybrid_over_plain": hyb["total_tok_s"] / plain["total_tok_s"],
        "same_tokens": plain["tokens"] == hyb["tokens"],
    }
    print(summary)
    print("wrote", write_result("hybrid_swa", table, summary, config=vars(args)))
    if not summary["same_tokens"]:
        raise SystemExit("the two arms generated different tokens")


if __name__ == "__main__":
    main()
