"""Weights an RL trainer broadcasts through a process group (SGLang's
`Engine.init_weights_update_group` / `update_weights_from_distributed` /
`destroy_weights_update_group`; engine/weight_groups.py), against transformers, with the
trainer a separate process that builds its group the trainers' way (tests/rl_trainer.py, gloo
on this CPU): another checkpoint's tensors, broadcast in three buckets (two of them flattened
into one uint8 tensor, SGLang's "flattened_bucket"), give its greedy tokens in every loop (the
device process joins the group itself); a bucket refused (a name the model lacks) is still
received, so the trainer goes on and the next buckets land; the RL loop's order with the
weights discarded (sleep level 2) gets the new weights; bad groups, ranks and backends are
refused before anything blocks, and a trainer that never comes is a timeout; one that dies
fails the next update at once."""

from __future__ import annotations

import time

import pytest
import torch

from engine.engine import Engine
from shared.redis_server import free_port
from tests.factories import SCHEDULER_LOOPS, hf_greedy, mixed_prompts, tiny_model
from tests.rl_trainer import Trainer, buckets

NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
A, B = tiny_model("llama"), tiny_model("llama", seed=1)
PROMPT = mixed_prompts(500, n=1, max_len=40, seed=7)[0]
BUCKETS = buckets(B, 3)


def tokens(eng: Engine) -> list[int]:
    return eng.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


def spec(bucket: list[tuple[str, torch.Tensor]]) -> dict:
    return {"names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype) for _, t in bucket],  # ("torch.float32": SGLang takes both)
            "shapes": [list(t.shape) for _, t in bucket]}  # fmt: skip


def joined(eng: Engine, order: str) -> Trainer:
    """The trainer started (sending buckets `order`) and the engine in its group."""
    port = free_port()
    trainer = Trainer("--port", str(port), "--checkpoint", B, "--buckets", "3", "--order", order)
    try:
        eng.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo", timeout_s=60)
    except BaseException:
        trainer.kill()
        raise
    return trainer


@SCHEDULER_LOOPS
def test_another_checkpoint_broadcast_in_buckets_gives_its_tokens(kw: dict) -> None:
    with Engine(model_path=A, **kw) as eng:
        assert tokens(eng) == hf_greedy(A, PROMPT, NEW)
        trainer = joined(eng, "0f,1,2f")  # (buckets 0 and 2 flattened: one uint8 tensor)
        for k, bucket in enumerate(BUCKETS):
            fmt = "flattened_bucket" if k != 1 else None
            eng.update_weights_from_distributed(**spec(bucket), weight_version="step-1",
                                                load_format=fmt)  # fmt: skip
        assert trainer.answers()[-1] == {"call": "done"}
        eng.destroy_weights_update_group()
        assert tokens(eng) == hf_greedy(B, PROMPT, NEW)
        assert eng.weight_version == "step-1"
        with pytest.raises(ValueError, match="no weights update group named"):
            eng.destroy_weights_update_group()


def test_a_refused_bucket_is_still_received_and_the_next_ones_land() -> None:
    with Engine(model_path=A, disable_overlap_schedule=True) as eng:
        want = tokens(eng)
        trainer = joined(eng, "0,0,1,2")
        wrong = spec(BUCKETS[0])
        wrong["names"][0] = "model.extra.weight"
        with pytest.raises(ValueError, match="unexpected weight 'model.extra.weight'"):
            eng.update_weights_from_distributed(**wrong)
        assert tokens(eng) == want  # (nothing changed)
        for bucket in BUCKETS:
            eng.update_weights_from_distributed(**spec(bucket))
        assert trainer.answers()[-1] == {"call": "done"}
        assert tokens(eng) == hf_greedy(B, PROMPT, NEW)
        eng.destroy_weights_update_group()


@pytest.mark.parametrize("kw", [dict(disable_overlap_schedule=True),
                                dict(cpu_overlap_executor="process")],
                         ids=["no-overlap", "process"])  # fmt: skip
