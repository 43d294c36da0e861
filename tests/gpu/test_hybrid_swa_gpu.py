"""Hybrid sliding-window memory on a GPU: the engine's greedy tokens with it equal those
without it, for the Triton and flashinfer backends, CUDA graphs on and off, in the plain and
the overlap loop; the windowed layers' pool is a small fraction of the tokens in flight.

The K/V the windowed layers read are the same values at other addresses, so in float32
(Triton) the tokens must be equal exactly. In bf16 (flashinfer) a request whose prefix-cache
hit differs between the two runs takes another kernel path, and near-ties may flip: equal up
to a first divergence that is a near-tie (`assert_equal_or_tied`).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from engine.engine import Engine  # noqa: E402
from tests.factories import assert_equal_or_tied, mixed_prompts, model_path  # noqa: E402

GREEDY = {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True}


def _generate(name: str, backend: str, hybrid: bool, **kw: object) -> list[dict]:
    engine = Engine(
        # flashinfer's kernels take head_dim 64/128/256 (the tiny preset's is 16)
        model_path=model_path(name, head_dim=64 if backend == "flashinfer" else None),
        device="cuda",
        dtype="bfloat16" if backend == "flashinfer" else "float32",
        attention_backend=backend,
        max_total_tokens=8192,
        chunked_prefill_size=256,
        hybrid_swa_memory=hybrid,
        swa_full_tokens_ratio=0.1,
        cuda_graph_bs=(1, 2, 4, 8, 16),
        skip_tokenizer_init=True,
        **kw,
    )
    try:
        prompts = mixed_prompts(500, n=16, max_len=300, seed=11)
        # bf16 (flashinfer): the top two logprobs, to judge a divergence (assert_equal_or_tied)
        tops = {"return_logprob": True, "top_logprobs_num": 2} if backend == "flashinfer" else {}
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, **tops)
        engine.scheduler.tree_cache.check_integrity()
        assert engine.scheduler.stats.num_retractions == 0
        return outs
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("backend", "cuda_graph", "overlap"),
    [
        ("triton", True, True),
        ("triton", False, False),
        ("flashinfer", True, False),
        ("flashinfer", False, True),
    ],
)
@pytest.mark.parametrize("name", ["gemma3_text", "mistral-sliding"])
def test_hybrid_tokens_equal_plain(name: str, backend: str, cuda_graph: bool, overlap: bool):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    kw = dict(disable_cuda_graph=not cuda_graph, disable_overlap_schedule=not overlap)
    hybrid, plain = (_generate(name, backend, h, **kw) for h in (True, False))
    if backend == "triton":  # float32, the same kernels on the same values: exactly equal
        assert [o["output_ids"] for o in hybrid] == [o["output_ids"] for o in plain]
    else:
        # bf16: a request whose prefix hit differs takes another flashinfer path (ragged +
        # paged merge, or ragged alone); near-ties of these random models may flip
        assert_equal_or_tied(hybrid, plain)
