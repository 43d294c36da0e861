"""Tensor parallelism on this machine: one engine over 2 rank processes against one process,
side by side on the same model and requests.

    python benchmarks/tensor_parallel.py [--layers 8] [--batch 8] [--input 128] [--output 64]
    python benchmarks/tensor_parallel.py --moe --layers 4 --name expert_parallel

`--moe`: a Mixtral of the `small` shape (8 experts, top 2) instead, and the arms `tp1`, `tp2`
(every expert's features split over the ranks) and `tp2-ep2` (`--ep-size 2`: each rank holds
4 experts whole and computes only their share of each token), overlap loop on.

Arms: `tp1` (one process, every core's threads) and `tp2` (two rank processes, half the
threads each; gloo over loopback), each with the overlap loop (the CPU default) and without
it. Each arm: the engine started, one warm-up request, then `--repeat` times the batch of
`--batch` prompts of `--input` tokens, asked for one token (the prefill) and then for
`--output` tokens (ignore_eos, greedy), the prefix cache flushed before each. Reported: output
tokens/s of the decode part (the batch's tokens after the first, over the time past the
prefill's), prefill tokens/s, the time rank 0 spends sending each forward to the other rank
(`TPLink.send`: the batch's shape over gloo, then its ids, positions, slots and request rows
as one tensor), and the bytes of weights rank 0 holds. The arms' greedy tokens are checked
equal. The ratios are what this 2-core CPU says about the split's cost (each rank's matmuls
are half as large, and every layer adds two all-reduces of the batch's hidden states over
loopback); on GPUs with NVLink the same split is how a model larger than one GPU is served at
all, which this machine cannot show.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, small_model, write_result  # noqa: E402


def run_arm(
    path: str, tp: int, overlap: bool, prompts: list[list[int]], args: Any, ep: int = 1
) -> dict:
    import torch

    from engine.config import ModelConfig
    from engine.distributed import TensorParallel
    from engine.engine import Engine
    from engine.loader import build_model
    from engine.tensor_parallel import TPLink

    sends: list[float] = []
    original = TPLink.send

    def timed_send(self: TPLink, *args: Any) -> None:
        start = time.perf_counter()
        original(self, *args)
        sends.append(time.perf_counter() - start)

    TPLink.send = timed_send  # type: ignore[method-assign]
    one = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    full = {**one, "max_new_tokens": args.output}
    prefill, total, outs = [], [], None
    try:
        tokens = args.batch * (args.input + args.output) * 2
        with Engine(model_path=path, tp_size=tp, ep_size=ep, disable_overlap_schedule=not overlap,
                    max_total_tokens=tokens) as eng:  # fmt: skip
            eng.generate(input_ids=prompts[0], sampling_params=one)  # warm-up
            for _ in range(args.repeat):
                assert eng.flush_cache()
                t = time.perf_counter()
                eng.generate(input_ids=prompts, sampling_params=[one] * len(prompts))
                prefill.append(time.perf_counter() - t)
                assert eng.flush_cache()
                sends.clear()
                t = time.perf_counter()
                res = eng.generate(input_ids=prompts, sampling_params=[full] * len(prompts))
                total.append(time.perf_counter() - t)
                outs = [r["output_ids"] for r in res]
                forwards = len(sends)
                send_us = statistics.median(sends) * 1e6 if sends else 0.0
    finally:
        TPLink.send = original  # type: ignore[method-assign]
    p, t = min(prefill), min(total)
    rank0 = build_model(ModelConfig.from_pretrained(path), torch.float32, "meta", None,
                        TensorParallel(0, tp, ep_size=ep))  # (rank 0's part, on the meta device)
    weight_bytes = sum(w.numel() * w.element_size() for w in rank0.parameters())
    decode_tokens = args.batch * (args.output - 1)
    return {
        "arm": f"tp{tp}" + (f"-ep{ep}" if ep > 1 else "") + ("" if overlap else "-no-overlap"),
        "tp_size": tp,
        "ep_size": ep,
        "overlap": overlap,
        "prefill_tok_s": args.batch * args.input / p,
        "decode_tok_s": decode_tokens / max(t - p, 1e-9),
        "total_s": t,
        "forwards": forwards,
        "send_us_median": send_us,
        "rank0_weight_MB": weight_bytes / 2**20,
        "outputs": outs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--input", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--moe", action="store_true", help="a Mixtral; arms tp1, tp2, tp2-ep2")
    ap.add_argument("--name", default="tensor_parallel")
    args = ap.parse_args()
    path = small_moe(args.layers) if args.moe else small_model(args.layers)
    rng = random.Random(0)
    prompts = [[rng.randrange(8, 32000) for _ in range(args.input)] for _ in range(args.batch)]
    if args.moe:
        moe_main(path, prompts, args)
        return
    rows = [run_arm(path, tp, overlap, prompts, args)
            for overlap in (True, False) for tp in (1, 2)]  # fmt: skip
    same_tokens_then_table(rows)
    by = {r["arm"]: r for r in rows}
    summary = {
        "decode_tp2_vs_tp1": by["tp2"]["decode_tok_s"] / by["tp1"]["decode_tok_s"],
        "prefill_tp2_vs_tp1": by["tp2"]["prefill_tok_s"] / by["tp1"]["prefill_tok_s"],
        "decode_tp2_vs_tp1_no_overlap": by["tp2-no-overlap"]["decode_tok_s"]
        / by["tp1-no-overlap"]["decode_tok_s"],
        "send_us_median_tp2": by["tp2"]["send_us_median"],
        "rank0_weight_fraction_tp2": by["tp2"]["rank0_weight_MB"] / by["tp1"]["rank0_weight_MB"],
        "same_greedy_tokens": True,
    }
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()})
    print("wrote", write_result(args.name, rows, summary, args=vars(args)))


def same_tokens_then_table(rows: list[dict]) -> None:
    """Check that every arm's greedy tokens are the first's; print the table without them."""
    for row in rows[1:]:
        assert row["outputs"] == rows[0]["outputs"], f"{row['arm']}: other tokens than tp1"
    for row in rows:
        row.pop("outputs")
    print_table(rows, ["arm", "prefill_tok_s", "decode_tok_s", "total_s", "forwards",
                       "send_us_median", "rank0_weight_MB"])  # fmt: skip


def small_moe(layers: int) -> str:
    """A random Mixtral of the `small` shape with `layers` layers (built once, in the temp
    folder)."""
    import tempfile

    from services.tiny_model import make_tiny_model

    path = os.path.join(tempfile.gettempdir(), f"sluice-bench-small-mixtral-{layers}l")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_model(path, preset="small", arch="mixtral", num_layers=layers)
    return path


def moe_main(path: str, prompts: list[list[int]], args: Any) -> None:
    rows = [run_arm(path, tp, True, prompts, args, ep) for tp, ep in ((1, 1), (2, 1), (2, 2))]
    same_tokens_then_table(rows)
    tp1, tp2, ep2 = rows
    summary = {
        "decode_ep2_vs_tp2": ep2["decode_tok_s"] / tp2["decode_tok_s"],
        "prefill_ep2_vs_tp2": ep2["prefill_tok_s"] / tp2["prefill_tok_s"],
        "decode_ep2_vs_tp1": ep2["decode_tok_s"] / tp1["decode_tok_s"],
        "decode_tp2_vs_tp1": tp2["decode_tok_s"] / tp1["decode_tok_s"],
        "rank0_weight_fraction_ep2": ep2["rank0_weight_MB"] / tp1["rank0_weight_MB"],
        "same_greedy_tokens": True,
    }
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()})
    print("wrote", write_result(args.name, rows, summary, args=vars(args)))


if __name__ == "__main__":
    main()
