"""Sliding-window layers on the CPU backend: gathering only the window's keys vs the whole
context masked to the window (what torch_native did before), side by side in one run.

    python benchmarks/window_gather.py [--arch mistral] [--window 512] [--context 3072]

A random model of the `small` preset's shape (hidden 1024, 8 layers, GQA 16/4; `--layers`)
with sliding-window attention (mistral: every layer windowed; gemma3_text: every other layer,
the rest global), `--batch` prompts of `--context` tokens each, `--output` greedy tokens each
(`ignore_eos`), prompts prefilled in chunks of `--chunk` tokens. The engine runs in-process
(overlap off in both arms, so that the model forward can be timed); every forward is timed by
mode. The arms alternate (`--pairs`), and both must generate the same tokens. Reported: ms per
decode step and per prefill token, and the full-gather / narrow-gather time ratios. Absolute
times on a shared machine are noise; the ratios are the result.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import print_table, write_result  # noqa: E402


def run_arm(
    path: str, prompts: list[list[int]], output: int, narrow: bool, chunk: int
) -> dict[str, Any]:
    from engine.attention import torch_native_plan
    from engine.engine import Engine

    plan_cls = torch_native_plan.Plan
    original = plan_cls.window_view
    plan_cls.window_view = lambda self, window, narrow_=narrow: original(self, window, narrow_)
    times: dict[str, list[float]] = {"prefill": [], "decode": []}
    try:
        with Engine(
            model_path=path,
            attention_backend="torch_native",
            disable_overlap_schedule=True,
            skip_tokenizer_init=True,
            chunked_prefill_size=chunk,
            max_total_tokens=len(prompts) * (len(prompts[0]) + output) + 256,
        ) as engine:
            runner = engine.scheduler.model_runner
            forward = runner.forward

            def timed(fb: Any) -> Any:
                t0 = time.perf_counter()
                out = forward(fb)
                mode = "decode" if fb.forward_mode.is_decode() else "prefill"
                times[mode].append(time.perf_counter() - t0)
                return out

            engine.generate(input_ids=[prompts[0][:16]], sampling_params={"max_new_tokens": 2})
            engine.flush_cache()
            times["prefill"].clear(), times["decode"].clear()
            runner.forward = timed
            params = {"max_new_tokens": output, "temperature": 0.0, "ignore_eos": True}
            outs = engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        plan_cls.window_view = original
    prefill_tokens = sum(len(p) for p in prompts)
    return {
        "narrow": narrow,
        "decode_steps": len(times["decode"]),
        "decode_ms_per_step": 1e3 * statistics.median(times["decode"]),
        "prefill_s": sum(times["prefill"]),
        "prefill_ms_per_token": 1e3 * sum(times["prefill"]) / prefill_tokens,
        "tokens": [o["output_ids"] for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", default="mistral", help="make-tiny-model architecture")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--context", type=int, default=3072, help="prompt tokens per request")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--chunk", type=int, default=1024, help="chunked prefill size (later chunks of a prompt "
        "attend to a cached prefix, where a windowed layer's gather can shrink)",
    )  # fmt: skip
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from services.tiny_model import make_tiny_model

    name = f"sluice-bench-window-{args.arch}-{args.window}-{args.layers}l"
    path = os.path.join(tempfile.gettempdir(), name)
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_model(
            path, arch=args.arch, preset="small", seed=args.seed,
            sliding_window=args.window, num_layers=args.layers,
            max_position_embeddings=max(4096, 2 * args.context),
        )  # fmt: skip
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 30000) for _ in range(args.context)] for _ in range(args.batch)]

    rows: list[dict[str, Any]] = []
    for pair in range(args.pairs):
        for narrow in (True, False) if pair % 2 == 0 else (False, True):
            res = run_arm(path, prompts, args.output, narrow, args.chunk)
            rows.append({"pair": pair, **res})
            print(
                f"pair {pair} {'narrow' if narrow else 'full  '}: decode "
                f"{res['decode_ms_per_step']:.1f} ms/step, prefill "
                f"{res['prefill_ms_per_token']:.3f} ms/token",
                flush=True,
            )
    tokens = {str(r["tokens"]) for r in rows}
    same_tokens = len(tokens) == 1
    ratios = []
    for pair in range(args.pairs):
        by = {r["narrow"]: r for r in rows if r["pair"] == pair}
        ratios.append(
            {
                "pair": pair,
                "decode_full_over_narrow": by[False]["decode_ms_per_step"]
                / by[True]["decode_ms_per_step"],
                "prefill_full_over_narrow": by[False]["prefill_s"] / by[True]["prefill_s"],
            }
        )
    print_table(
        [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
        ["pair", "narrow", "decode_steps", "decode_ms_per_step", "prefill_ms_per_token"],
    )
    print_table(ratios, ["pair", "decode_full_over_narrow", "prefill_full_over_narrow"])
    summary = {
        "decode_full_over_narrow": statistics.median(r["decode_full_over_narrow"] for r in ratios),
        "prefill_full_over_narrow": statistics.median(
            r["prefill_full_over_narrow"] for r in ratios
        ),
        "same_tokens": same_tokens,
    }
    print(summary)
    out = write_result(
        f"window_gather_{args.arch}",
        [{k: v for k, v in r.items() if k != "tokens"} for r in rows] + ratios,
        summary,
        config=vars(args),
    )
    print("wrote", out)
    if not same_tokens:
        raise SystemExit("the two arms generated different tokens")


if __name__ == "__main__":
    main()
