"""bad_words through the offline Engine, with the overlap scheduler and the plain loop.

A two-token word's ban depends on the token sampled the step before, which the overlap
scheduler has not processed when it launches the next step: it matches the words on the device,
against the last tokens it keeps there (engine/sampling/penalty_slots.py). The words are taken
from each prompt's own greedy output, so every ban bites: the output is the greedy one up to
the word's first token, then differs.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.engine import Engine
from tests.factories import tiny_model

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 16}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(8, 1000) for _ in range(rng.randint(4, 30))] for _ in range(5)]


def _generate(prompts: list[list[int]], params: list[dict], overlap: bool) -> list[list[int]]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Engine(model_path=tiny_model("llama"), disable_overlap_schedule=not overlap) as eng:
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            return [o["output_ids"] for o in outs]
    finally:
        torch.set_num_threads(before)


def _first(seq: list[int], word: list[int]) -> int:
    n = len(word)
    return next(i for i in range(len(seq) - n + 1) if seq[i : i + n] == word)


def test_bad_words_end_the_greedy_output_where_they_would_appear(prompts) -> None:
    base = _generate(prompts, [GREEDY] * len(prompts), overlap=False)
    words = [base[0][3:5], base[1][6:9], [base[2][2]], base[3][0:2]]  # 2, 3, 1 and 2 tokens
    params = [GREEDY | {"bad_words_ids": [w]} for w in words] + [GREEDY]  # the last: none
    on = _generate(prompts, params, overlap=True)
    off = _generate(prompts, params, overlap=False)
    assert on == off
    for out, ref, word in zip(off, base, words, strict=False):
        cut = _first(ref, word) + len(word) - 1  # where the word would be completed
        assert out[:cut] == ref[:cut] and out[cut] != ref[cut]
        assert all(out[i : i + len(word)] != word for i in range(len(out)))
    assert off[4] == base[4]  # its neighbours' bans are not its own
