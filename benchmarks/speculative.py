"""Speculative decoding (n-gram drafts) against plain decoding, side by side in one run.

    python benchmarks/speculative.py [--layers 4] [--output 64] [--draft-tokens 4] [--threads 2]
        [--device cuda --dtype bfloat16 --name gpu_speculative]   (the GPU session's step)

A random Llama of the `small` preset's shape (hidden 1024, GQA 16/4, intermediate 2816,
vocab 32000) with `--layers` layers; two engines, overlap off in both (speculative decoding
turns it off), one with `--speculative-algorithm ngram`. Prompts of `--context` random tokens,
`--output` greedy tokens each (`ignore_eos`), `--batch` requests at once. A random model's
text decides how often the drafts are right, so three workloads span the range:

* forced: a logit_bias of +100 on one token; the output repeats it and every draft from the
  second step on is right (the ceiling: accept length near 1 + draft tokens);
* 3-token loop: allowed_token_ids of 3 tokens; the greedy output cycles irregularly and the
  drafts are partly right (about what copying text does for a real model);
* free text: no constraint; n-grams of the random text rarely recur, drafts are rarely
  proposed (the floor: what speculation costs when it finds nothing).

A third arm drafts trees (`tree`: the continuations of `--tree-topk` matches merged into
`--tree-nodes` nodes, `--draft-tokens` deep; engine/speculative/ngram.py) and is reported
beside the chain (`tree_speedup`, `tree_accept_length`).

The arms' timed runs interleave, `--repeat` rounds (the fastest run counts). Reported per
workload and batch: output tokens/s of each arm and their ratio, the accept length (tokens per
request and verify step), the mean time of a plain decode step and of the speculative arm's
decode steps (verify steps, and plain ones where no request had drafts), and the fraction of
requests whose tokens are the same in both arms: on CPU (float32) the run fails unless all
are; in bf16 on a GPU the two kernels' roundings may break a near-tie differently.

On a GPU the speculative arm's verify steps replay CUDA graphs (engine/speculative/
verify_graphs.py), and a third arm runs them eagerly (`spec_eager`): `graph_verify_gain` is
its time over the speculative arm's, `eager_spec_step_ms` its mean decode / verify step.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import parse_arm_args, print_table, small_model, write_result  # noqa: E402

WORKLOADS = {
    "forced": {"logit_bias": {"500": 100.0}},
    "3-token loop": {"allowed_token_ids": [11, 12, 13]},
    "free text": {},
}


class Arm:
    """One engine, kept open; times its runs and its decode / verify steps."""

    def __init__(self, path: str, args: Any, verify_graphs: bool = True, **kw: Any) -> None:
        """`verify_graphs=False`: the verify steps run eagerly (the engine's graphs of them
        dropped and never captured again), for the side-by-side on a GPU."""
        from engine.engine import Engine

        self.engine = Engine(
            model_path=path, disable_overlap_schedule=True, skip_tokenizer_init=True,
            max_total_tokens=max(args.batch) * (args.context + args.output) + 512,
            device=args.device, dtype=args.dtype, **kw,
        )  # fmt: skip
        if not verify_graphs:
            runner = self.engine.scheduler.model_runner
            runner.verify_graph_runner = runner.verify_graph_width = None
        self.step_s: list[float] = []
        run_batch = self.engine.scheduler.run_batch

        def timed(batch: Any) -> Any:
            t0 = time.perf_counter()
            out = run_batch(batch)
            if self.engine.args.device.startswith("cuda"):
                torch.cuda.synchronize()  # (a verify step reads its tokens; decode does not)
            if batch.forward_mode.is_decode():
                self.step_s.append(time.perf_counter() - t0)
            return out

        self.engine.scheduler.run_batch = timed

    def run(self, prompts: list, params: dict) -> tuple[float, list, dict]:
        """(wall seconds, output ids, stats) of one run, the prefix cache flushed first."""
        from engine.speculative.scheduling import SpecStats

        self.engine.flush_cache()
        drafter = self.engine.scheduler.drafter
        if drafter is not None:  # this run's counts only
            drafter.stats = SpecStats()
        self.step_s.clear()
        t0 = time.perf_counter()
        outs = self.engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t0
        stats = self.engine.get_stats()
        stats["mean_step_ms"] = 1e3 * sum(self.step_s) / max(1, len(self.step_s))
        return wall, [o["output_ids"] for o in outs], stats


def best_runs(arms: dict[str, Arm], batch: list, params: dict, repeat: int) -> dict[str, Any]:
    """Each arm's fastest (wall seconds, output ids, stats) over `repeat` rounds, the arms'
    runs interleaved, after one warm-up run each."""
    for arm in arms.values():
        arm.run(batch, params)
    best: dict[str, Any] = {}
    for _ in range(repeat):
        for label, arm in arms.items():
            wall, out, stats = arm.run(batch, params)
            if label not in best or wall < best[label][0]:
                best[label] = (wall, out, stats)
    return best


def rows_against_plain(
    arms: dict[str, Arm], prompts: list, params: dict, args: Any
) -> list[dict[str, Any]]:
    """A row per batch of `args.batch` (the first that many prompts): plain decoding's
    output tokens/s and every other arm's, its speedup against plain, accept length and the
    fraction of requests whose tokens equal plain's (on the CPU, float32, all must)."""
    rows = []
    for bs in args.batch:
        best = best_runs(arms, prompts[:bs], params, args.repeat)
        pw, pout, _ = best["plain"]
        tokens = sum(map(len, pout))
        row: dict[str, Any] = {"batch": bs, "plain_tok_s": tokens / pw}
        for label in [a for a in arms if a != "plain"]:
            wall, out, stats = best[label]
            same = sum(p == q for p, q in zip(pout, out)) / bs
            if same < 1 and args.device == "cpu":  # (bf16 kernels may break near-ties apart)
                raise SystemExit(f"{label}, batch {bs}: speculative tokens differ from plain")
            row[f"{label}_tok_s"] = tokens / wall
            row[f"{label}_speedup"] = pw / wall
            row[f"{label}_accept_length"] = stats["spec_accept_length"]
            row[f"{label}_same_tokens"] = same
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--tree-topk", type=int, default=3, help="the tree arm's matches")
    ap.add_argument("--tree-nodes", type=int, default=8, help="the tree arm's nodes")
    args = parse_arm_args(ap, "speculative")
    path = small_model(args.layers, args.seed)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, 30000) for _ in range(args.context)] for _ in range(max(args.batch))
    ]
    plain = Arm(path, args)
    ngram = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": args.draft_tokens}
    tree = {**ngram, "speculative_num_draft_tokens": args.tree_nodes,
            "speculative_eagle_topk": args.tree_topk, "speculative_num_steps": args.draft_tokens}
    arms = {"plain": plain, "spec": Arm(path, args, **ngram), "tree": Arm(path, args, **tree)}
    if args.device.startswith("cuda"):  # the verify steps eager: what their graphs save
        arms["spec_eager"] = Arm(path, args, verify_graphs=False, **ngram)
    rows = []
    for name, extra in WORKLOADS.items():
        params = {"max_new_tokens": args.output, "temperature": 0.0, "ignore_eos": True, **extra}
        for bs in args.batch:
            batch = prompts[:bs]
            best = best_runs(arms, batch, params, args.repeat)
            (pw, pout, pstats), (sw, sout, sstats) = best["plain"], best["spec"]
            tw, tout, tstats = best["tree"]
            same = sum(p == q for p, q in zip(pout, sout)) / bs
            tree_same = sum(p == q for p, q in zip(pout, tout)) / bs
            if min(same, tree_same) < 1 and args.device == "cpu":  # (bf16 near-ties may differ)
                raise SystemExit(f"{name}, batch {bs}: speculative tokens differ from plain")
            tokens = sum(map(len, pout))
            row = {
                "workload": name, "batch": bs,
                "plain_tok_s": tokens / pw, "spec_tok_s": tokens / sw, "speedup": pw / sw,
                "accept_length": sstats["spec_accept_length"],
                "drafted_steps": sstats["spec_num_drafts"],
                "decode_step_ms": pstats["mean_step_ms"], "spec_step_ms": sstats["mean_step_ms"],
                "same_tokens": same,
                "tree_tok_s": tokens / tw, "tree_speedup": pw / tw,
                "tree_accept_length": tstats["spec_accept_length"], "tree_same_tokens": tree_same,
            }  # fmt: skip
            if "spec_eager" in best:
                ew, _, estats = best["spec_eager"]
                row.update(eager_verify_tok_s=tokens / ew, graph_verify_gain=ew / sw,
                           eager_spec_step_ms=estats["mean_step_ms"])  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    for arm in arms.values():
        arm.engine.shutdown()
    cols = ["workload", "batch", "plain_tok_s", "spec_tok_s", "speedup", "accept_length",
            "drafted_steps", "decode_step_ms", "spec_step_ms", "same_tokens",
            "tree_speedup", "tree_accept_length"]  # fmt: skip
    if "spec_eager" in arms:
        cols += ["eager_verify_tok_s", "eager_spec_step_ms", "graph_verify_gain"]
    print_table(rows, cols)
    summary = {f"{r['workload']} bs{r['batch']}": round(r["speedup"], 3) for r in rows}
    summary.update({f"{r['workload']} bs{r['batch']} tree": round(r["tree_speedup"], 3)
                    for r in rows})  # fmt: skip
    summary.update({f"{r['workload']} bs{r['batch']} graph_verify_gain":
                    round(r["graph_verify_gain"], 3) for r in rows if "graph_verify_gain" in r})
    print(summary)
    print("wrote", write_result(args.name, rows, summary, config=vars(args)))


if __name__ == "__main__":
    main()
