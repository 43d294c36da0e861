"""min_new_tokens (vLLM's min_tokens): EOS and stop tokens are banned, and stop strings not
looked for, until that many tokens are out; in both loops, whose step positions differ (the
overlap loop counts the token in flight)."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from tests.factories import mixed_prompts, tiny_model

LOOPS = {"overlap": {}, "plain": {"disable_overlap_schedule": True}}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_min_new_tokens_holds_back_eos_stop_tokens_and_stop_strings(loop: str) -> None:
    path = tiny_model("llama")
    with Engine(model_path=path, **LOOPS[loop]) as engine:
        eos = engine.scheduler.eos_token_ids[0]
        prompts = mixed_prompts(engine.scheduler.model_runner.model_config.vocab_size, n=6)
        forced = {"temperature": 0.0, "max_new_tokens": 20, "logit_bias": {str(eos): 100.0}}
        # EOS is forced at every step: it comes right after the minimum
        outs = engine.generate(input_ids=prompts, sampling_params=[
            {**forced, "min_new_tokens": m} for m in (0, 1, 5, 5, 18, 20)])  # fmt: skip
        for out, m in zip(outs, (0, 1, 5, 5, 18, 20), strict=True):
            ids = out["output_ids"]
            assert eos not in ids[:m], (m, ids)
            if m < 20:
                assert len(ids) == m + 1 and ids[-1] == eos
                assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
            else:
                assert out["meta_info"]["finish_reason"]["type"] == "length"
        # a stop token of the request's own, forced likewise
        stop = 77
        out = engine.generate(input_ids=prompts[0], sampling_params={
            "temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True, "stop_token_ids": [stop],
            "logit_bias": {str(stop): 100.0}, "min_new_tokens": 7})  # fmt: skip
        assert out["output_ids"][:7].count(stop) == 0 and out["output_ids"][7:] == [stop]
        # stop strings: the free-running text's first 8 tokens, then the minimum past them
        free = engine.generate(input_ids=prompts[1], sampling_params={
            "temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True})  # fmt: skip
        piece = engine.tokenizer.decode(free["output_ids"][2:4])
        assert piece.strip()
        for m in (0, 12):
            out = engine.generate(input_ids=prompts[1], sampling_params={
                "temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True, "stop": [piece],
                "min_new_tokens": m})  # fmt: skip
            reason = out["meta_info"]["finish_reason"]
            if m == 0:
                assert reason == {"type": "stop", "matched": piece}
                assert out["meta_info"]["completion_tokens"] <= 4
            else:  # not looked for before 12 tokens; after, it may or may not come again
                assert out["meta_info"]["completion_tokens"] >= 12
        # no_stop_trim keeps the matched stop string at the end of the text
        params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True, "stop": [piece]}
        trimmed = engine.generate(input_ids=prompts[1], sampling_params=params)
        keep = {**params, "no_stop_trim": True}
        kept = engine.generate(input_ids=prompts[1], sampling_params=keep)
        assert kept["text"] == trimmed["text"] + piece
        assert kept["output_ids"] == trimmed["output_ids"]
