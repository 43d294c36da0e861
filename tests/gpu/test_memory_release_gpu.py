"""Device memory released while idle on a GPU (engine/memory_occupation.py): the CUDA memory
the driver reports free grows by the weights, the KV pool and the graphs' pool; after the
resume the engine's greedy tokens (CUDA graphs replayed, captured again over the new
addresses) are those before the release, with the weights copied back (level 1) or read
again (level 2), in the plain and the CUDA overlap loop."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.factories import require_compiled_cuda  # noqa: E402

require_compiled_cuda()

from engine.engine import Engine  # noqa: E402
from tests.factories import count_graph_replays, mixed_prompts, tiny_model  # noqa: E402


def free_bytes() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_the_memory_back_and_wakes_to_the_same_tokens(
    overlap: bool, level: int, monkeypatch
) -> None:
    replays = count_graph_replays(monkeypatch)
    path = tiny_model("llama", preset="small")
    engine = Engine(
        model_path=path, device="cuda", dtype="bfloat16", max_total_tokens=65536,
        disable_overlap_schedule=not overlap, cuda_graph_bs=(1, 2, 4, 8),
        skip_tokenizer_init=True,
    )  # fmt: skip
    try:
        vocab = engine.scheduler.model_runner.model_config.vocab_size
        prompts = mixed_prompts(vocab, n=8, max_len=100)
        params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
        want = [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                         sampling_params=params)]  # fmt: skip
        assert replays
        held = sum(engine.scheduler.memory_occupied().values())
        before = free_bytes()
        engine.sleep(level)
        freed = free_bytes() - before
        assert freed >= 0.9 * held, (freed, held)
        assert engine.scheduler.memory_occupied() == {"weights": 0, "kv_cache": 0}
        engine.wake_up()
        replays.clear()
        got = [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                        sampling_params=params)]  # fmt: skip
        assert replays, "no graph replayed after the wake-up"
        assert got == want
    finally:
        engine.shutdown()
