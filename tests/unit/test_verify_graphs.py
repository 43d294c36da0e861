"""VerifyGraphRunner on CPU: speculative verify steps replayed through the strict eager graph
double (tests/runner_batches.py), the Triton backend in the interpreter and a tiny model,
against the eager forward; then engines with n-gram and draft-model speculation whose verify
steps replay, against plain decoding.

What a real capture adds (fixed addresses, no Python on replay) is checked on the GPU by
tests/gpu/test_cuda_graph_gpu.py's verify cases.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernels.testing import triton_test_device

DEVICE, SKIP_REASON = triton_test_device()  # before anything imports triton
if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from engine.config import EngineArgs, ModelConfig  # noqa: E402
from engine.cuda_graph_runner import EagerGraphCapturer  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.speculative.verify_graphs import (  # noqa: E402
    VERIFY_GRAPH_MAX_BS,
    VerifyGraphRunner,
    verify_graph_sizes,
)
from tests.factories import tiny_model  # noqa: E402
from tests.runner_batches import (  # noqa: E402
    StrictEagerCapturer,
    decode_batch,
    eager_forward,
    kv_restore,
    kv_snapshot,
    verify_batch,
)

SIZES = (1, 2, 4)
WIDTH = 4  # three drafts a request at most


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    path = tiny_model("llama")
    args = EngineArgs(
        model_path=path,
        device=DEVICE,
        attention_backend="triton",
        max_total_tokens=2048,
        max_running_requests=8,
        cuda_graph_bs=SIZES,
        disable_cuda_graph=True,  # tests switch them on
    )
    runner = ModelRunner(ModelConfig.from_pretrained(path), args)
    gen = torch.Generator().manual_seed(0)
    for k, v in zip(runner.kv_pool.k_buffer, runner.kv_pool.v_buffer):  # a context to attend
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return runner


@pytest.fixture(scope="module")
def graphs(runner: ModelRunner) -> VerifyGraphRunner:
    graphs = VerifyGraphRunner(runner, SIZES, WIDTH, capturer=StrictEagerCapturer())
    graphs.capture()
    return graphs


def test_sizes():
    assert verify_graph_sizes((1, 2, 4, 8)) == (1, 2, 4, 8)
    decode = EngineArgs("m").resolved_cuda_graph_bs  # up to 256
    sizes = verify_graph_sizes(decode)
    assert sizes[-1] == VERIFY_GRAPH_MAX_BS and set(sizes) <= set(decode)
    assert verify_graph_sizes((1, 100)) == (1, VERIFY_GRAPH_MAX_BS)
    with pytest.raises(ValueError, match="width"):
        VerifyGraphRunner(None, SIZES, 1)


def _replayed(graphs, runner, fb):
    saved = kv_snapshot(runner)
    logits = graphs.replay(fb).float().clone()
    after = kv_snapshot(runner)
    kv_restore(runner, saved)
    return logits, after


@pytest.mark.parametrize(
    "rows,prefix_lens,draft_lens",
    [
        ([3], [20], [3]),  # one request, every draft: no padding token
        ([5, 1], [7, 33], [3, 3]),  # two, full: the graph of 2, logits a view
        ([3, 0, 2], [40, 1, 13], [3, 0, 2]),  # padded tokens and a padded request (3 in 4)
        ([6], [9], [1]),  # padded tokens in the graph of 1
        ([0, 4, 2, 7], [5, 60, 11, 2], [0, 1, 2, 0]),  # the graph of 4, mostly padding
    ],
)
def test_replay_matches_eager(runner, graphs, rows, prefix_lens, draft_lens):
    """Logits of every real token (in the batch's order) and the KV pool after the step equal
    the eager forward's, wherever the graph pads; slot 0, where padding writes, excepted."""
    fb = verify_batch(runner, rows, prefix_lens, draft_lens, seed=len(rows))
    want, want_kv = eager_forward(runner, fb)
    bs = graphs.padded_size(len(rows))
    before = graphs.graphs[bs].num_replays
    got, got_kv = _replayed(graphs, runner, fb)
    assert graphs.graphs[bs].num_replays == before + 1
    assert got.shape == (sum(draft_lens) + len(rows), runner.model_config.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for g, w in zip(got_kv, want_kv):
        torch.testing.assert_close(g[1:], w[1:], atol=1e-4, rtol=1e-4)


def test_a_replay_leaves_nothing_for_the_next(runner, graphs):
    """A batch replayed after a larger one in the same graph (its padding rewritten) gives the
    logits it gives alone: nothing of the earlier batch's tokens, slots or lengths remains."""
    small = verify_batch(runner, [2], [30], [1], seed=7)
    want, _ = eager_forward(runner, small)
    big = verify_batch(runner, [4, 5, 6, 7], [50, 3, 17, 8], [3, 3, 3, 3], seed=8)
    _replayed(graphs, runner, big)
    big2 = verify_batch(runner, [4, 5], [50, 3], [3, 3], seed=9)  # the graph of 2, full rows
    _replayed(graphs, runner, big2)
    got, _ = _replayed(graphs, runner, small)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_prefix_lengths_are_computed_in_the_graph(runner, graphs):
    """The extend kernel's prefix lengths are the graph's own buffer, rewritten by the replayed
    step from the static lengths (a real graph runs no Python to refresh them)."""
    fb = verify_batch(runner, [1, 2], [12, 40], [2, 3], seed=3)
    _replayed(graphs, runner, fb)
    md = runner.attn_backend.metadata
    assert md.prefix_lens.tolist() == [12, 40]
    own = runner.attn_backend._verify_metadata[2].prefix_lens
    assert md.prefix_lens.data_ptr() == own.data_ptr()
    assert md.max_extend_len == WIDTH


def test_can_run(runner, graphs):
    ok = verify_batch(runner, [1, 2], [10, 10], [3, 0])
    assert graphs.can_run(ok)
    too_many_drafts = verify_batch(runner, [1], [10], [4])
    assert not graphs.can_run(too_many_drafts)
    too_many_requests = verify_batch(runner, [0, 1, 2, 3, 4], [5] * 5, [1] * 5)
    assert not graphs.can_run(too_many_requests)
    assert not graphs.can_run(decode_batch(runner, [1], [10]))
    plain_extend = verify_batch(runner, [1], [10], [2])
    plain_extend.spec_draft_lens = None
    assert not graphs.can_run(plain_extend)
    cols = int(runner.req_to_token_pool.req_to_token.shape[1])
    # a request at the end of its row (checked on the host lengths only): one draft would be
    # padded past the row's last column, three end at it
    near_end = verify_batch(runner, [1], [10], [1])
    near_end.seq_lens_cpu = [cols - 1]
    assert not graphs.can_run(near_end)
    at_end = verify_batch(runner, [1], [10], [3])
    at_end.seq_lens_cpu = [cols]
    assert graphs.can_run(at_end)


def test_model_runner_routes_verify_steps_to_their_graphs(runner):
    """With graphs on, `ModelRunner.forward` replays a verify step from the verify graphs
    (captured with the decode graphs when the runner has a verify width: speculation's, or a
    draft model's) and a plain extend eagerly."""
    assert runner.verify_graph_width is None  # (no speculation)
    runner.verify_graph_width = 5
    runner.use_cuda_graph = True
    runner.graph_capturer_factory = lambda device: EagerGraphCapturer()
    try:
        runner.capture_cuda_graphs()
        verify_graphs = runner.verify_graph_runner
        assert verify_graphs is not None and verify_graphs.width == 5
        fb = verify_batch(runner, [1, 2, 3], [9, 21, 4], [2, 4, 0], seed=11)
        want, _ = eager_forward(runner, fb)
        saved = kv_snapshot(runner)
        got = runner.forward(fb).float()
        kv_restore(runner, saved)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert verify_graphs.graphs[4].num_replays == 1
        fb.spec_draft_lens = None  # the same tokens as a plain extend: eager
        runner.forward(fb)
        kv_restore(runner, saved)
        assert verify_graphs.graphs[4].num_replays == 1
    finally:
        runner.verify_graph_width = None
        runner.use_cuda_graph = False
        runner.graph_runner = runner.verify_graph_runner = None


# -- engines: verify steps replayed, tokens as plain decoding's -----------------------------------
def _generate(path: str, graphs: bool, **kw: object) -> tuple[list, dict, int]:
    from engine.engine import Engine

    engine = Engine(
        model_path=path, device=DEVICE, attention_backend="triton", max_total_tokens=1024,
        disable_overlap_schedule=True, skip_tokenizer_init=True, cuda_graph_bs=(1, 2, 4),
        disable_cuda_graph=True, **kw,  # (on a GPU too: no real graphs are captured)
    )  # fmt: skip
    runner = engine.scheduler.model_runner
    drafter = engine.scheduler.drafter
    draft = getattr(drafter, "runner", None)  # a draft model's runner: its graphs too
    for r in (runner, draft) if graphs else ():
        if r is not None:
            r.use_cuda_graph = True
            r.graph_capturer_factory = lambda device: EagerGraphCapturer()
            r.capture_cuda_graphs()
    prompts = [[5, 6, 7, 8] * 6, list(range(20, 41)), [9, 10, 11] * 5, [300, 301] * 4, [12] * 7]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
              for n in (9, 14, 6, 12, 3)]  # fmt: skip
    for p in params[:3]:  # outputs that loop, for the n-gram drafter to find
        p["allowed_token_ids"] = [11, 12, 13]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    stats = engine.get_stats()
    replays = {}
    for name, r in (("model", runner), ("draft", draft)):
        for kind in ("graph_runner", "verify_graph_runner"):
            graphs = getattr(r, kind, None)
            if graphs is not None:
                replays[f"{name} {kind}"] = sum(g.num_replays for g in graphs.graphs.values())
    engine.shutdown()
    return [o["output_ids"] for o in outs], stats, replays


@functools.cache
def _plain_tokens(path: str) -> list:
    return _generate(path, False)[0]


@pytest.mark.parametrize("algorithm", ["ngram", "standalone"])
def test_speculative_engine_replays_its_verify_steps(algorithm):
    """Greedy speculative decoding whose verify steps replay (the eager graph double) gives
    plain decoding's tokens; n-gram drafts of every length pad tokens and requests, the model
    as its own draft fills the width but near each request's end. A draft model's decode
    forwards replay its decode graphs and its catch-up extends its verify graphs, with the
    eager run's drafts (the same accepted counts)."""
    path = tiny_model("llama")
    want = _plain_tokens(path)
    spec = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": 3}
    if algorithm == "standalone":
        spec["speculative_draft_model_path"] = path
    got, stats, replays = _generate(path, True, **spec)
    assert got == want
    assert stats["spec_draft_tokens"] > 0 and replays["model verify_graph_runner"] > 0, replays
    if algorithm == "standalone":
        assert replays["draft graph_runner"] > 0 and replays["draft verify_graph_runner"] > 0
    eager, eager_stats, none = _generate(path, False, **spec)
    assert eager == want and not none
    assert eager_stats["spec_accepted_tokens"] == stats["spec_accepted_tokens"]
