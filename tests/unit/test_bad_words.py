"""vLLM's bad_words: the token sequences a tokenizer gives them, and the per-step bans.

A one-token word is banned at every step; a longer word's last token only where the output so
far ends with the rest of it (the prompt is not matched, as in vLLM). The end-to-end checks,
overlap scheduler included, are in tests/integration/test_bad_words_engine.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from engine.sampling.logit_bans import bad_word_bans
from engine.sampling.penalty_slots import PenaltySlots
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_batch_info import SamplingBatchInfo, SamplingInfoCache
from engine.sampling.sampling_params import SamplingParams
from engine.tokenizer import bad_words_ids, load_tokenizer
from tests.factories import tiny_model

SP = SamplingParams


def test_bans_follow_the_output_so_far_per_row() -> None:
    params = [
        SP(bad_words_ids=[[5], [7, 8, 9]]),
        SP(bad_words_ids=[[7, 8, 9], [8, 10]]),
        SP(),
        SP(bad_words_ids=[[3, 4]]),
    ]
    outputs = [[1, 7, 8], [7, 8], [7, 8], []]
    assert bad_word_bans(params, outputs) == [(0, [5, 9]), (1, [9, 10])]
    outputs = [[7, 8, 1], [9, 8], [], [4, 3]]
    assert bad_word_bans(params, outputs) == [(0, [5]), (1, [10]), (3, [4])]
    with pytest.raises(ValueError, match="need output_ids"):
        bad_word_bans(params, None)
    assert bad_word_bans([SP(bad_words_ids=[[5]])], None) == [(0, [5])]  # none needs history


def test_banned_tokens_are_not_sampled_and_longer_words_are_never_cached() -> None:
    vocab = 32
    logits = torch.zeros(3, vocab)
    logits[:, 9] = 10.0  # everyone's argmax, then 4
    logits[:, 4] = 5.0
    params = [SP(temperature=0.0, bad_words_ids=[[2, 9]]), SP(temperature=0.0, bad_words_ids=[[9]]),
              SP(temperature=0.0, bad_words_ids=[[2, 9]])]  # fmt: skip
    info = SamplingBatchInfo.from_params(params, vocab, "cpu", output_ids=[[1, 2], [], [2, 1]])
    ids = Sampler(seed=0)(logits, info).next_token_ids.tolist()
    assert ids == [4, 4, 9]  # row 2's output does not end with 2: 9 stays allowed
    cache = SamplingInfoCache()
    for _ in range(2):
        cache.get(params, vocab, "cpu", output_ids=[[1, 2], [], [2, 1]])
    assert cache.hits == 0  # the bans change with the output
    single = [SP(temperature=0.0, bad_words_ids=[[9]])]
    for _ in range(2):
        cache.get(single, vocab, "cpu", step_positions=[0])
    assert cache.hits == 1  # a one-token word's ban is the same at every step
    assert not SP(bad_words_ids=[[9]]).has_device_history
    # the overlap scheduler matches longer words on the device: no deferred sampling
    assert SP(bad_words_ids=[[2, 9]]).has_device_history
    assert not SP(bad_words_ids=[[2, 9]]).needs_history


@dataclass(eq=False)
class _Req:
    sampling_params: SamplingParams
    output_ids: list[int]
    origin_input_ids: list[int] = field(default_factory=lambda: [1])
    num_retractions: int = 0
    finished: bool = False


def _device_bans(params: list[SamplingParams], outputs: list[list[int]], steps: int) -> list:
    """The bans the device's matching gives after a reset to `outputs[:-steps]` and `steps`
    tokens added by sampling (the last ones in flight), as `bad_word_bans` lists them."""
    vocab = 16
    reqs = [_Req(p, list(out[: len(out) - steps])) for p, out in zip(params, outputs, strict=True)]
    slots, sampler = PenaltySlots(), Sampler(seed=0)
    for r in reqs:
        if r.sampling_params.has_device_history:
            slots.add(r)
    slots.width = max(slots.width, 4)  # wider than any prefix: the matching is right-aligned
    for step in range(steps + 1):
        plan = slots.plan(reqs, None)
        info = SamplingBatchInfo.from_params(params, vocab, "cpu", penalty_plan=plan)
        if step == steps:
            return _bans(sampler, info, vocab)
        logits = torch.zeros(len(reqs), vocab)
        for i, out in enumerate(outputs):  # force the next token of each output
            logits[i, out[len(out) - steps + step]] = 100.0
        info = dataclasses.replace(info, bad_words=None, bias_rows=None)  # (forced anyway)
        sampler(logits, info)
    raise AssertionError


def _bans(sampler: Sampler, info: SamplingBatchInfo, vocab: int) -> list:
    rows = info.history_rows
    assert rows is not None
    sampler.penalty_counts.prepare(rows, vocab, torch.device("cpu"))
    logits = info.apply_logit_bias(torch.zeros(info.batch_size, vocab))
    if info.bad_words is not None:
        logits = info.bad_words.apply(logits, sampler.penalty_counts.recent)
    banned = [(i, torch.nonzero(row == -torch.inf).flatten().tolist()) for i, row in
              enumerate(logits)]  # fmt: skip
    return [(i, ids) for i, ids in banned if ids]


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_words_matched_on_the_device_ban_what_the_host_would(steps: int) -> None:
    """The overlap scheduler's matching (last tokens kept on the device: reset from the
    history, then each sampled token shifted in) bans what the host's matching bans."""
    params = [
        SP(bad_words_ids=[[5], [7, 8, 9]]),
        SP(bad_words_ids=[[7, 8, 9], [8, 10]]),
        SP(),
        SP(bad_words_ids=[[3, 4]]),
    ]
    cases = [
        [[1, 7, 8], [7, 8, 8], [7, 8, 3], [1, 2, 3]],
        [[7, 8, 1], [9, 9, 8], [1, 2, 3], [4, 4, 3]],
        [[2, 2, 2, 2, 7, 8], [0, 0, 7, 8, 9, 8], [5, 5, 5], [3, 3, 3, 3, 4, 3]],
    ]
    for outputs in cases:
        assert _device_bans(params, outputs, steps) == bad_word_bans(params, outputs)


def test_verify_checks_the_sequences() -> None:
    SP(bad_words_ids=[[1, 2], [3]]).verify(32)
    with pytest.raises(ValueError, match="bad_words_ids must be in"):
        SP(bad_words_ids=[[1, 32]]).verify(32)
    with pytest.raises(ValueError, match="must not hold empty"):
        SP(bad_words_ids=[[1], []]).verify(32)
    with pytest.raises(ValueError, match="bad_words_ids has wrong type"):
        SP.from_dict({"bad_words_ids": [1, 2]})
    assert SP.from_dict({"bad_words_ids": [[1, 2]]}).bad_words_ids == [[1, 2]]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_word_at_the_start_and_after_a_space(arch: str) -> None:
    tok = load_tokenizer(tiny_model(arch))
    words = bad_words_ids(tok, ["hello", " the"])
    for ids in words:
        assert tok.decode(ids).strip() in ("hello", "the")
    as_text = {tok.decode(ids) for ids in words}
    if arch == "gpt2":  # byte-level: the word and " word" are other tokens
        assert as_text == {"hello", " hello", "the", " the"}
    else:  # SentencePiece: a word already starts with "▁"; a second "▁" adds nothing
        assert len(words) == 2 and not any(ids[1:] in words for ids in words)
    with pytest.raises(ValueError, match="non-empty"):
        bad_words_ids(tok, ["ok", "  "])