def test_rl_loop_sleep_update_wake(kw: dict) -> None:
    with Engine(model_path=A, **kw) as eng:
        trainer = joined(eng, "0,1,2")
        eng.sleep(2)
        eng.wake_up(["weights"])
        for bucket in BUCKETS:
            eng.update_weights_from_distributed(**spec(bucket))
        eng.wake_up(["kv_cache"])
        assert tokens(eng) == hf_greedy(B, PROMPT, NEW)
        assert trainer.answers()[-1] == {"call": "done"}
        eng.destroy_weights_update_group()


def test_bad_calls_are_refused_before_anything_blocks() -> None:
    with Engine(model_path=A, disable_overlap_schedule=True) as eng:
        with pytest.raises(ValueError, match="backend nccl needs the model on a CUDA device"):
            eng.init_weights_update_group("127.0.0.1", free_port(), 1, 2)
        with pytest.raises(ValueError, match="rank 0 of a group of 2"):
            eng.init_weights_update_group("127.0.0.1", free_port(), 0, 2, backend="gloo")
        with pytest.raises(ValueError, match="rank 2 of a group of 2"):
            eng.init_weights_update_group("127.0.0.1", free_port(), 2, 2, backend="gloo")
        with pytest.raises(ValueError, match="backend 'mpi'"):
            eng.init_weights_update_group("127.0.0.1", free_port(), 1, 2, backend="mpi")
        with pytest.raises(ValueError, match="no weights update group named 'g'"):
            eng.update_weights_from_distributed(**spec(BUCKETS[0]), group_name="g")
        with pytest.raises(ValueError, match="dtype 'complex64' is not a weight dtype"):
            eng.update_weights_from_distributed(["x"], ["complex64"], [[2]])
        with pytest.raises(ValueError, match="1 names, 2 dtypes"):
            eng.update_weights_from_distributed(["x"], ["float32", "float32"], [[2]])
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="joining group 'weight_update_group'"):
            eng.init_weights_update_group("127.0.0.1", free_port(), 1, 2, backend="gloo",
                                          timeout_s=2)  # fmt: skip
        assert time.monotonic() - start < 30
        assert tokens(eng) == hf_greedy(A, PROMPT, NEW)  # (the engine lives on)


def test_a_group_name_in_use_is_refused_and_a_left_group_can_be_joined_again() -> None:
    with Engine(model_path=A, disable_overlap_schedule=True) as eng:
        trainer = joined(eng, "0")
        with pytest.raises(ValueError, match="named 'weight_update_group' exists"):
            eng.init_weights_update_group("127.0.0.1", free_port(), 1, 2, backend="gloo")
        eng.update_weights_from_distributed(**spec(BUCKETS[0]))
        trainer.answers()
        eng.destroy_weights_update_group()
        trainer = joined(eng, "1,2")
        for bucket in BUCKETS[1:]:
            eng.update_weights_from_distributed(**spec(bucket))
        trainer.answers()
        eng.destroy_weights_update_group()
        assert tokens(eng) == hf_greedy(B, PROMPT, NEW)


def test_a_trainer_gone_fails_the_next_update_at_once_and_the_engine_serves_on() -> None:
    with Engine(model_path=A, disable_overlap_schedule=True) as eng:
        trainer = joined(eng, "0")  # (sends bucket 0, then exits)
        eng.update_weights_from_distributed(**spec(BUCKETS[0]))
        assert trainer.answers()[-1] == {"call": "done"}
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            eng.update_weights_from_distributed(**spec(BUCKETS[1]))
        assert time.monotonic() - start < 10  # (gloo sees the closed socket; NCCL would wait)
        assert len(tokens(eng)) == NEW
        eng.destroy_weights_update_group()


def test_a_shut_down_engine_leaves_its_group_for_the_next_one() -> None:
    with Engine(model_path=A, disable_overlap_schedule=True) as eng:
        trainer = joined(eng, "0")
        eng.update_weights_from_distributed(**spec(BUCKETS[0]))
        trainer.answers()
    with Engine(model_path=A, disable_overlap_schedule=True) as eng:  # (the same group name)
        trainer = joined(eng, "1")
        eng.update_weights_from_distributed(**spec(BUCKETS[1]))
        assert trainer.answers()[-1] == {"call": "done"}
        eng.destroy_weights_update_group()
