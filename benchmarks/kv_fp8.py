"""FP8 KV cache against the model-dtype cache, side by side in one run, on the same KV bytes:
how many tokens the bytes hold, how many requests then run at once, throughput, and what
the rounding does to the model's predictions.

    python benchmarks/kv_fp8.py [--preset small] [--device cpu] [--dtype float32]
    python benchmarks/kv_fp8.py --preset llama-3.2-1b --device cuda --dtype bfloat16 \\
        --requests 256 --context 2048 --output 128 --kv-mb 4096 --name gpu_kv_fp8

Arms on one random model (`--preset`): `kv_cache_dtype` auto (the cache in `--dtype`), fp8
(e4m3) and fp8_e5m2. Each gets the KV bytes of `--kv-mb` (its `max_total_tokens` is those
bytes over its bytes per token), so a float8 cache holds twice the tokens of a bfloat16 one
and four times a float32 one.

* capacity: `--requests` prompts of `--context` random tokens, `--output` greedy tokens each
  (`ignore_eos`), submitted at once; the default budget holds about half of them in the
  model-dtype cache. Reported: pool tokens, the most requests in one decode batch,
  retractions, wall time, output and total tokens/s;
* agreement: prompt logprobs (`logprob_start_len=0`, `top_logprobs_num=1`: every prompt
  position, its keys read back from the cache) of `--score-prompts` prompts against the auto
  arm's: how often the top token is the same, and |delta logprob| of the prompt's tokens.
  Random weights amplify any rounding layer after layer, so a `bfloat16` row (the model in
  bfloat16, scored against float32, only when `--dtype float32`) gives the scale to read the
  float8 rows by; a trained model loses far less.

On a CPU attention converts the gathered float8 keys and values to the model dtype first: one
more copy per layer, so a float8 cache is slower per token there; the arm's gain is the
batch it can hold. On a GPU the kernels read float8 directly: half the bytes per decode step.
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

from benchmarks.common import (  # noqa: E402
    count_decode_batches,
    print_table,
    prompt_agreement,
    score_prompts,
    write_result,
)

ARMS = ("auto", "fp8_e4m3", "fp8_e5m2")


def bytes_per_token(path: str, arm: str, dtype: torch.dtype) -> int:
    from engine.config import ModelConfig
    from engine.mem_cache.kv_pool import KVPool
    from engine.mem_cache.kv_quant import resolve_kv_cache_dtype

    mc = ModelConfig.from_pretrained(path)
    kv_dtype = resolve_kv_cache_dtype(arm, dtype)
    return KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, kv_dtype)


def kv_tokens(path: str, arm: str, dtype: torch.dtype, kv_mb: float) -> int:
    """The tokens `kv_mb` MiB of cache hold for `arm`."""
    return int(kv_mb * (1 << 20)) // bytes_per_token(path, arm, dtype)


def run_arm(path: str, arm: str, args: argparse.Namespace, prompts: list, scored: list) -> dict:
    from engine.config import resolve_dtype
    from engine.engine import Engine

    model_dtype = args.dtype if arm != "bfloat16" else "bfloat16"
    kv = "auto" if arm == "bfloat16" else arm
    tokens = kv_tokens(path, kv, resolve_dtype(model_dtype, "float32"), args.kv_mb)
    out: dict[str, Any] = {"arm": arm, "pool_tokens": tokens}
    with Engine(
        model_path=path, device=args.device, dtype=model_dtype, kv_cache_dtype=kv,
        skip_tokenizer_init=True, disable_overlap_schedule=args.device == "cpu",
        max_total_tokens=tokens, chunked_prefill_size=args.chunk,
    ) as engine:  # fmt: skip
        out.update(score_prompts(engine, scored))
        if arm == "bfloat16":
            return out
        scheduler = engine.scheduler
        pool = scheduler.model_runner.kv_pool
        if pool is not None:  # (the CPU overlap loop's device process holds it otherwise)
            out["kv_bytes"] = sum(b.nbytes for b in pool.k_buffer + pool.v_buffer)
        batch_sizes = count_decode_batches(scheduler)
        params = {"max_new_tokens": args.output, "temperature": 0.0, "ignore_eos": True}
        before = scheduler.stats.num_retractions
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t0
        out_tokens = sum(len(o["output_ids"]) for o in outs)
        out.update(
            max_decode_batch=max(batch_sizes, default=0),
            retractions=scheduler.stats.num_retractions - before,
            wall_s=wall,
            output_tok_s=out_tokens / wall,
            total_tok_s=(out_tokens + sum(len(p) for p in prompts)) / wall,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--kv-mb", type=float, default=None,
                   help="KV bytes of every arm (default: the model-dtype cache holds half "
                   "of the requests' tokens)")  # fmt: skip
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--score-prompts", type=int, default=8)
    p.add_argument("--score-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="kv_fp8")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.config import resolve_dtype
    from services.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="sluice-kv-fp8-") as root:
        path = make_tiny_model(os.path.join(root, "model"), preset=args.preset, seed=args.seed)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(path).vocab_size
        if args.kv_mb is None:
            need = args.requests * (args.context + args.output) // 2
            per_token = bytes_per_token(path, "auto", resolve_dtype(args.dtype, "float32"))
            args.kv_mb = need * per_token / (1 << 20)
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(8, vocab) for _ in range(args.context)]
                   for _ in range(args.requests)]  # fmt: skip
        scored = [[rng.randrange(8, vocab) for _ in range(args.score_len)]
                  for _ in range(args.score_prompts)]  # fmt: skip
        arms = {}
        for arm in ARMS + (("bfloat16",) if args.dtype == "float32" else ()):
            arms[arm] = run_arm(path, arm, args, prompts, scored)
            print(f"{arm}: {arms[arm].get('wall_s', 0):.1f} s", flush=True)
    auto = arms["auto"]
    rows = []
    for arm, out in arms.items():
        row = {k: v for k, v in out.items() if not k.startswith("prompt_")}
        if arm == "auto":
            row["arm"] = f"auto ({args.dtype})"
        elif arm == "bfloat16":
            row["arm"] = "bfloat16 model vs float32 (scored only)"
        if arm != "auto":
            row.update(prompt_agreement(out, auto))
        if arm in ARMS and arm != "auto":
            row["tokens_ratio"] = out["pool_tokens"] / auto["pool_tokens"]
            row["throughput_ratio"] = out["total_tok_s"] / auto["total_tok_s"]
            row["batch_ratio"] = out["max_decode_batch"] / max(1, auto["max_decode_batch"])
        rows.append(row)
    print_table(rows, ["arm", "kv_bytes", "pool_tokens", "max_decode_batch", "retractions",
                       "wall_s", "output_tok_s", "total_tok_s", "top1_agreement",
                       "mean_abs_dlogprob", "tokens_ratio", "throughput_ratio"])  # fmt: skip
    by_arm = {arm: row for arm, row in zip(arms, rows)}
    summary = {
        "kv_fp8_tokens_ratio": by_arm["fp8_e4m3"]["tokens_ratio"],
        "kv_fp8_batch_ratio": by_arm["fp8_e4m3"]["batch_ratio"],
        "kv_fp8_throughput_ratio": by_arm["fp8_e4m3"]["throughput_ratio"],
        "kv_fp8_e5m2_throughput_ratio": by_arm["fp8_e5m2"]["throughput_ratio"],
        "kv_fp8_e4m3_top1_agreement": by_arm["fp8_e4m3"]["top1_agreement"],
        "kv_fp8_e5m2_top1_agreement": by_arm["fp8_e5m2"]["top1_agreement"],
    }
    if "bfloat16" in by_arm:
        summary["bf16_model_top1_agreement"] = by_arm["bfloat16"]["top1_agreement"]
    print(write_result(args.name, rows, summary, config=vars(args)))


if __name__ == "__main__":
    main()
