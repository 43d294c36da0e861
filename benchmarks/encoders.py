"""BERT-style encoders (embedding models, cross-encoders): sluice's pooling engine against
transformers, side by side.

    python benchmarks/encoders.py [--shape minilm|base] [--task embed|rerank] [--inputs 128]
        [--threads 2] [--device cuda --dtype bfloat16 --name gpu_encoders]

A random BERT of all-MiniLM-L6-v2's shape (hidden 384, 6 layers, 12 heads, intermediate 1536,
vocab 30522; `--shape base`: bert-base's / bge-base's, 768 and 12 layers), served as an
embedding model ([CLS] pooling, normalised, as bge's sentence-transformers config says) or,
with `--task rerank`, as a one-label `BertForSequenceClassification` cross-encoder scoring
(query, document) pairs ([CLS] q [SEP] d [SEP], the document's tokens of type 1, what
ms-marco-MiniLM rerankers run). `--inputs` prompts of random tokens, lengths uniform in
[--min-len, --max-len]. Arms, their timed runs interleaved, `--repeat` rounds (the fastest
run counts):

* sluice: `Engine(model_path=...).encode(input_ids=..., token_type_ids=...)`: its scheduler
  packs whole prompts into extend batches of up to `max_prefill_tokens` tokens (one arm per
  value of `--max-prefill-tokens`: the default 16384, and 4096); the linear layers run on
  the packed tokens, attention per prompt (CPU) or padded per batch (GPU);
* transformers: the same weights (`AutoModel`, `AutoModelForSequenceClassification`), the
  prompts sorted by length (as sentence-transformers does) in batches of `--hf-batch`,
  right-padded and attention-masked.

The run fails unless sluice's outputs agree with transformers' (max |diff| < 1e-4 in float32).
Reported: inputs/s and tokens/s per arm, and sluice's ratio to transformers.
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

from benchmarks import embeddings  # noqa: E402
from benchmarks.common import parse_arm_args, print_table, write_result  # noqa: E402

SHAPES = {  # hidden, layers, heads, intermediate
    "minilm": (384, 6, 12, 1536),
    "base": (768, 12, 12, 3072),
}
VOCAB, CLS, SEP, PAD = 30522, 101, 102, 0  # (bert-base-uncased's ids)


def encoder_model(shape: str, rerank: bool, seed: int) -> str:
    """A random BERT of `shape` saved once in the temp folder (no tokenizer: the arms take
    token ids)."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    kind = "rerank" if rerank else "embed"
    path = os.path.join(tempfile.gettempdir(), f"sluice-bench-bert-{shape}-{kind}-s{seed}")
    if not os.path.exists(os.path.join(path, "config.json")):
        hidden, layers, heads, inter = SHAPES[shape]
        config = BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, intermediate_size=inter, num_labels=1,
                            pad_token_id=PAD)  # fmt: skip
        torch.manual_seed(seed)
        model = (BertForSequenceClassification if rerank else BertModel)(config)
        model.save_pretrained(path)
    return path


class SluiceArm:
    def __init__(self, path: str, args: Any, max_prefill_tokens: int) -> None:
        from engine.engine import Engine

        # a KV pool for the whole workload: the arms' engines live side by side, and on CUDA
        # the default (a fraction of free memory) leaves the second one nothing
        pool = args.inputs * args.max_len + max_prefill_tokens
        self.engine = Engine(model_path=path, skip_tokenizer_init=True, device=args.device,
                             dtype=args.dtype, max_prefill_tokens=max_prefill_tokens,
                             max_total_tokens=pool)  # fmt: skip

    def run(self, prompts: list[list[int]], types: list[list[int]] | None) -> torch.Tensor:
        outs = self.engine.encode(input_ids=prompts, token_type_ids=types)
        return torch.tensor([o["embedding"] for o in outs])


class TransformersArm(embeddings.TransformersArm):
    """The embeddings benchmark's transformers arm (its model and batching), pooling the
    [CLS] state and passing token types."""

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return hidden[:, 0]


def workload(args: Any, rng: random.Random) -> tuple[list[list[int]], list[list[int]] | None]:
    def words(n: int) -> list[int]:
        return [rng.randrange(1000, VOCAB) for _ in range(n)]

    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.inputs)]
    if args.task == "embed":
        return [[CLS, *words(n - 2), SEP] for n in lengths], None
    queries = [words(rng.randint(8, 24)) for _ in range(args.queries)]
    prompts, types = [], []
    for i, n in enumerate(lengths):
        q = queries[i % args.queries]
        doc = words(max(n - len(q) - 3, 1))
        prompts.append([CLS, *q, SEP, *doc, SEP])
        types.append([0] * (len(q) + 2) + [1] * (len(doc) + 1))
    return prompts, types


def _timed(arm: Any, prompts: list[list[int]], types: Any) -> tuple[float, torch.Tensor]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = arm.run(prompts, types)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="minilm")
    ap.add_argument("--task", choices=("embed", "rerank"), default="embed")
    ap.add_argument("--inputs", type=int, default=128)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--queries", type=int, default=4, help="rerank: queries (--inputs split)")
    ap.add_argument("--hf-batch", type=int, default=32, help="transformers' batch size")
    ap.add_argument("--max-prefill-tokens", type=int, nargs="+", default=[16384, 4096],
                    help="sluice arms: tokens per batch")  # fmt: skip
    args = parse_arm_args(ap, "encoders")
    if args.name == "encoders":
        args.name = f"encoders_{args.shape}_{args.task}"
    path = encoder_model(args.shape, args.task == "rerank", args.seed)
    prompts, types = workload(args, random.Random(args.seed))
    arms: dict[str, Any] = {"transformers": TransformersArm(path, args)}
    for tokens in args.max_prefill_tokens:
        arms[f"sluice, max_prefill_tokens {tokens}"] = SluiceArm(path, args, tokens)
    for arm in arms.values():  # warm-up
        arm.run(prompts[:8], None if types is None else types[:8])
    best: dict[str, tuple[float, torch.Tensor]] = {}
    for _ in range(args.repeat):
        for label, arm in arms.items():
            wall, out = _timed(arm, prompts, types)
            if label not in best or wall < best[label][0]:
                best[label] = (wall, out)
    tol = 1e-4 if args.dtype in ("auto", "float32") else 2e-2
    tokens = sum(map(len, prompts))
    hf_wall, want = best["transformers"]
    rows = []
    for label, (wall, out) in best.items():
        diff = float((out - want).abs().max())
        if diff > tol:
            raise SystemExit(f"{label}'s outputs are {diff} from transformers'")
        rows.append({"task": args.task, "shape": args.shape, "arm": label,
                     "inputs_s": len(prompts) / wall, "tokens_s": tokens / wall,
                     "vs_transformers": hf_wall / wall, "max_abs_diff": diff})  # fmt: skip
    for arm in arms.values():
        if isinstance(arm, SluiceArm):
            arm.engine.shutdown()
    print_table(rows, ["task", "shape", "arm", "inputs_s", "tokens_s", "vs_transformers",
                       "max_abs_diff"])  # fmt: skip
    summary = {
        f"{args.shape} {args.task}: {r['arm']} vs transformers": round(r["vs_transformers"], 3)
        for r in rows
        if r["arm"] != "transformers"
    }
    print(summary)
    print("wrote", write_result(args.name, rows, summary, config=vars(args)))


if __name__ == "__main__":
    main()
