"""Scoring prompts (lm-evaluation-harness's loglikelihood work) on CPU: sluice's prompt
logprobs vs transformers, and vs a plain prefill of the same prompts, side by side.

    OMP_NUM_THREADS=1 python benchmarks/prompt_logprobs.py --model /tmp/bench-m2 [--reps 3]
    OMP_NUM_THREADS=1 python benchmarks/prompt_logprobs.py --model /tmp/sluice-bench-qwen2-152k \
        --num-prompts 16 --len 128 --result-name prompt_logprobs_152k

Each rep draws fresh random prompts (lengths uniform in [len/2, len]) and runs three ways
over them, in an order that alternates between reps:

* `prefill`: sluice, `max_new_tokens` 1 without logprobs: the same forward with the logits
  of each prompt's last token only (the floor);
* `score`: sluice, `max_new_tokens` 0, `logprob_start_len` 0, `top_logprobs_num` 1: every
  prompt token's logprob and top candidate, what `echo` with `logprobs=1` asks;
* `ranked`: `score` plus each prompt token's rank (`return_prompt_ranks`), what vLLM's
  `prompt_logprobs=1` asks: one more pass over every scored row's logits;
* `hf`: transformers, batches of `--hf-batch` right-padded prompts through one forward each,
  log_softmax, the prompt tokens' logprobs and the top-1 (lm-eval's HF backend does this).

sluice's and transformers' logprobs are compared (max |difference|), so both sides give the
same answer. Reported: prompt tokens per second of each way, and as summary the medians
over reps of score/prefill (what scoring costs over a prefill), score/hf and ranked/score
(what ranks cost; it grows with the vocabulary, so try a large-vocabulary model too). The
engine runs with its CPU defaults (the overlap scheduler's device process: two processes), one
intra-op thread each, and transformers with one thread.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_result  # noqa: E402

WAYS = ("prefill", "score", "ranked", "hf")


def prompts_for(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(10, vocab) for _ in range(rng.randint(length // 2, length))]
        for _ in range(n)
    ]


def run_sluice(engine: Any, prompts: list[list[int]], way: str) -> tuple[float, list]:
    score = way != "prefill"
    if score:
        params = {"max_new_tokens": 0, "logprob_start_len": 0, "return_logprob": True,
                  "top_logprobs_num": 1, "return_prompt_ranks": way == "ranked"}  # fmt: skip
    else:
        params = {"max_new_tokens": 1, "temperature": 0.0}
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    assert engine.flush_cache()  # the next rep's prompts find nothing cached
    if not score:
        return seconds, []
    return seconds, [[lp for lp, *_ in o["meta_info"]["input_token_logprobs"][1:]] for o in outs]


@torch.inference_mode()
def run_hf(model: Any, prompts: list[list[int]], batch: int) -> tuple[float, list]:
    start = time.perf_counter()
    out: list[list[float]] = []
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(map(len, group))
        ids = torch.zeros(len(group), width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(group):
            ids[row, : len(p)] = torch.tensor(p)
            mask[row, : len(p)] = 1
        logprobs = torch.log_softmax(model(ids, attention_mask=mask).logits[:, :-1].float(), -1)
        chosen = logprobs.gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
        logprobs.topk(1, dim=-1)  # the top candidate, as sluice computes it
        out += [chosen[row, : len(p) - 1].tolist() for row, p in enumerate(group)]
    return time.perf_counter() - start, out


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--len", type=int, default=256, help="longest prompt (tokens)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--result-name", default="prompt_logprobs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine import Engine

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    engine = Engine(model_path=args.model)
    rows: list[dict[str, Any]] = []
    try:
        run_sluice(engine, prompts_for(vocab, 4, 32, seed=-1), "ranked")  # warm up
        for rep in range(args.reps):
            prompts = prompts_for(vocab, args.num_prompts, args.len, seed=rep)
            tokens = sum(map(len, prompts))
            order = WAYS if rep % 2 == 0 else WAYS[::-1]
            got: dict[str, tuple[float, list]] = {}
            for way in order:
                if way == "hf":
                    got[way] = run_hf(model, prompts, args.hf_batch)
                else:
                    got[way] = run_sluice(engine, prompts, way)
            diff = max(max_abs_diff(got[w][1], got["hf"][1]) for w in ("score", "ranked"))
            for way in WAYS:
                seconds = got[way][0]
                rows.append({"rep": rep, "way": way, "prompt_tokens": tokens,
                             "seconds": seconds, "prompt_tok_s": tokens / seconds,
                             "max_abs_diff_vs_hf": diff if way == "score" else None})  # fmt: skip
    finally:
        engine.shutdown()
    print_table(rows, ["rep", "way", "prompt_tokens", "seconds", "prompt_tok_s",
                       "max_abs_diff_vs_hf"])  # fmt: skip

    def ratio(a: str, b: str) -> float:
        per_rep = [
            next(r for r in rows if r["rep"] == rep and r["way"] == a)["prompt_tok_s"]
            / next(r for r in rows if r["rep"] == rep and r["way"] == b)["prompt_tok_s"]
            for rep in range(args.reps)
        ]
        return statistics.median(per_rep)

    summary = {
        "score_vs_prefill": ratio("score", "prefill"),
        "score_vs_hf": ratio("score", "hf"),
        "ranked_vs_score": ratio("ranked", "score"),
        "max_abs_diff_vs_hf": max(r["max_abs_diff_vs_hf"] or 0.0 for r in rows),
    }
    print(summary)
    path = write_result(args.result_name, rows, summary, model=args.model, args=vars(args))
    print("wrote", path)


if __name__ == "__main__":
    main()
