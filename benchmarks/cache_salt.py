"""Prefix-cache isolation by cache salt (vLLM's `cache_salt`, SGLang's `extra_key`), as a
client sees it: the time to the first token of a long prompt that another tenant sent
before, against a cold one and against the tenant's own repeat.

    OMP_NUM_THREADS=1 python benchmarks/cache_salt.py [--len 1024] [--reps 5] [--layers 4]

Each rep takes a fresh random prompt of `--len` tokens and, with the prefix cache flushed,
asks for one token (`max_new_tokens` 1, greedy) in this order: tenant A (`cold`: nothing
cached), A again (`own`: A's prefix reused), tenant B (`other_salt`), no salt (`unsalted`),
no salt again (`own_unsalted`). What isolation promises: `other_salt` and `unsalted` find
nothing cached and take as long as `cold` (ratio ~1: no fast first token tells B, or an
unsalted client, that A sent this prompt), while `own` keeps the cache's gain (ratio << 1);
`own` against `own_unsalted` is what a salt costs on a hit (the key's per-token namespace).
Every request's `cached_tokens` is recorded and checked. The engine runs with its CPU
defaults on the small preset's Llama with `--layers` layers.
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

ORDER = (("cold", "tenant-a"), ("own", "tenant-a"), ("other_salt", "tenant-b"),
         ("unsalted", None), ("own_unsalted", None))  # fmt: skip


def one_rep(engine: Any, prompt: list[int]) -> dict[str, tuple[float, int]]:
    assert engine.flush_cache()
    out = {}
    for name, salt in ORDER:
        t = time.perf_counter()
        res = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1,
                              "temperature": 0.0}, extra_key=salt)  # fmt: skip
        out[name] = (time.perf_counter() - t, res["meta_info"]["cached_tokens"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--name", default="cache_salt")
    args = ap.parse_args()
    import torch

    from engine.engine import Engine

    torch.set_num_threads(1)
    rng = random.Random(0)
    reps = []
    with Engine(model_path=small_model(args.layers), max_total_tokens=4 * args.len) as engine:
        vocab = engine.scheduler.model_runner.model_config.vocab_size
        one_rep(engine, [rng.randrange(10, vocab) for _ in range(args.len)])  # warm-up
        for _ in range(args.reps):
            reps.append(one_rep(engine, [rng.randrange(10, vocab) for _ in range(args.len)]))
    for rep in reps:  # the promise, checked on every rep
        assert rep["cold"][1] == rep["other_salt"][1] == rep["unsalted"][1] == 0, rep
        assert rep["own"][1] == rep["own_unsalted"][1] == args.len - 1, rep
    med = {name: statistics.median(r[name][0] for r in reps) for name, _ in ORDER}
    rows = [{"request": name, "salt": salt or "", "ttft_ms": 1e3 * med[name],
             "vs_cold": med[name] / med["cold"], "cached_tokens": reps[-1][name][1]}
            for name, salt in ORDER]  # fmt: skip
    print_table(rows, ["request", "salt", "ttft_ms", "vs_cold", "cached_tokens"])
    summary = {
        "other_salt_vs_cold": med["other_salt"] / med["cold"],
        "unsalted_vs_cold": med["unsalted"] / med["cold"],
        "own_vs_cold": med["own"] / med["cold"],
        "own_salted_vs_own_unsalted": med["own"] / med["own_unsalted"],
    }
    print(summary)
    write_result(args.name, {"rows": rows, "reps": reps}, summary, args=vars(args))


if __name__ == "__main__":
    main()
