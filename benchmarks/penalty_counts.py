"""What penalties cost a decode step: counted from the history vs kept on the device.

    python benchmarks/penalty_counts.py [--quick] [--reps 15]

B requests, each with frequency, presence and repetition penalties, a prompt of P tokens and
L tokens of output so far, over a vocabulary of V. One decode step's sampling, two ways:

* "history" (the plain scheduler; the overlap scheduler's deferred sampling before the
  device counts): `SamplingBatchInfo.from_params(output_ids=..., input_ids=...)` counts
  every row's prompt and output on the host side and copies B * (P + L) ids to the device,
  each step; then the `Sampler`.
* "device" (the overlap scheduler now, engine/sampling/penalty_slots.py): the plan of the
  batch's rows (`PenaltySlots.plan`), the info (`SamplingInfoCache.get`: the same as the step
  before, reused), and the `Sampler`, which gathers the rows' counts, applies them, and adds
  the step's tokens.

Both produce the same tokens (checked every step). The "device" is this CPU, so both totals
include the [B, V] work that a GPU would do; what grows with L is the history path's own
counting. Two times per way, minima over the steps (noise on this shared machine only adds):
"step", the info and the sampling; "info", the host's part alone (the history way's counting
and copies, the device way's plan and cached info), which is what the scheduler's thread
spends on it. Ratios are history / device (above 1: the device counts are cheaper).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_result  # noqa: E402
from engine.sampling.penalty_slots import PenaltySlots  # noqa: E402
from engine.sampling.sampler import Sampler  # noqa: E402
from engine.sampling.sampling_batch_info import SamplingBatchInfo, SamplingInfoCache  # noqa: E402
from engine.sampling.sampling_params import SamplingParams  # noqa: E402

VOCAB = 32000
PROMPT = 256
COLUMNS = ["batch", "output_len", "step_history_ms", "step_device_ms", "step_history_vs_device",
           "info_history_ms", "info_device_ms", "info_history_vs_device"]


@dataclass(eq=False)
class _Req:  # what PenaltySlots reads of a request
    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    num_retractions: int = 0
    finished: bool = False


def _device_way(reqs, plist, logits, slots, cache, sampler) -> tuple:  # noqa: ANN001
    t0 = time.perf_counter()
    info = cache.get(plist, VOCAB, "cpu", slots.plan(reqs, None))
    t1 = time.perf_counter()
    return t1 - t0, sampler(logits, info).next_token_ids


def _history_way(reqs, plist, logits, *_) -> tuple:  # noqa: ANN001
    t0 = time.perf_counter()
    info = SamplingBatchInfo.from_params(
        plist, VOCAB, "cpu", output_ids=[r.output_ids for r in reqs],
        input_ids=[r.origin_input_ids for r in reqs],
    )  # fmt: skip
    t1 = time.perf_counter()
    return t1 - t0, Sampler(seed=0)(logits, info).next_token_ids


def measure(batch: int, output_len: int, reps: int) -> dict:
    rng = random.Random(batch * 7919 + output_len)
    params = SamplingParams(temperature=0.0, frequency_penalty=0.3, presence_penalty=0.2,
                            repetition_penalty=1.1)  # fmt: skip
    ids = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    reqs = [_Req(params, ids(PROMPT), ids(output_len)) for _ in range(batch)]
    slots, cache, device_sampler = PenaltySlots(), SamplingInfoCache(), Sampler(seed=0)
    for r in reqs:
        slots.add(r)
    plist = [r.sampling_params for r in reqs]
    gen = torch.Generator().manual_seed(batch + output_len)
    step_s: dict[str, list[float]] = {"history": [], "device": []}
    info_s: dict[str, list[float]] = {"history": [], "device": []}
    for step in range(reps + 2):  # the first step resets every row: not timed, nor the next
        logits = torch.randn(batch, VOCAB, generator=gen) * 3.0
        ways = [("device", _device_way), ("history", _history_way)]
        got = {}
        for name, way in ways if step % 2 else ways[::-1]:  # alternate which goes first
            t0 = time.perf_counter()
            info_time, got[name] = way(reqs, plist, logits, slots, cache, device_sampler)
            if step >= 2:
                step_s[name].append(time.perf_counter() - t0)
                info_s[name].append(info_time)
        assert torch.equal(got["device"], got["history"]), "the two ways disagree"
        for r, t in zip(reqs, got["device"].tolist(), strict=True):
            r.output_ids.append(t)
    # minima: this shared machine's noise only ever adds time
    ms = {f"{k}_{w}_ms": 1e3 * min(v[w]) for k, v in (("step", step_s), ("info", info_s))
          for w in ("history", "device")}  # fmt: skip
    return {"batch": batch, "output_len": output_len, **ms,
            "step_history_vs_device": ms["step_history_ms"] / ms["step_device_ms"],
            "info_history_vs_device": ms["info_history_ms"] / ms["info_device_ms"],
            "info_cache_hits": cache.hits}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    shapes = [(16, 64)] if args.quick else [(b, n) for b in (64, 256) for n in (64, 1024, 4096)]
    rows = []
    for batch, output_len in shapes:
        rows.append(measure(batch, output_len, 3 if args.quick else args.reps))
        print_table(rows[-1:], COLUMNS)
    print_table(rows, COLUMNS)
    summary = {f"bs{r['batch']}/out{r['output_len']}": {
        "step_history_vs_device": r["step_history_vs_device"],
        "info_history_vs_device": r["info_history_vs_device"]} for r in rows}  # fmt: skip
    name = "penalty_counts_quick" if args.quick else "penalty_counts"
    notes = [f"vocabulary {VOCAB}, prompt {PROMPT} tokens, one intra-op thread; the 'device' "
             "is this CPU, so both include the [B, V] sampling work a GPU would do"]  # fmt: skip
    print(write_result(name, {"rows": rows}, summary, notes=notes))


if __name__ == "__main__":
    main()
