"""Speculative verify steps captured in CUDA graphs and replayed on a GPU (tiny Llama; Triton
attention in float32 and bfloat16, flashinfer in bfloat16, and the default flashinfer prefill
with Triton decode, whose verify graphs are flashinfer's), against the eager forward on the
same KV state: requests padded to the graph's width and batches to a larger captured size; and
the engine's greedy tokens with n-gram and draft-model speculation, verify steps replayed,
against plain decoding (float32, Triton)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.factories import require_compiled_cuda  # noqa: E402

require_compiled_cuda()

from engine.config import EngineArgs, ModelConfig  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from tests.factories import count_graph_replays, tiny_model  # noqa: E402
from tests.gpu.test_cuda_graph_gpu import _assert_close  # noqa: E402
from tests.runner_batches import eager_forward, kv_restore, kv_snapshot, verify_batch  # noqa: E402

SIZES = (1, 2, 4, 8)
DRAFTS = 3


@pytest.fixture(
    scope="module",
    params=["triton-float32", "triton-bfloat16", "flashinfer-bfloat16", "default-bfloat16"],
)
def runner(request) -> ModelRunner:
    """(default: no backend named, flashinfer prefill and Triton decode, the GPU's default:
    verify graphs are the prefill backend's)"""
    backend, dtype = request.param.split("-")
    # (flashinfer's kernels take head_dim 64, 128 or 256; the tiny preset's is 16)
    path = tiny_model("llama", head_dim=None if backend == "triton" else 64)
    args = EngineArgs(
        model_path=path, device="cuda", dtype=dtype,
        attention_backend=None if backend == "default" else backend,
        max_total_tokens=8192, max_running_requests=16, cuda_graph_bs=SIZES,
        speculative_algorithm="ngram", speculative_num_draft_tokens=DRAFTS,
    )  # fmt: skip
    runner = ModelRunner(ModelConfig.from_pretrained(path), args)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for buf in runner.kv_pool.k_buffer + runner.kv_pool.v_buffer:  # a context to attend
        buf.copy_(torch.randn(buf.shape, generator=gen, device="cuda", dtype=buf.dtype))
    return runner


def test_verify_graphs_are_captured_at_init(runner):
    graphs = runner.verify_graph_runner
    assert graphs is not None and graphs.width == DRAFTS + 1
    assert sorted(graphs.graphs) == list(SIZES)
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g in graphs.graphs.values())


@pytest.mark.parametrize(
    "prefix_lens,draft_lens",
    [
        ([20], [3]),
        ([7, 133], [3, 3]),
        ([40, 1, 13], [3, 0, 2]),  # padded tokens, and a request padded (3 in 4)
        ([5, 260, 11, 2, 90], [0, 1, 2, 0, 3]),  # the graph of 8
    ],
)
def test_replay_matches_eager(runner, prefix_lens, draft_lens):
    rows = list(range(1, len(prefix_lens) + 1))
    fb = verify_batch(runner, rows, prefix_lens, draft_lens, seed=len(rows))
    want, _ = eager_forward(runner, fb)
    graphs = runner.verify_graph_runner
    assert graphs.can_run(fb)
    saved = kv_snapshot(runner)
    got = runner.forward(fb).clone()
    kv_restore(runner, saved)
    assert got.shape == want.shape
    _assert_close(got.float(), want.float(), runner.dtype)


@pytest.mark.parametrize("algorithm", ["ngram", "standalone", "ngram_tree", "standalone_tree"])
def test_engine_greedy_tokens_equal_plain_decoding(algorithm, monkeypatch):
    """(`_tree`: draft trees of 6 nodes, topk 2, 3 levels: verify graphs of trees)"""
    from engine.engine import Engine

    path = tiny_model("llama")
    prompts = [[5, 6, 7, 8] * 6, list(range(20, 41)), [9, 10, 11] * 5, [300, 301] * 4, [12] * 7]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True,
               "allowed_token_ids": [11, 12, 13] if i < 3 else None}
              for i, n in enumerate((30, 24, 16, 20, 9))]  # fmt: skip
    for p in params:
        if p["allowed_token_ids"] is None:
            del p["allowed_token_ids"]

    def generate(**kw) -> list[list[int]]:
        engine = Engine(model_path=path, device="cuda", dtype="float32",
                        attention_backend="triton", max_total_tokens=8192,
                        disable_overlap_schedule=True, cuda_graph_bs=(1, 2, 4, 8),
                        skip_tokenizer_init=True, **kw)  # fmt: skip
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        engine.shutdown()
        return [o["output_ids"] for o in outs]

    want = generate()
    replays = count_graph_replays(monkeypatch, verify=True)
    name, tree = algorithm.removesuffix("_tree"), algorithm.endswith("_tree")
    spec = {"speculative_algorithm": name, "speculative_num_draft_tokens": DRAFTS}
    if tree:
        spec.update(speculative_num_draft_tokens=6, speculative_eagle_topk=2,
                    speculative_num_steps=3)  # fmt: skip
    if name == "standalone":
        spec["speculative_draft_model_path"] = path
    got = generate(**spec)
    assert replays and max(replays) <= 8
    assert got == want
