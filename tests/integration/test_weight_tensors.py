"""Weights handed over in memory (SGLang's `Engine.update_weights_from_tensor`: an RL
trainer's new weights, a bucket at a time; engine/runner_weights.py), against transformers:
another checkpoint's tensors sent in three buckets that split each layer's q, k and v give its
greedy tokens, in every loop (the device process gets them through its pipe); what does not
fit is refused before anything changes; the RL loop's order with the weights discarded
(sleep level 2) after such an update refuses to generate until every tensor has been sent
again (reading the old checkpoint from disk instead would give its tokens), then gives the
new weights' tokens; weights discarded while they are the checkpoint's on disk are read from
it before a partial update lands on them."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.loader import iter_safetensors
from tests.factories import SCHEDULER_LOOPS, hf_greedy, mixed_prompts, tiny_model

NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
A, B = tiny_model("llama"), tiny_model("llama", seed=1)
PROMPT = mixed_prompts(500, n=1, max_len=40, seed=7)[0]
B_TENSORS = sorted(iter_safetensors(B))
BUCKETS = [B_TENSORS[i::3] for i in range(3)]  # (q, k and v of a layer in different ones)


def tokens(eng: Engine) -> list[int]:
    return eng.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


@SCHEDULER_LOOPS
def test_another_checkpoint_sent_in_buckets_gives_its_tokens(kw: dict) -> None:
    where = {n: i for i, bucket in enumerate(BUCKETS) for n, _ in bucket}
    qkv = {where[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")}
    assert len(qkv) > 1
    with Engine(model_path=A, **kw) as eng:
        assert tokens(eng) == hf_greedy(A, PROMPT, NEW)
        for bucket in BUCKETS:
            eng.update_weights_from_tensor(bucket)
        assert tokens(eng) == hf_greedy(B, PROMPT, NEW)
        assert tokens(eng) == hf_greedy(B, PROMPT, NEW)  # (the cache was emptied: no A K/V)


def test_what_does_not_fit_is_refused_and_changes_nothing() -> None:
    name = "model.layers.0.self_attn.q_proj.weight"
    weight = dict(B_TENSORS)[name]
    with Engine(model_path=A, disable_overlap_schedule=True) as eng:
        want = tokens(eng)
        with pytest.raises(ValueError, match="unexpected weight 'model.extra.weight'"):
            eng.update_weights_from_tensor([*BUCKETS[0], ("model.extra.weight", weight)])
        with pytest.raises(ValueError, match="does not match"):
            eng.update_weights_from_tensor([*BUCKETS[0], (name, weight[:, :-1])])
        with pytest.raises(ValueError, match="load_format 'flattened_bucket'"):
            eng.update_weights_from_tensor(BUCKETS[0], load_format="flattened_bucket")
        with pytest.raises(ValueError, match="no tensors"):
            eng.update_weights_from_tensor([])
        assert tokens(eng) == want


@SCHEDULER_LOOPS
def test_discarded_tensor_weights_must_all_be_sent_again(kw: dict) -> None:
    with Engine(model_path=A, **kw) as eng:
        for bucket in BUCKETS:
            eng.update_weights_from_tensor(bucket)
        eng.sleep(2)  # the weights are B's, on no disk: discarded
        eng.wake_up(["weights"])
        eng.update_weights_from_tensor(BUCKETS[0])
        eng.wake_up()
        with pytest.raises(RuntimeError, match="weights were discarded at a release and not"):
            tokens(eng)
        for bucket in BUCKETS[1:]:
            eng.update_weights_from_tensor(bucket)
        assert tokens(eng) == hf_greedy(B, PROMPT, NEW)
        eng.update_weights_from_disk(A)  # (on disk again: a discard reads it back)
        eng.sleep(2)
        eng.wake_up()
        assert tokens(eng) == hf_greedy(A, PROMPT, NEW)


def test_weights_discarded_on_disk_are_read_before_a_partial_update() -> None:
    part = [(n, t) for n, t in B_TENSORS if ".layers.0." in n]
    with Engine(model_path=A, disable_overlap_schedule=True) as eng:
        eng.update_weights_from_tensor(part)
        mixed = tokens(eng)
        assert mixed not in (hf_greedy(A, PROMPT, NEW), hf_greedy(B, PROMPT, NEW))
        eng.update_weights_from_disk(A)
        eng.sleep(2)
        eng.update_weights_from_tensor(part)  # (takes the weights back: A's read, then part)
        eng.wake_up()
        assert tokens(eng) == mixed
