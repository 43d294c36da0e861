"""Penalty counts and last tokens kept on the device (engine/sampling/penalty_slots.py)
against the history.

A simulated overlap loop: requests come, are sampled in batches of changing membership and
order, sometimes as a partial prompt first; some finish or are retracted with a token sampled
on the device that the host drops. Every step the sampler that reads the device's history must
give exactly what a fresh sampler gives with the penalties counted, and the bad words matched,
from the host's history.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from engine.sampling.logit_bans import bad_word_bans
from engine.sampling.penalties import BatchPenalties
from engine.sampling.penalty_slots import PenaltyCounts, PenaltyPlan, PenaltyRows, PenaltySlots
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_batch_info import SamplingBatchInfo, SamplingInfoCache
from engine.sampling.sampling_params import SamplingParams

VOCAB = 48  # small, so that tokens repeat and the penalties bite
KINDS = [
    {},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"repetition_penalty": 1.7},
    {"frequency_penalty": 0.7, "presence_penalty": 0.4, "repetition_penalty": 1.3},
    # bad words of several tokens (the favoured tokens 0-3 make them bite): the successor of
    # the last token is always banned; longer prefixes widen the device's last tokens
    {"bad_words_ids": [[t, (t + 1) % VOCAB] for t in range(VOCAB)]},
    {"bad_words_ids": [[a, b, (a + b) % 4] for a in range(4) for b in range(4)] + [[5]]},
    {"bad_words_ids": [[a, b, c, 4 + (a + b + c) % 4] for a in range(4) for b in range(4)
                       for c in range(4)] + [[2, 0, 3, 1, 2]]},  # fmt: skip
    {"frequency_penalty": 0.5, "bad_words_ids": [[1, 0], [3, 2, 1, 0]]},
]


@dataclass(eq=False)
class FakeReq:
    sampling_params: SamplingParams
    origin_input_ids: list[int]
    chunks_left: int = 0
    output_ids: list[int] = field(default_factory=list)
    num_retractions: int = 0
    finished: bool = False


def _new_req(rng: random.Random) -> FakeReq:
    params = SamplingParams(temperature=0.0, **rng.choice(KINDS))
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
    return FakeReq(params, prompt, chunks_left=rng.choice([0, 0, 0, 1, 2]))


def _simulate(seed: int, steps: int = 300) -> dict[str, int]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    slots, cache, device_sampler = PenaltySlots(), SamplingInfoCache(), Sampler(seed=0)
    live: list[FakeReq] = []
    seen = dict.fromkeys(["penalized", "retracted", "finished", "compared", "bites"], 0)
    seen["long_bites"] = 0
    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            live.append(_new_req(rng))
            if live[-1].sampling_params.has_device_history:
                slots.add(live[-1])
                seen["penalized"] += 1
        if not live:
            continue
        batch = rng.sample(live, rng.randint(1, min(len(live), 8)))
        chunked = next((r for r in batch if r.chunks_left), None)
        params = [r.sampling_params for r in batch]
        plan = slots.plan(batch, chunked)
        on_device = cache.get(params, VOCAB, "cpu", plan, step_positions=[0] * len(batch))
        history = SamplingBatchInfo.from_params(
            params, VOCAB, "cpu", step_positions=[0] * len(batch),
            output_ids=[r.output_ids for r in batch],
            input_ids=[r.origin_input_ids for r in batch],
        )  # fmt: skip
        logits = torch.randn(len(batch), VOCAB, generator=gen) * 3.0
        logits[:, :4] += 3.0
        got = device_sampler(logits, on_device, return_logprob=True)
        want = Sampler(seed=0)(logits, history, return_logprob=True)
        for i, req in enumerate(batch):
            if req is chunked:  # its token is dropped: the scratch row may differ
                req.chunks_left -= 1
                continue
            seen["compared"] += 1
            words = [w for w in req.sampling_params.bad_words_ids or () if len(w) > 1]
            prefix_len = max((len(w) for w in words if bad_word_bans(
                [SamplingParams(bad_words_ids=[w])], [req.output_ids])), default=0)  # fmt: skip
            seen["bites"] += prefix_len > 0
            seen["long_bites"] += prefix_len > 2
            assert int(got.next_token_ids[i]) == int(want.next_token_ids[i])
            assert float(got.logprobs[i]) == pytest.approx(float(want.logprobs[i]), abs=1e-6)
            fate = rng.random()
            if fate < 0.06:  # retracted with this token in flight: the host drops it
                req.num_retractions += 1
                seen["retracted"] += 1
            elif fate < 0.12:  # finished (or aborted) with this token in flight
                req.finished = True
                live.remove(req)
                seen["finished"] += 1
            else:
                req.output_ids.append(int(got.next_token_ids[i]))
    seen["capacity"] = slots.capacity
    seen["cache_hits"] = cache.hits
    return seen


@pytest.mark.parametrize("seed", range(4))
def test_device_counts_match_the_history(seed: int) -> None:
    seen = _simulate(seed)
    assert seen["compared"] > 500 and seen["retracted"] > 10 and seen["finished"] > 10
    assert seen["bites"] > 50 and seen["long_bites"] > 10  # bad words that banned a token
    # rows of finished requests were handed out again, and the counts grew as needed
    assert 8 < seen["capacity"] < seen["penalized"]


def test_steady_batches_reuse_their_info() -> None:
    """The same requests step after step: the info (and on the device, its copy) is reused,
    and each reuse still adds the step's token."""
    reqs = [FakeReq(SamplingParams(temperature=0.0, frequency_penalty=3.0), [1, 2])
            for _ in range(3)]  # fmt: skip
    slots, cache, sampler = PenaltySlots(), SamplingInfoCache(), Sampler(seed=0)
    for r in reqs:
        slots.add(r)
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 10.0  # the favourite, until its count of 3.0 per use has taken it down
    logits[:, 6] = 4.5
    picks = []
    for _ in range(5):
        plan = slots.plan(reqs, None)
        info = cache.get([r.sampling_params for r in reqs], VOCAB, "cpu", plan)
        ids = sampler(logits, info).next_token_ids.tolist()
        for r, t in zip(reqs, ids, strict=True):
            r.output_ids.append(t)
        picks.append(ids[0])
    assert cache.hits == 3  # the first plan resets, the second builds the steady info
    # 10 > 4.5, 7 > 4.5, 4 < 4.5, 4 > 1.5, 1 < 1.5: each step saw every earlier token
    assert picks == [5, 5, 6, 5, 6]


