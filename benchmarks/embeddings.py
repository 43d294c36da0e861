"""Embedding and reranking throughput: sluice's pooling engine against transformers, side
by side.

    python benchmarks/embeddings.py [--layers 4] [--inputs 64] [--threads 2]
        [--task rerank] [--device cuda --dtype bfloat16 --name gpu_embeddings]

A random Llama of the `small` preset's shape (hidden 1024, GQA 16/4, intermediate 2816, vocab
32000) with `--layers` layers, served as an embedding model (last-token pooling, normalised:
the pooling of decoder embedding models such as Qwen3-Embedding). `--inputs` prompts of random
tokens, lengths uniform in [--min-len, --max-len]. Arms, their timed runs interleaved,
`--repeat` rounds (the fastest run counts):

* sluice: `Engine(is_embedding=True, schedule_policy="lpm").encode(input_ids=...)`, the
  prefix cache flushed first; its scheduler packs the prompts into extend batches of up to
  `max_prefill_tokens` tokens (lpm holds back prompts that share a prefix with one in the
  same batch, so that they hit the cache a step later; without a cache it is fcfs);
* transformers: the same weights as `AutoModel`, prompts sorted by length (as
  sentence-transformers does) in batches of `--hf-batch`, right-padded, attention-masked;
  the last real token's state, normalised.

Two workloads: "distinct" prompts, and "shared prefix" prompts that all begin with the same
`--prefix` tokens (an instruction, as Qwen3-Embedding and e5-mistral queries do), where
sluice's radix cache computes the prefix once; that workload adds a sluice arm with the cache
off. The run fails unless every arm's embeddings agree with transformers' (max |diff|
< 1e-4 in float32). Reported: inputs/s and prompt tokens/s per arm, and the ratios.

`--profile`: afterwards, one more sluice run of the distinct workload under cProfile, its top
functions written to results/NAME_profile.txt (where a GPU run's host time goes: a small
model's extend batches are launch- and scheduler-bound there).

`--task rerank` (results: rerank.json) does the same for a cross-encoder: the model is the
same body with a one-label `score` head (LlamaForSequenceClassification), each input a
(query, document) pair as one prompt, the query first, `--queries` queries of `--prefix`
tokens with `--inputs` / `--queries` documents each (what `/v1/rerank` sends); transformers
runs `AutoModelForSequenceClassification` on the same batches. The arms' logits must agree.
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
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import parse_arm_args, print_table, small_model, write_result  # noqa: E402


class SluiceArm:
    def __init__(self, path: str, args: Any, **kw: Any) -> None:
        from engine.engine import Engine

        self.engine = Engine(
            model_path=path, is_embedding=True, skip_tokenizer_init=True, device=args.device,
            dtype=args.dtype, max_total_tokens=args.inputs * (args.prefix + args.max_len) + 4096,
            schedule_policy="lpm", **kw,
        )  # fmt: skip

    def run(self, prompts: list[list[int]]) -> torch.Tensor:
        self.engine.flush_cache()
        outs = self.engine.encode(input_ids=prompts)
        self.cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
        return torch.tensor([o["embedding"] for o in outs])


class TransformersArm:
    def __init__(self, path: str, args: Any) -> None:
        from transformers import AutoModel, AutoModelForSequenceClassification

        dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
        auto = AutoModelForSequenceClassification if args.task == "rerank" else AutoModel
        self.model = auto.from_pretrained(path, dtype=dtype).to(args.device).eval()
        self.device, self.batch = args.device, args.hf_batch
        self.classifier = args.task == "rerank"
        self.pad = self.model.config.pad_token_id or 0

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The last token that is not padding (a decoder embedding model's pooling)."""
        return hidden[torch.arange(len(hidden)), mask.sum(1).to(self.device) - 1]

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], types: list[list[int]] | None = None) -> torch.Tensor:
        """Pooled, normalised states (or a classifier's logits) of `prompts`, sorted by length
        and padded in batches; `types`: their token types (BERT pairs)."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        width = self.model.config.num_labels if self.classifier else self.model.config.hidden_size
        out = torch.empty(len(prompts), width)
        for lo in range(0, len(order), self.batch):
            rows = order[lo : lo + self.batch]
            width = max(len(prompts[i]) for i in rows)
            ids = torch.full((len(rows), width), self.pad, dtype=torch.int64)
            mask = torch.zeros(len(rows), width, dtype=torch.int64)
            kinds = torch.zeros(len(rows), width, dtype=torch.int64)
            for j, i in enumerate(rows):
                ids[j, : len(prompts[i])] = torch.tensor(prompts[i])
                mask[j, : len(prompts[i])] = 1
                if types is not None:
                    kinds[j, : len(prompts[i])] = torch.tensor(types[i])
            extra = {} if types is None else {"token_type_ids": kinds.to(self.device)}
            result = self.model(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **extra
            )
            if self.classifier:  # (its own pooling)
                out[rows] = result.logits.float().cpu()
                continue
            pooled = self.pool(result.last_hidden_state, mask)
            out[rows] = F.normalize(pooled.float(), dim=-1).cpu()
        return out


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 30000) for _ in range(n)]  # (0-3: special, 3 the padding)


def _prompts(args: Any, rng: random.Random, prefix: list[int], n: int = 0) -> list[list[int]]:
    return [prefix + _tokens(rng, rng.randint(args.min_len, args.max_len))
            for _ in range(n or args.inputs)]  # fmt: skip


def _workloads(args: Any, rng: random.Random) -> dict[str, list[list[int]]]:
    if args.task == "rerank":
        docs = args.inputs // args.queries
        pairs = [p for _ in range(args.queries)
                 for p in _prompts(args, rng, _tokens(rng, args.prefix), docs)]  # fmt: skip
        return {"query x documents": pairs}
    return {"distinct": _prompts(args, rng, []),
            "shared prefix": _prompts(args, rng, _tokens(rng, args.prefix))}  # fmt: skip


def _timed(arm: Any, prompts: list[list[int]]) -> tuple[float, torch.Tensor]:
    if hasattr(arm, "engine") and arm.engine.args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = arm.run(prompts)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def _profile(arm: SluiceArm, prompts: list[list[int]], name: str) -> None:
    import cProfile

    from benchmarks.common import write_profile

    prof = cProfile.Profile()
    prof.enable()
    wall, _ = _timed(arm, prompts)
    prof.disable()
    print(f"profiled run: {wall:.3f}s ({len(prompts) / wall:.1f} inputs/s under cProfile)")
    write_profile(prof, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=96, help="shared prefix tokens")
    ap.add_argument("--hf-batch", type=int, default=32, help="transformers' batch size")
    ap.add_argument("--task", choices=("embed", "rerank"), default="embed")
    ap.add_argument("--queries", type=int, default=4, help="rerank: queries (--inputs split)")
    ap.add_argument("--profile", action="store_true",
                    help="profile one more sluice run (results/NAME_profile.txt)")
    args = parse_arm_args(ap, "embeddings")
    if args.task == "rerank" and args.name == "embeddings":
        args.name = "rerank"
    path = small_model(args.layers, args.seed, num_labels=1 if args.task == "rerank" else None)
    workloads = _workloads(args, random.Random(args.seed))
    hf = TransformersArm(path, args)
    sluice = SluiceArm(path, args)
    no_cache = SluiceArm(path, args, disable_radix_cache=True)
    tol = 1e-4 if args.dtype in ("auto", "float32") else 2e-2
    rows = []
    for name, prompts in workloads.items():
        arms = {"transformers": hf, "sluice": sluice}
        if name != "distinct":
            arms["sluice, cache off"] = no_cache
        for arm in arms.values():  # warm-up
            arm.run(prompts[:8])
        best: dict[str, tuple[float, torch.Tensor]] = {}
        for _ in range(args.repeat):
            for label, arm in arms.items():
                wall, out = _timed(arm, prompts)
                if label not in best or wall < best[label][0]:
                    best[label] = (wall, out)
        tokens = sum(map(len, prompts))
        hf_wall, want = best["transformers"]
        for label, (wall, out) in best.items():
            diff = float((out - want).abs().max())
            if diff > tol:
                raise SystemExit(f"{name}: {label}'s embeddings are {diff} from transformers'")
            row = {"workload": name, "arm": label, "inputs_s": len(prompts) / wall,
                   "tokens_s": tokens / wall, "vs_transformers": hf_wall / wall,
                   "max_abs_diff": diff,
                   "cached_tokens": getattr(arms[label], "cached", 0)}  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    if args.profile:
        _profile(sluice, next(iter(workloads.values())), f"{args.name}_profile")
    sluice.engine.shutdown()
    no_cache.engine.shutdown()
    print_table(rows, ["workload", "arm", "inputs_s", "tokens_s", "vs_transformers",
                       "max_abs_diff", "cached_tokens"])  # fmt: skip
    summary = {f"{r['workload']}: {r['arm']}": round(r["vs_transformers"], 3) for r in rows
               if r["arm"] != "transformers"}  # fmt: skip
    print(summary)
    print("wrote", write_result(args.name, rows, summary, config=vars(args)))


if __name__ == "__main__":
    main()
