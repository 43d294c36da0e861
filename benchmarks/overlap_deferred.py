"""What sampling that reads the output so far costs the overlap scheduler (CPU, emulated device).

    python benchmarks/overlap_deferred.py [--quick] [--reps 5]

Penalties (frequency / presence / repetition), a grammar, and vLLM's bad_words of two or more
tokens make a step's sampling depend on the token sampled the step before, which the overlap
loop has not processed when it launches the step. For a grammar sluice defers that batch's
sampling: the forward is launched at once, the sampling once the batch before is processed (its
`SamplingBatchInfo` built from the complete history). Penalties are counted on the device
instead, as SGLang does, and bad words are matched there against the last tokens kept per
request (engine/sampling/penalty_slots.py; both were deferred before). This measures what each
costs the overlap loop, on the emulated accelerator of benchmarks/overlap.py (the null runner
whose forward waits T_f = T_c without using the CPU, as a GPU leaves the host free): every
request greedy, `ignore_eos`, with

* "device-sleep": nothing that needs the history (the overlap loop's best case);
* "device-sleep+penalty": frequency and presence penalties (the device's counts; the plain
  loop counts the history);
* "device-sleep+badwords": three bad words of 2-3 tokens, one whose prefix matches every step
  (matched on the device; the ban never changes the greedy token).

Each case runs the plain loop, the overlap loop with the device process and with the forward
thread, alternated, medians (benchmarks/overlap.py's `compare`).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_result  # noqa: E402
from benchmarks.overlap import COLUMNS, compare, parallelism_probe  # noqa: E402

CASES = ("device-sleep", "device-sleep+penalty", "device-sleep+badwords")
NOTES = [
    "T_c is each case's own plain-loop step on the null runner, so it includes building the "
    "penalty or ban tensors from the history; the emulated forward then waits T_f = T_c.",
    "deferred_vs_base: a case's overlap_on_vs_off over the base case's at the same batch. "
    "Neither case is deferred any more (penalty counts and bad words' last tokens are kept on "
    "the device); their plain loop still counts and matches the history on the host, so above "
    "1 is the overlap loop's lighter host work, not a deferral's loss.",
    "overlap_step_vs_base: a case's overlap-loop step over the base case's at the same batch "
    "(what that sampling adds to the overlap loop's step; 1 = nothing).",
    "parallelism_probe.speedup: what two threads of GIL-free matmuls got at the time "
    "(2.0 = two free cores); the device process needs a second core to overlap.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    probe = parallelism_probe()
    shapes = [(64, 32)] if args.quick else [(64, 256), (256, 192)]
    rows = []
    for bs, max_new in shapes:
        for case in CASES:
            rows.append(compare(case, bs, max_new, 1 if args.quick else args.reps))
            print_table(rows[-1:], COLUMNS)
    base = {r["batch"]: r for r in rows if r["case"] == CASES[0]}
    for r in rows:
        r["deferred_vs_base"] = r["throughput_on_vs_off"] / base[r["batch"]]["throughput_on_vs_off"]
        r["overlap_step_vs_base"] = r["overlap_step_ms"] / base[r["batch"]]["overlap_step_ms"]
    print_table(rows, [*COLUMNS, "deferred_vs_base", "overlap_step_vs_base"])
    summary = {
        f"{r['case']}/bs{r['batch']}": {
            "on_vs_off": r["throughput_on_vs_off"],
            "thread_on_vs_off": r["thread_on_vs_off"],
            "overlap_step_vs_max_part": r["overlap_step_vs_max_part"],
            "deferred_vs_base": r["deferred_vs_base"],
            "overlap_step_vs_base": r["overlap_step_vs_base"],
        }
        for r in rows
    }
    summary["parallelism_probe_speedup"] = [probe["speedup"], parallelism_probe()["speedup"]]
    name = "overlap_deferred_quick" if args.quick else "overlap_deferred"
    print(write_result(name, {"models": rows}, summary, notes=NOTES))


if __name__ == "__main__":
    main()
