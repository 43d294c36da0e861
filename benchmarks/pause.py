"""What a pause costs, by mode (SGLang's `/pause_generation`, vLLM's `/pause`;
engine/scheduler/pausing.py): the scheduler's work when the pause comes, and the time from the
resume until every paused request has its next token, with the tokens computed again for it.

    OMP_NUM_THREADS=1 python benchmarks/pause.py [--requests 8] [--prompt 256] \
        [--decoded 128] [--layers 4] [--reps 3]

Each rep and case: `--requests` requests of distinct random `--prompt`-token prompts (greedy,
ignore_eos) decode `--decoded` tokens, then the worker's pause work runs on the scheduler, as
a paused worker runs it between steps, and then the steps of the resume:

* keep: the requests are brought to rest (`settle`) and stay with their K/V;
* retract: `retract_all` (sluice's: what each computed goes into the prefix cache first);
* retract_released: the same with each request's K/V given back instead (as a retraction for
  memory does), the side-by-side peer of `retract`: its resume recomputes the generated
  tokens the prompt's cache entry does not hold;
* retract_flushed: `retract_all`, then the prefix cache emptied, as a weights update empties
  it: the resume computes prompt and output again;
* abort: every request aborted and ended at once (`end_aborted`): the pause's work only.

The table gives the medians over reps: `pause_ms`, `resume_ms` and its ratio to keep's, and
`recomputed` (tokens prefilled again by the resume); `same_next` counts the requests whose
next token after the resume is keep's. The engine runs with its CPU defaults (the overlap loop)
on the small preset's Llama with `--layers` layers.
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

CASES = ("keep", "retract", "retract_released", "retract_flushed", "abort")


def pause_work(sched: Any, case: str) -> None:
    """What the worker does to its scheduler when the pause in `case`'s mode comes."""
    if case == "abort":
        for req in list(sched.running_batch.reqs):
            sched.abort_request(req.rid, "paused")
        sched.end_aborted()
        return
    sched.settle()
    if case == "keep":
        return
    if case == "retract_released":  # each request's K/V given back, not cached
        sched._cache_computed = sched.pools.release_req
    try:
        sched.retract_all()
    finally:
        sched.__dict__.pop("_cache_computed", None)
    if case == "retract_flushed":
        assert sched.flush_cache(keep_waiting=True)


def one_case(engine: Any, case: str, prompts: list[list[int]], decoded: int) -> dict[str, Any]:
    sched = engine.scheduler
    assert not sched.has_work() and engine.flush_cache()
    params = engine._params({"max_new_tokens": decoded + 8, "temperature": 0.0,
                             "ignore_eos": True}, 1, {})[0]  # fmt: skip
    reqs = [sched.add_request(f"{case}-{i}", p, params) for i, p in enumerate(prompts)]
    while min(len(r.output_ids) for r in reqs) < decoded:
        sched.step()
    t = time.perf_counter()
    pause_work(sched, case)
    pause_s = time.perf_counter() - t
    sched.output.take_events()
    out: dict[str, Any] = {"pause_ms": 1e3 * pause_s}
    if case != "abort":
        want = [len(r.output_ids) + 1 for r in reqs]
        recomputed = 0
        t = time.perf_counter()
        while any(len(r.output_ids) < n for r, n in zip(reqs, want)):
            sched.step()
            batch = sched.last_batch
            if batch is not None and batch.forward_mode.is_extend():
                recomputed += sum(r.extend_input_len for r in batch.reqs)
        out |= {"resume_ms": 1e3 * (time.perf_counter() - t), "recomputed": recomputed,
                "next": [r.output_ids[n - 1] for r, n in zip(reqs, want)]}  # fmt: skip
        for req in reqs:
            sched.abort_request(req.rid)
    while sched.has_work():
        sched.step()
    sched.output.take_events()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decoded", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--name", default="pause")
    args = ap.parse_args()
    import torch

    from engine.engine import Engine

    torch.set_num_threads(1)
    rng = random.Random(0)
    per_req = args.prompt + args.decoded + 16
    reps = []
    with Engine(model_path=small_model(args.layers),
                max_total_tokens=2 * args.requests * per_req) as engine:  # fmt: skip
        vocab = engine.scheduler.model_runner.model_config.vocab_size

        def prompts() -> list[list[int]]:
            return [[rng.randrange(10, vocab) for _ in range(args.prompt)]
                    for _ in range(args.requests)]  # fmt: skip

        one_case(engine, "keep", prompts(), 4)  # warm-up
        for _ in range(args.reps):
            batch = prompts()  # (the same for every case: the cache is flushed in between)
            reps.append({case: one_case(engine, case, batch, args.decoded) for case in CASES})
    rows = []
    keep_resume = statistics.median(r["keep"]["resume_ms"] for r in reps)
    for case in CASES:
        row: dict[str, Any] = {
            "mode": case, "pause_ms": statistics.median(r[case]["pause_ms"] for r in reps),
        }  # fmt: skip
        if case != "abort":
            resume = statistics.median(r[case]["resume_ms"] for r in reps)
            row |= {
                "resume_ms": resume,
                "vs_keep": resume / keep_resume,
                "recomputed": reps[-1][case]["recomputed"],
                "same_next": sum(sum(a == b for a, b in zip(r[case]["next"], r["keep"]["next"]))
                                 for r in reps),  # fmt: skip
            }
        rows.append(row)
    print_table(rows, ["mode", "pause_ms", "resume_ms", "vs_keep", "recomputed", "same_next"])
    med = {row["mode"]: row for row in rows}
    summary = {
        "retract_resume_vs_keep": med["retract"]["vs_keep"],
        "retract_released_resume_vs_keep": med["retract_released"]["vs_keep"],
        "retract_flushed_resume_vs_keep": med["retract_flushed"]["vs_keep"],
        "retract_released_vs_retract_resume": (
            med["retract_released"]["resume_ms"] / med["retract"]["resume_ms"]
        ),
        "same_next_tokens": f"{min(r.get('same_next', 0) for r in rows[1:4])}/"
                            f"{args.requests * args.reps}",
    }
    print(summary)
    write_result(args.name, {"rows": rows, "reps": reps}, summary, args=vars(args))


if __name__ == "__main__":
    main()
