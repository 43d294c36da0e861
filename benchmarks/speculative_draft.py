"""Speculative decoding with a draft model or an EAGLE head against plain decoding, side by
side in one run.

    python benchmarks/speculative_draft.py [--layers 8] [--draft-layers 1] [--vocab 8000]
        [--residual-scale 0.05] [--draft-tokens 3] [--batch 1 8] [--threads 2]
        [--device cuda --dtype bfloat16 --name gpu_speculative_draft]   (the GPU session's)

No trained draft/target pair can be downloaded, and a random draft agrees with a random model
on nothing, so the pair is built to agree on part of the tokens, as a distilled draft does:

* the model: a random Llama of the `small` preset's width (hidden 1024, GQA 16/4,
  intermediate 2816) with `--layers` layers and a `--vocab` vocabulary (8000 by default, so
  that the lm_head weighs about what it does beside a real model's layers), whose layers
  after the first `--draft-layers` add `--residual-scale` times their attention and MLP
  outputs to the residual stream (their o_proj and down_proj weights scaled): the first
  layers decide most of its tokens, the others change some;
* the draft: those first `--draft-layers` layers, embeddings, final norm and lm_head
  (`services/tiny_draft.py`), a model about `draft_cost` of the model's weights;
* an EAGLE head derived the same way (`eagle`, services/tiny_eagle.py: `fc` passes the
  embedding, then a pass-through layer and copies of those first layers; it drafts from the
  model's hidden states' slots but reads only its tokens) over the model's embedding and
  lm_head. The model's final norm has weight 1 here (for all arms), so that the head, which
  has none, gets the same argmax from the same stream;
* the same EAGLE head drafting trees (`eagle_tree`: `--tree-topk` tokens a forward,
  `--draft-tokens` forwards, the `--tree-nodes` likeliest nodes verified; by default every
  candidate, which holds the chain's path and its runners-up), verified with tree masks
  (Triton's extend kernel on a GPU, the default with trees: flashinfer's have none here);
* floors, whose drafts are almost never right (what drafting costs when it buys nothing): a
  draft of the same size from another random model (`unrelated`), and a random EAGLE-3 head
  (`eagle3_random`: the model's three hidden states per token kept, a draft vocabulary of a
  quarter of the model's).

How often the drafts are right is a property of the pair (the residual scale here), so every
row reports the accept length it got (tokens per request and verify step) beside its speed.
Arms (engines kept open, overlap off in all, as speculative decoding turns it off): plain
decoding, the draft, the unrelated draft, and on a GPU the draft with the model's verify
steps eager (`draft_eager_verify`: its verify graphs dropped, what they save); their timed
runs interleave, `--repeat` rounds (the fastest run counts). Prompts of `--context` random
tokens, `--output` greedy tokens each (`ignore_eos`), `--batch` requests at once. Reported
per batch: output tokens/s of each arm, the speedups against plain, accept lengths, and the
fraction of requests whose tokens equal plain decoding's (on CPU in float32 the run fails
unless all do).

On this 2-core CPU a verify step of k + 1 tokens costs more than a decode step (its GEMMs are
compute-bound), and the draft's forwards run one after another; on a GPU both are
memory-bound and cost about one weight read each, where a draft model pays more.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import parse_arm_args, print_table, write_result  # noqa: E402
from benchmarks.speculative import Arm, rows_against_plain  # noqa: E402


def make_pair(args: Any, seed: int) -> tuple[str, str]:
    """(model folder, draft folder) for `args`' shape, built once each in the temp folder."""
    from safetensors.torch import load_file, save_file

    from services.tiny_draft import make_draft_model
    from services.tiny_model import make_tiny_model

    name = f"sluice-bench-spec-{args.layers}l-v{args.vocab}-r{args.residual_scale}-s{seed}-n1"
    path = os.path.join(tempfile.gettempdir(), name)
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_model(path, preset="small", seed=seed, num_layers=args.layers,
                        vocab_size=args.vocab)  # fmt: skip
        file = os.path.join(path, "model.safetensors")
        weights = load_file(file)
        for key, w in weights.items():
            layer = int(key.split(".")[2]) if key.startswith("model.layers.") else -1
            if layer >= args.draft_layers and key.endswith(("o_proj.weight", "down_proj.weight")):
                weights[key] = (w.float() * args.residual_scale).to(w.dtype)
        weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
        save_file({k: v.contiguous() for k, v in weights.items()}, file,
                  metadata={"format": "pt"})  # fmt: skip
    draft = f"{path}-draft{args.draft_layers}"
    if not os.path.exists(os.path.join(draft, "config.json")):
        make_draft_model(path, draft, args.draft_layers)
    return path, draft


