"""Weights an RL trainer broadcasts to an engine on a GPU (engine/weight_groups.py): the trainer a
separate process (tests/rl_trainer.py, CPU tensors, gloo: NCCL cannot put two ranks on the one
GPU these sessions have), the engine receiving into CUDA tensors; after another checkpoint's
buckets (the first flattened into one uint8 tensor) its greedy tokens (CUDA graphs replayed:
the weights were copied in place) are those of an engine started on that checkpoint, in the
plain and the CUDA overlap loop; "nccl" is accepted on CUDA (its rendezvous then times out: no
trainer)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

from tests.factories import require_compiled_cuda  # noqa: E402

require_compiled_cuda()

from engine.engine import Engine  # noqa: E402
from tests.factories import count_graph_replays, mixed_prompts, tiny_model  # noqa: E402
from tests.rl_trainer import Trainer, buckets, free_port  # noqa: E402

KW = dict(device="cuda", dtype="bfloat16", max_total_tokens=65536, cuda_graph_bs=(1, 2, 4, 8),
          skip_tokenizer_init=True)  # fmt: skip
PARAMS = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


def outputs(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=PARAMS)]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_broadcast_weights_give_the_checkpoints_tokens(overlap: bool, monkeypatch) -> None:
    a, b = tiny_model("llama", preset="small"), tiny_model("llama", preset="small", seed=1)
    with Engine(model_path=b, **KW) as fresh:
        vocab = fresh.scheduler.model_runner.model_config.vocab_size
        prompts = mixed_prompts(vocab, n=8, max_len=100)
        want = outputs(fresh, prompts)
    replays = count_graph_replays(monkeypatch)
    with Engine(model_path=a, disable_overlap_schedule=not overlap, **KW) as engine:
        assert outputs(engine, prompts) != want
        port = free_port()
        trainer = Trainer("--port", str(port), "--checkpoint", b, "--buckets", "3", "--order",
                          "0f,1,2")  # fmt: skip
        engine.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo")
        for k, bucket in enumerate(buckets(b, 3)):
            engine.update_weights_from_distributed(
                [n for n, _ in bucket], [str(t.dtype) for _, t in bucket],
                [list(t.shape) for _, t in bucket],
                load_format="flattened_bucket" if k == 0 else None,
            )  # fmt: skip
        assert trainer.answers()[-1] == {"call": "done"}
        engine.destroy_weights_update_group()
        replays.clear()
        assert outputs(engine, prompts) == want
        assert replays, "no graph replayed after the update"


def test_nccl_is_accepted_on_cuda() -> None:
    with Engine(model_path=tiny_model("llama"), **KW) as engine:
        with pytest.raises(RuntimeError, match="joining group"):
            engine.init_weights_update_group("127.0.0.1", free_port(), 1, 2, timeout_s=3)