def test_a_row_is_given_when_the_first_token_is_sampled() -> None:
    slots = PenaltySlots()
    plain = FakeReq(SamplingParams(), [1])
    pen = FakeReq(SamplingParams(presence_penalty=1.0), [3], chunks_left=1)
    slots.add(pen)
    assert slots.plan([plain], None) is None
    first = slots.plan([plain, pen], pen)  # a partial prompt: scratch row, nothing counted
    assert first == PenaltyPlan([0, 0], [False, False], 1, [])
    second = slots.plan([pen, plain], None)
    assert second == PenaltyPlan([1, 0], [True, False], 2, [(1, [], None)])
    pen.finished = True
    other = FakeReq(SamplingParams(repetition_penalty=1.2), [4, 4])
    slots.add(other)
    assert slots.plan([other], None) == PenaltyPlan([1], [True], 2, [(1, [], [4, 4])])
    # a bad word of several tokens: a row too, its last tokens as wide as the longest prefix
    words = FakeReq(SamplingParams(bad_words_ids=[[7], [1, 2, 3], [5, 6]]), [2], output_ids=[9])
    slots.add(words)
    assert slots.width == 2
    assert slots.plan([words, other], None) == PenaltyPlan([2, 1], [True, True], 3,
                                                            [(2, [9], None)], 2, True)  # fmt: skip
    assert slots.plan([words], None) == PenaltyPlan([2], [True], 3, [], 2, counts=False)


def test_planned_penalties_need_the_device_counts() -> None:
    pens = BatchPenalties.build([SamplingParams(frequency_penalty=1.0)], VOCAB, "cpu", None,
                                None, on_device=True)  # fmt: skip
    assert pens is not None and pens.output_counts is None
    with pytest.raises(ValueError, match="device's counts"):
        pens.apply(torch.zeros(1, VOCAB))
    # a plan of bad words alone allocates no counts: reading them is an error, not zeros
    rows = PenaltyRows.from_plan(PenaltyPlan([1], [True], 2, [(1, [3], None)], 1, False), "cpu")
    device_counts = PenaltyCounts()
    device_counts.prepare(rows, VOCAB, torch.device("cpu"))
    assert device_counts.counts is None and device_counts.recent.tolist() == [[-1], [3]]
    with pytest.raises(ValueError, match="read no counts"):
        pens.apply(torch.zeros(1, VOCAB), device_counts, rows)
