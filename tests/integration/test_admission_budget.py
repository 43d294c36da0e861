"""The prefill budget counts a request's cached prefix as taken once the request locks it.

Found by benchmarks/hicache.py: a request whose prefix was cached (evictable) was admitted
after others had used up the free and evictable KV by the budget's count, as if its prefix
were still evictable; locking it made it not, and allocating the batch failed ("KV cache
exhausted although the scheduler's budget admitted the batch"). SGLang checks the budget
with the prefix locked; so does the adder now.
"""

from __future__ import annotations

import random

import pytest

from engine.engine import Engine
from tests.factories import assert_engine_clean, model_path

GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("overlap", [False, True])
def test_locked_prefix_is_not_counted_as_evictable(overlap: bool) -> None:
    rng = random.Random(0)
    docs = [[rng.randrange(8, 500) for _ in range(288)] for _ in range(4)]
    engine = Engine(
        model_path=model_path("llama"),
        max_total_tokens=1024,
        disable_overlap_schedule=not overlap,
        cpu_overlap_executor="thread",
    )
    try:
        first = engine.generate(input_ids=[docs[0]], sampling_params=GREEDY)[0]
        # its prefix (~303 tokens) is cached, evictable until the request locks it; the three
        # others take 3 x 304 of the 1024 slots, so it must wait for them
        follow_up = docs[0] + first["output_ids"] + [9] * 32
        outs = engine.generate(input_ids=[*docs[1:], follow_up], sampling_params=GREEDY)
        assert all(len(o["output_ids"]) == 16 for o in outs)
        assert_engine_clean(engine)
    finally:
        engine.shutdown()
