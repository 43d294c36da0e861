"""What a JSON schema costs a batch: constrained vs free decoding, with the overlap scheduler
on and off, side by side on the same engine build and prompts (CPU).

    OMP_NUM_THREADS=1 python benchmarks/structured_output.py --model /tmp/bench-m2 [--reps 3]

Every request asks for exactly `--out` tokens, so the ways do the same work: `free` requests
ignore EOS; `json` requests follow a schema no document of `--out` tokens completes (an array
of at least 100 objects with an integer, a string and an enum list), so the grammar never
lets them stop early either. Sampling at temperature 0.7 with a seed per request. Ways:

* `free` / `json` with the overlap scheduler (the default) and with the plain loop
  (`disable_overlap_schedule`). A batch with a grammar request is sampled after the previous
  batch is processed (its mask needs the last token), so overlap keeps the forward's
  overlap but not the sampling's.

Also measured, outside the engine: compiling the schema (first time and cached) and filling
the token masks of a batch of matchers mid-document (`vocab_mask`), per row.

Reported: output tokens/s per way and rep; summary medians over reps of json/free (each
loop) and overlap/plain (each kind). The vocabulary of the CPU model is small (4096 tokens):
mask filling scales with the vocabulary, see the note in the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_result  # noqa: E402

SCHEMA = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        },
        "required": ["id", "name", "tags"],
    },
}
LOOPS = {"overlap": {}, "plain": {"disable_overlap_schedule": True}}
KINDS = ("free", "json")


def params_for(kind: str, n: int, out: int, rep: int) -> list[dict[str, Any]]:
    base = {"max_new_tokens": out, "temperature": 0.7}
    if kind == "free":
        base["ignore_eos"] = True
    else:
        base["json_schema"] = json.dumps(SCHEMA)
    return [{**base, "sampling_seed": rep * 10_000 + i} for i in range(n)]


def run(engine: Any, prompts: list[list[int]], params: list[dict], out: int) -> float:
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    assert engine.flush_cache()
    lengths = {o["meta_info"]["completion_tokens"] for o in outs}
    assert lengths == {out}, f"every request should give {out} tokens, got {lengths}"
    return seconds


def mask_fill_us(engine: Any, rows: int, steps: int) -> dict[str, float]:
    """Compile the schema (first / cached) and fill `rows` matchers' masks mid-document."""
    from engine.sampling.sampling_params import SamplingParams

    backend = engine.scheduler.grammar_queue.backend()
    params = SamplingParams(json_schema=json.dumps({**SCHEMA, "minItems": 101}))
    t0 = time.perf_counter()
    grammars = [backend.grammar(params)]
    first_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    grammars += [backend.grammar(params) for _ in range(rows - 1)]
    cached_ms = (time.perf_counter() - t0) * 1e3 / (rows - 1)
    pieces = engine.tokenizer.get_vocab()  # one token per character (or its byte token)
    doc = [pieces.get(ch, pieces.get(f"<0x{ord(ch):02X}>")) for ch in '[{"id":12,"name":"ab']
    for g in grammars:
        for t in doc:
            assert g.accept(t), "the document prefix should follow the schema"
    t0 = time.perf_counter()
    for _ in range(steps):
        backend.vocab_mask(grammars)
    fill_us = (time.perf_counter() - t0) * 1e6 / steps / rows
    return {"compile_first_ms": first_ms, "compile_cached_ms": cached_ms,
            "mask_fill_us_per_row": fill_us, "vocab_size": backend.vocab_size}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--len", type=int, default=64, help="prompt tokens")
    ap.add_argument("--out", type=int, default=128, help="output tokens per request")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoConfig

    from engine import Engine

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    engines = {loop: Engine(model_path=args.model, random_seed=0, **kw)
               for loop, kw in LOOPS.items()}  # fmt: skip
    rows: list[dict[str, Any]] = []
    try:
        warm = [[11, 12, 13]] * 4
        for engine in engines.values():
            for kind in KINDS:
                run(engine, warm, params_for(kind, 4, 8, -1), 8)
        ways = [(loop, kind) for loop in LOOPS for kind in KINDS]
        for rep in range(args.reps):
            rng = random.Random(rep)
            prompts = [[rng.randrange(10, vocab) for _ in range(args.len)]
                       for _ in range(args.num_prompts)]  # fmt: skip
            for loop, kind in ways if rep % 2 == 0 else ways[::-1]:
                params = params_for(kind, args.num_prompts, args.out, rep)
                seconds = run(engines[loop], prompts, params, args.out)
                tokens = args.num_prompts * args.out
                rows.append({"rep": rep, "loop": loop, "kind": kind, "seconds": seconds,
                             "output_tok_s": tokens / seconds})  # fmt: skip
        masks = mask_fill_us(engines["plain"], rows=args.num_prompts, steps=50)
    finally:
        for engine in engines.values():
            engine.shutdown()
    print_table(rows, ["rep", "loop", "kind", "seconds", "output_tok_s"])

    def tok_s(rep: int, loop: str, kind: str) -> float:
        return next(r["output_tok_s"] for r in rows
                    if (r["rep"], r["loop"], r["kind"]) == (rep, loop, kind))  # fmt: skip

    def median(f: Any) -> float:
        return statistics.median(f(rep) for rep in range(args.reps))

    summary = {
        "json_vs_free_overlap": median(lambda r: tok_s(r, "overlap", "json")
                                       / tok_s(r, "overlap", "free")),
        "json_vs_free_plain": median(lambda r: tok_s(r, "plain", "json")
                                     / tok_s(r, "plain", "free")),
        "overlap_vs_plain_free": median(lambda r: tok_s(r, "overlap", "free")
                                        / tok_s(r, "plain", "free")),
        "overlap_vs_plain_json": median(lambda r: tok_s(r, "overlap", "json")
                                        / tok_s(r, "plain", "json")),
        **masks,
        "note": "mask filling scales with the vocabulary; this model's is small",
    }  # fmt: skip
    print(json.dumps(summary, indent=1))
    from importlib.metadata import version

    path = write_result("structured_output", rows, summary, model=args.model, args=vars(args),
                        xgrammar=version("xgrammar"))  # fmt: skip
    print("wrote", path)


if __name__ == "__main__":
    main()
