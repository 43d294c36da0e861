"""MTP speculative decoding (a DeepSeek-V3 or GLM-4.5 model drafting with its own
multi-token-prediction layer: `--speculative-algorithm nextn`) against plain decoding, side by
side in one run.

    python benchmarks/speculative_mtp.py [--arch deepseek_v3] [--layers 4] [--vocab 8000]
        [--draft-tokens 3] [--batch 1 8] [--threads 2]
        [--device cuda --dtype bfloat16 --name gpu_speculative_mtp]   (the GPU session's)

No trained model with an MTP layer can be downloaded, and a random layer agrees with a random
model on nothing, so the model is built to be predictable by one (services/tiny_mtp.py,
`--mtp-derived`): a random `--arch` model of the `small` preset's width (hidden 1024, its
experts) with `--layers` layers and a `--vocab` vocabulary, whose layers' attention and
feed-forward outputs are scaled down (a near-bigram model: each token is decided by the
previous token's embedding through the final norm and lm_head), and an MTP layer that computes
the same from the next token (`mtp`, a chain of `--draft-tokens`; `mtp_tree`, trees of topk
`--tree-topk` over the same steps, `--tree-nodes` nodes). The drafting costs are the real
ones: each draft is a forward of the MTP layer (attention and experts) and the lm_head. A
random MTP layer over the same model (`mtp_random`) is the floor: drafts almost never right,
what drafting costs when it buys nothing.

How often the drafts are right is a property of the pair, so every row reports the accept
length it got beside its speed. Arms (engines kept open, overlap off in all, as speculative
decoding turns it off) run interleaved, `--repeat` rounds (the fastest counts). Prompts of
`--context` random tokens, `--output` greedy tokens each (`ignore_eos`), `--batch` requests
at once. Reported per batch: output tokens/s of each arm, the speedups against plain, accept
lengths, and the fraction of requests whose tokens equal plain decoding's (on CPU in float32
the run fails unless all do).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import parse_arm_args, print_table, write_result  # noqa: E402
from benchmarks.speculative import Arm, rows_against_plain  # noqa: E402


def make_models(args: Any) -> tuple[str, str]:
    """(the derived model with its derived MTP layer, the same model with a random one)."""
    from services.tiny_model import make_tiny_model
    from services.tiny_mtp import add_mtp_layer

    root = tempfile.mkdtemp(prefix="sluice-mtp-bench-")
    base = make_tiny_model(os.path.join(root, "base"), args.arch, preset="small",
                           seed=args.seed, num_layers=args.layers,
                           vocab_size=args.vocab)  # fmt: skip
    paths = []
    for name, random_layer in (("derived", False), ("random", True)):
        path = os.path.join(root, name)
        shutil.copytree(base, path)
        paths.append(add_mtp_layer(path, derived=True, seed=args.seed, random_layer=random_layer))
    return paths[0], paths[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", choices=("deepseek_v3", "glm4_moe"), default="deepseek_v3")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--tree-topk", type=int, default=2)
    ap.add_argument("--tree-nodes", type=int, default=10,
                    help="the mtp_tree arm's nodes (default: every candidate of "
                    "--draft-tokens steps of topk 2)")
    args = parse_arm_args(ap, "speculative_mtp")
    path, random_path = make_models(args)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, args.vocab - 3) for _ in range(args.context)]
        for _ in range(max(args.batch))
    ]
    spec = {"speculative_algorithm": "nextn", "speculative_num_draft_tokens": args.draft_tokens}
    arms = {
        "plain": Arm(path, args),
        "mtp": Arm(path, args, **spec),
        "mtp_tree": Arm(path, args, **{**spec, "speculative_num_draft_tokens": args.tree_nodes,
                                       "speculative_eagle_topk": args.tree_topk,
                                       "speculative_num_steps": args.draft_tokens}),
        "mtp_random": Arm(random_path, args, **spec),
    }
    params = {"max_new_tokens": args.output, "temperature": 0.0, "ignore_eos": True}
    rows = rows_against_plain(arms, prompts, params, args)
    for arm in arms.values():
        arm.engine.shutdown()
    cols = ["batch", "plain_tok_s"] + [f"{label}_{key}" for label in ("mtp", "mtp_tree",
            "mtp_random") for key in ("tok_s", "speedup", "accept_length")]  # fmt: skip
    print_table(rows, cols)
    summary: dict[str, Any] = {"arch": args.arch}
    for r in rows:
        for label in ("mtp", "mtp_tree", "mtp_random"):
            summary[f"bs{r['batch']}_{label}_speedup"] = round(r[f"{label}_speedup"], 3)
            summary[f"bs{r['batch']}_{label}_accept_length"] = round(
                r[f"{label}_accept_length"], 3
            )
    print(summary)
    print("wrote", write_result(args.name, rows, summary, config=vars(args)))
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


if __name__ == "__main__":
    main()