def make_heads(path: str, args: Any) -> tuple[str, str]:
    """(the derived EAGLE head, a random EAGLE-3 head) for the model at `path`."""
    from services.tiny_eagle import make_eagle_head

    eagle, eagle3 = f"{path}-eagle{args.draft_layers}", f"{path}-eagle3"
    if not os.path.exists(os.path.join(eagle, "config.json")):
        make_eagle_head(path, eagle, copy_layers=args.draft_layers)
    if not os.path.exists(os.path.join(eagle3, "config.json")):
        make_eagle_head(path, eagle3, eagle3=True, draft_vocab=args.vocab // 4)
    return eagle, eagle3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--residual-scale", type=float, default=0.05)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--tree-topk", type=int, default=2, help="the eagle_tree arm's topk")
    ap.add_argument("--tree-nodes", type=int, default=10,
                    help="the eagle_tree arm's nodes (default: every candidate of "
                    "--draft-tokens steps of topk 2)")
    args = parse_arm_args(ap, "speculative_draft")
    path, draft = make_pair(args, args.seed)
    _, unrelated = make_pair(args, args.seed + 1)
    eagle, eagle3 = make_heads(path, args)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, args.vocab - 3) for _ in range(args.context)]
        for _ in range(max(args.batch))
    ]
    spec = {"speculative_algorithm": "standalone",
            "speculative_num_draft_tokens": args.draft_tokens}  # fmt: skip
    arms = {
        "plain": Arm(path, args),
        "draft": Arm(path, args, speculative_draft_model_path=draft, **spec),
        "unrelated": Arm(path, args, speculative_draft_model_path=unrelated, **spec),
        "eagle": Arm(path, args, speculative_draft_model_path=eagle,
                     **{**spec, "speculative_algorithm": "eagle"}),
        "eagle3_random": Arm(path, args, speculative_draft_model_path=eagle3,
                             **{**spec, "speculative_algorithm": "eagle3"}),
        # (on a GPU its verify steps run Triton's extend kernel, which has tree masks: the
        # default backends' choice with trees)
        "eagle_tree": Arm(path, args, speculative_draft_model_path=eagle,
                          **{**spec, "speculative_algorithm": "eagle",
                             "speculative_num_draft_tokens": args.tree_nodes,
                             "speculative_eagle_topk": args.tree_topk,
                             "speculative_num_steps": args.draft_tokens}),
    }
    if args.device.startswith("cuda"):  # the model's verify steps eager: what graphs save
        arms["draft_eager_verify"] = Arm(path, args, verify_graphs=False,
                                         speculative_draft_model_path=draft, **spec)  # fmt: skip
    params = {"max_new_tokens": args.output, "temperature": 0.0, "ignore_eos": True}
    rows = rows_against_plain(arms, prompts, params, args)
    draft_cost = _weights(draft) / _weights(path)
    for arm in arms.values():
        arm.engine.shutdown()
    cols = ["batch", "plain_tok_s", "draft_tok_s", "draft_speedup", "draft_accept_length",
            "unrelated_tok_s", "unrelated_speedup", "unrelated_accept_length",
            "eagle_tok_s", "eagle_speedup", "eagle_accept_length",
            "eagle3_random_speedup", "eagle3_random_accept_length",
            "eagle_tree_tok_s", "eagle_tree_speedup", "eagle_tree_accept_length"]  # fmt: skip
    if "draft_eager_verify" in arms:
        cols += ["draft_eager_verify_tok_s", "draft_eager_verify_speedup"]
    print_table(rows, cols)
    summary: dict[str, Any] = {"draft_cost": round(draft_cost, 3)}
    for r in rows:
        summary[f"bs{r['batch']}_speedup"] = round(r["draft_speedup"], 3)
        summary[f"bs{r['batch']}_accept_length"] = round(r["draft_accept_length"], 3)
        summary[f"bs{r['batch']}_unrelated_speedup"] = round(r["unrelated_speedup"], 3)
        summary[f"bs{r['batch']}_eagle_speedup"] = round(r["eagle_speedup"], 3)
        summary[f"bs{r['batch']}_eagle_accept_length"] = round(r["eagle_accept_length"], 3)
        summary[f"bs{r['batch']}_eagle3_random_speedup"] = round(r["eagle3_random_speedup"], 3)
        summary[f"bs{r['batch']}_eagle_tree_speedup"] = round(r["eagle_tree_speedup"], 3)
        summary[f"bs{r['batch']}_eagle_tree_accept_length"] = round(
            r["eagle_tree_accept_length"], 3
        )
        if "draft_eager_verify_speedup" in r:
            summary[f"bs{r['batch']}_eager_verify_speedup"] = round(
                r["draft_eager_verify_speedup"], 3
            )
    print(summary)
    print("wrote", write_result(args.name, rows, summary, config=vars(args)))


def _weights(path: str) -> int:
    return os.path.getsize(os.path.join(path, "model.safetensors"))


if __name__ == "__main__":
    main()
