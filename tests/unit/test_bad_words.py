"""vLLM's bad_words: the token sequences a tokenizer gives them, and the per-step bans.

A one-token word is banned at every step; a longer word's last token only where the output so
far ends with the rest of it (the prompt is not matched, as in vLLM). The end-to-end checks,
overlap scheduler included, are in tests/integration/test_bad_words_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.sampling.logit_bans import bad_word_bans
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
    assert SP(bad_words_ids=[[9]]).needs_history is False
    assert SP(bad_words_ids=[[2, 9]]).needs_history is True


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
