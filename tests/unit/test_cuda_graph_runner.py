"""CudaGraphRunner on CPU: the replay path with the eager graph double (`EagerGraphCapturer`),
the Triton backend in the interpreter and a tiny model, against the eager forward.

What a real capture adds (fixed addresses, no Python on replay) is checked on the GPU by
tests/gpu/test_cuda_graph_gpu.py; here: bucket choice and padding, padded rows never touching
real rows (logits, KV), the backend's capture/replay hooks across batches of changing size and
membership, placeholders resolved inside the replayed step, `can_run`, the model runner's
routing and an engine run with graphs on and off.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from kernels.testing import triton_test_device

DEVICE, SKIP_REASON = triton_test_device()  # before anything imports triton
if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from engine import cuda_graph_runner  # noqa: E402
from engine.config import EngineArgs, ModelConfig  # noqa: E402
from engine.cuda_graph_runner import CudaGraphRunner, EagerGraphCapturer  # noqa: E402
from engine.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.overlap.future_map import FutureMap  # noqa: E402
from services.engine_args import add_engine_args, engine_args_from  # noqa: E402
from tests.factories import tiny_model  # noqa: E402
from tests.runner_batches import (  # noqa: E402
    OpLog,
    StrictEagerCapturer,
    decode_batch,
    eager_forward,
    kv_restore,
    kv_snapshot,
)

SIZES = (1, 2, 4, 8)
MAX_RUNNING = 12


# -- arguments ------------------------------------------------------------------------------------
def test_default_batch_sizes():
    assert EngineArgs("m").resolved_cuda_graph_bs[:6] == (1, 2, 4, 8, 16, 24)
    assert EngineArgs("m").resolved_cuda_graph_bs[-1] == 256
    assert EngineArgs("m", max_running_requests=20).resolved_cuda_graph_bs == (1, 2, 4, 8, 16, 20)
    assert EngineArgs("m", cuda_graph_max_bs=3).resolved_cuda_graph_bs == (1, 2, 3)
    assert EngineArgs("m", cuda_graph_bs=(8, 1, 8)).resolved_cuda_graph_bs == (1, 8)


def test_graphs_only_on_cuda():
    assert not EngineArgs("m", device="cpu").use_cuda_graph
    assert EngineArgs("m", device="cuda:0").use_cuda_graph
    assert not EngineArgs("m", device="cuda", disable_cuda_graph=True).use_cuda_graph


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs must be >= 1"),
        ({"cuda_graph_bs": ()}, "cuda_graph_bs must be batch sizes >= 1"),
        ({"cuda_graph_bs": (0, 4)}, "cuda_graph_bs must be batch sizes >= 1"),
        ({"cuda_graph_bs": (4, 16), "cuda_graph_max_bs": 8}, "above cuda_graph_max_bs 8"),
    ],
)
def test_bad_graph_args(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs("m", **kwargs)


def test_cli_flags():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = ["--model", "m", "--disable-cuda-graph", "--cuda-graph-max-bs", "64"]
    args = engine_args_from(parser.parse_args([*flags, "--cuda-graph-bs", "16", "1", "4"]))
    assert args.disable_cuda_graph and args.cuda_graph_max_bs == 64
    assert args.cuda_graph_bs == (1, 4, 16)
    with pytest.raises(ValueError, match="cuda_graph_bs"):
        engine_args_from(parser.parse_args(["--model", "m", "--cuda-graph-bs", "0"]))


# -- a CPU model runner with hand-built decode batches ----------------------------------------
@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    path = tiny_model("llama")  # 2 layers, 4 query heads over 2 KV heads, head_dim 16
    args = EngineArgs(
        model_path=path,
        device=DEVICE,
        attention_backend="triton",
        max_total_tokens=2048,
        max_running_requests=MAX_RUNNING,
        cuda_graph_bs=SIZES,
        disable_cuda_graph=True,  # as on CPU when this runs on a GPU; tests switch them on
    )
    runner = ModelRunner(ModelConfig.from_pretrained(path), args)
    gen = torch.Generator().manual_seed(0)
    for k, v in zip(runner.kv_pool.k_buffer, runner.kv_pool.v_buffer):  # a context to attend
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return runner


def test_strict_double_rejects_host_dependent_steps():
    host_len = [3]
    graph = StrictEagerCapturer().capture(lambda: torch.zeros(host_len[0]).sum())
    graph.replay()
    host_len[0] = 4  # a real graph would still compute over 3
    with pytest.raises(AssertionError, match="other ops"):
        graph.replay()


def _graphs(runner: ModelRunner, future_map: FutureMap | None = None) -> CudaGraphRunner:
    graphs = CudaGraphRunner(runner, SIZES, future_map, capturer=StrictEagerCapturer())
    graphs.capture()
    return graphs


_decode_batch, _kv, _restore, _eager = decode_batch, kv_snapshot, kv_restore, eager_forward


def _assert_same_kv(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Equal everywhere but slot 0, where padded rows write (new tokens' K/V to rounding: a
    matmul over a padded batch may add in another order)."""
    for g, w in zip(got, want):
        torch.testing.assert_close(g[1:], w[1:], atol=1e-4, rtol=1e-4)


# -- replay ---------------------------------------------------------------------------------------
def test_padded_size(runner):
    graphs = CudaGraphRunner(runner, (4, 1, 8, 2), capturer=EagerGraphCapturer())
    assert graphs.batch_sizes == [1, 2, 4, 8]
    assert [graphs.padded_size(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


def test_padding_row_is_reserved(runner):
    pool = runner.req_to_token_pool
    assert runner.padding_req_row == pool.size == MAX_RUNNING + 1
    assert pool.req_to_token.shape[0] == pool.size + 1
    rows = pool.alloc(pool.size)
    assert rows is not None and runner.padding_req_row not in rows
    pool.free(rows)
    assert pool.available_size() == pool.size


def _packed(fb: ForwardBatch) -> ForwardBatch:
    """The batch as `ModelRunner.build_forward_batch` makes a decode batch: its four
    per-request inputs are the rows of one tensor (`decode_rows`), loaded with one copy."""
    rows = torch.stack([fb.req_pool_indices, fb.seq_lens, fb.input_ids, fb.positions])
    fb.req_pool_indices, fb.seq_lens, fb.input_ids, fb.positions = rows.unbind(0)
    fb.decode_rows = rows
    assert cuda_graph_runner._packed(fb)
    return fb


@pytest.mark.parametrize("packed", [False, True])
def test_replay_matches_eager(runner, packed):
    """Batches of changing size, rows and lengths through one set of graphs: each replay
    equals the eager forward (logits, and the KV it writes), whatever the previous batch
    left in the static buffers; with the inputs given one by one and packed as rows."""
    graphs = _graphs(runner)
    cases = [
        ([3, 0, 7], [40, 1, 130]),  # padded to 4
        ([5], [77]),
        ([1, 2, 3, 4, 6, 8, 9, 10], [2, 9, 33, 64, 65, 3, 100, 17]),  # exactly 8
        ([11, 0, 7, 2, 6], [5, 60, 129, 18, 2]),  # padded to 8 after a full batch
        ([9, 4], [31, 7]),
    ]
    for seed, (rows, seq_lens) in enumerate(cases):
        fb = _decode_batch(runner, rows, seq_lens, seed)
        want_logits, want_kv = _eager(runner, fb)
        if packed:
            fb = _packed(fb)
        saved = _kv(runner)
        assert graphs.can_run(fb)
        got = graphs.replay(fb)
        assert got.shape == want_logits.shape
        torch.testing.assert_close(got, want_logits, atol=1e-4, rtol=1e-4)
        _assert_same_kv(_kv(runner), want_kv)
        _restore(runner, saved)
        n, bs = len(rows), graphs.padded_size(len(rows))
        assert graphs.seq_lens[n:bs].tolist() == [1] * (bs - n)  # the fill value
        assert graphs.req_pool_indices[n:bs].tolist() == [runner.padding_req_row] * (bs - n)
        assert graphs.out_cache_loc[n:bs].tolist() == [0] * (bs - n)
        assert graphs.input_ids[n:bs].tolist() == graphs.positions[n:bs].tolist() == [0] * (bs - n)
    assert sum(g.num_replays for g in graphs.graphs.values()) == len(cases)


def test_replay_with_the_layers_on_their_kernels(runner, monkeypatch):
    """The layers' kernels inside the graphs (as on CUDA; the interpreter here): the rotary
    kernel writes each layer's K/V through the graph's static slots (padded rows to slot 0),
    and the replays give the eager torch layers' logits and KV."""
    import kernels.jit

    cases = [([3, 0, 7], [40, 1, 130]), ([5], [77]), ([11, 0, 7, 2, 6], [5, 60, 129, 18, 2])]
    wants = [_eager(runner, _decode_batch(runner, rows, lens, seed))
             for seed, (rows, lens) in enumerate(cases)]  # fmt: skip
    import engine.layers.rotary as rotary

    monkeypatch.setattr(kernels.jit, "compiled_on", lambda x: True)
    monkeypatch.setattr(kernels.jit, "_LAYER_KERNELS", [True])
    stores: list[int] = []
    real = rotary.apply_rotary
    monkeypatch.setattr(rotary, "apply_rotary",
                        lambda *a: stores.append(len(a) == 5) or real(*a))  # fmt: skip
    graphs = _graphs(runner)
    for seed, ((rows, lens), (want_logits, want_kv)) in enumerate(zip(cases, wants)):
        fb = _decode_batch(runner, rows, lens, seed)
        saved = _kv(runner)
        stores.clear()
        got = graphs.replay(fb)
        assert stores == [True, True]  # each layer's rotary wrote its K/V
        torch.testing.assert_close(got, want_logits, atol=1e-4, rtol=1e-4)
        _assert_same_kv(_kv(runner), want_kv)
        _restore(runner, saved)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_logits_written_once_into_the_graph_buffer(dtype):
    """The replayed step's lm_head writes the logits into the graph's buffer, in the model's
    dtype, and nothing copies or converts them after: at batch 256 with GPT-2's vocabulary
    the float32 conversion and its copy into a float32 buffer were 45 + 47 us of a 1.8 ms
    step on the H100. Against the eager forward (float32 logits)."""
    path = tiny_model("llama")
    args = EngineArgs(model_path=path, device=DEVICE, attention_backend="triton", dtype=dtype,
                      max_total_tokens=512, max_running_requests=4, cuda_graph_bs=(4,),
                      disable_cuda_graph=True)  # fmt: skip
    runner = ModelRunner(ModelConfig.from_pretrained(path), args)
    vocab = runner.model_config.vocab_size
    graphs = _graphs(runner)
    assert graphs.logits.dtype == runner.dtype
    fb = _decode_batch(runner, [3, 0, 2], [40, 1, 13], seed=5)
    want, _ = _eager(runner, fb)
    with OpLog() as log:
        got = graphs.replay(fb)
    names = [str(func.overloadpacket.__name__) for func, _, _ in log.ops]
    copies = [
        (name, args)
        for name, (_, args, _) in zip(names, log.ops)
        if name in ("copy_", "_to_copy", "clone")
        and any(isinstance(a, tuple) and a[:1] == (torch.Size([4, vocab]),) for a in args)
    ]
    assert copies == []
    assert "mm" in names
    assert got.dtype == runner.dtype and got.shape == (3, vocab)
    assert got.data_ptr() == graphs.logits.data_ptr()
    tol = 1e-4 if dtype == "float32" else 2e-2  # (a padded batch's matmul may round apart)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_graph_logits_stay_float32_with_a_soft_cap():
    """A soft-capped model's (Gemma 2's) logits are capped in float32: its graph buffer is
    float32, written by the capping's conversion, as the eager forward computes them."""
    from engine.layers.logits import LogitsProcessor

    assert LogitsProcessor(8, soft_cap=30.0).graph_logits_dtype(torch.bfloat16) == torch.float32
    assert LogitsProcessor(8).graph_logits_dtype(torch.bfloat16) == torch.bfloat16
    assert LogitsProcessor(8).graph_logits_dtype(torch.float64) == torch.float32


def test_padded_rows_do_not_change_real_rows(runner):
    """Three requests give the same logits from a graph of exactly 3 rows and from one of 8
    (5 padded rows)."""
    fb = _decode_batch(runner, [2, 5, 8], [20, 90, 7], seed=11)
    exact = CudaGraphRunner(runner, (3,), capturer=EagerGraphCapturer())
    exact.capture()
    want = exact.replay(fb).clone()
    padded = CudaGraphRunner(runner, (8,), capturer=EagerGraphCapturer())
    padded.capture()
    torch.testing.assert_close(padded.replay(fb), want, atol=1e-4, rtol=1e-4)


def test_backend_hooks_see_the_padded_static_batch(runner, monkeypatch):
    """The replay hook (outside the graph), then the prologue (the graph's first step: the
    eager double runs it again at each replay), both over the padded static buffers."""
    graphs = _graphs(runner)
    seen = []
    backend = runner.attn_backend

    def spy(name):
        hook = getattr(backend, name)

        def spied(fb: ForwardBatch) -> None:
            seen.append((name, fb.batch_size, list(fb.seq_lens_cpu)))
            assert fb.seq_lens.data_ptr() == graphs.seq_lens.data_ptr()  # the static buffer
            hook(fb)

        monkeypatch.setattr(backend, name, spied)

    spy("init_forward_metadata_replay_cuda_graph")
    spy("cuda_graph_prologue")
    graphs.replay(_decode_batch(runner, [1, 2, 3], [10, 20, 30]))
    lens = [10, 20, 30, 1]
    # the prologue is recorded: its host values are the capture's (every row padding), only
    # its device buffers hold the batch
    assert seen == [("init_forward_metadata_replay_cuda_graph", 4, lens),
                    ("cuda_graph_prologue", 4, [1] * 4)]  # fmt: skip
    assert graphs.seq_lens[:4].tolist() == lens


@pytest.mark.parametrize("packed", [False, True])
def test_placeholders_resolved_inside_the_replayed_step(runner, packed):
    """(packed: the ids replaced after packing, so the replay must not load the stale rows)"""
    fm = FutureMap(runner.req_to_token_pool.size, DEVICE)
    graphs = _graphs(runner, fm)
    fb = _decode_batch(runner, [4, 6, 1], [12, 50, 3], seed=3)
    if packed:
        fb = _packed(fb)
    real_ids = fb.input_ids.clone()
    slots = fm.alloc_future_indices(3)
    fm.store_to_map(slots, real_ids)
    want, _ = _eager(runner, fb)
    # the sampling of the previous batch stores after the capture: the graph reads the map
    fb.input_ids = torch.tensor(slots.placeholders(), dtype=torch.int64, device=DEVICE)
    assert not cuda_graph_runner._packed(fb)
    assert graphs.can_run(fb, fm)
    got = graphs.replay(fb)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert fb.input_ids.tolist() == slots.placeholders()  # the caller's ids are untouched
    assert graphs.input_ids[:3].tolist() == real_ids.tolist()  # resolved in the static buffer


def test_can_run(runner):
    fm = FutureMap(runner.req_to_token_pool.size, DEVICE)
    graphs = CudaGraphRunner(runner, SIZES, fm, capturer=EagerGraphCapturer())
    fb = _decode_batch(runner, list(range(5)), [4] * 5)
    assert not graphs.can_run(fb), "nothing is captured yet"
    graphs.capture()
    assert graphs.can_run(fb) and graphs.can_run(fb, fm)
    assert not graphs.can_run(fb, FutureMap(runner.req_to_token_pool.size, DEVICE))
    assert not graphs.can_run(_decode_batch(runner, list(range(9)), [4] * 9))  # above 8
    fb.return_all_logits = True
    assert not graphs.can_run(fb)
    fb.return_all_logits = False
    fb.forward_mode = ForwardMode.EXTEND
    assert not graphs.can_run(fb)
    fb.forward_mode = ForwardMode.DECODE
    fb.req_to_token = fb.req_to_token.clone()  # a private copy of the rows (thread executor)
    assert not graphs.can_run(fb)
    plain = CudaGraphRunner(runner, SIZES, capturer=EagerGraphCapturer())
    plain.capture()
    assert not plain.can_run(_decode_batch(runner, [1], [4]), fm), "it cannot resolve"


# -- the model runner -----------------------------------------------------------------------------
@pytest.fixture
def graph_runner(runner):
    """The runner with graphs switched on as on CUDA, recorded by the eager double."""
    runner.use_cuda_graph = True
    runner.graph_capturer_factory = lambda device: EagerGraphCapturer()
    yield runner
    runner.use_cuda_graph = False
    runner.graph_runner = None


def _num_replays(runner: ModelRunner) -> int:
    assert runner.graph_runner is not None
    return sum(g.num_replays for g in runner.graph_runner.graphs.values())


def test_model_runner_forward_routes_decode_to_graphs(graph_runner):
    runner = graph_runner
    fm = FutureMap(runner.req_to_token_pool.size, DEVICE)
    fb = _decode_batch(runner, [0, 3], [9, 40], seed=5)
    want, _ = _eager(runner, fb)
    slots = fm.alloc_future_indices(2)
    fm.store_to_map(slots, fb.input_ids)
    fb.input_ids = torch.tensor(slots.placeholders(), dtype=torch.int64, device=DEVICE)
    got = runner.forward(fb, fm)  # captures first, bound to fm
    assert runner.graph_runner is not None and runner.graph_runner.future_map is fm
    assert _num_replays(runner) == 1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    first = runner.graph_runner
    big = _decode_batch(runner, list(range(9)), [5] * 9)  # above the largest size: eager
    torch.testing.assert_close(runner.forward(big, fm), _eager(runner, big)[0])
    assert runner.graph_runner is first and _num_replays(runner) == 1
    runner.forward(_decode_batch(runner, [1], [3]))  # no map: the bound graphs serve it
    assert runner.graph_runner is first and _num_replays(runner) == 2
    other = FutureMap(runner.req_to_token_pool.size, DEVICE)
    runner.forward(_decode_batch(runner, [1], [3]), other)  # another map: captured again
    assert runner.graph_runner is not first and runner.graph_runner.future_map is other


def test_eager_forward_resolves_placeholders(runner):
    assert not runner.use_cuda_graph
    fm = FutureMap(runner.req_to_token_pool.size, DEVICE)
    fb = _decode_batch(runner, [2, 7], [15, 4], seed=8)
    want, _ = _eager(runner, fb)
    slots = fm.alloc_future_indices(2)
    fm.store_to_map(slots, fb.input_ids)
    fb.input_ids = torch.tensor(slots.placeholders(), dtype=torch.int64, device=DEVICE)
    torch.testing.assert_close(runner.forward(fb, fm), want)
    assert runner.graph_runner is None


def _generate(
    path: str, graphs: bool, sp: list[dict] | None = None, logprobs: bool = False, **kw: object
) -> tuple[list, int]:
    from engine.engine import Engine

    engine = Engine(
        model_path=path,
        device=DEVICE,
        attention_backend="triton",
        max_total_tokens=1024,
        disable_overlap_schedule=True,
        skip_tokenizer_init=True,
        cuda_graph_bs=(1, 2, 4),
        disable_cuda_graph=True,  # on a GPU too: the runner must not capture real graphs
        **kw,
    )
    runner = engine.scheduler.model_runner
    runner.use_cuda_graph = graphs
    runner.graph_capturer_factory = lambda device: EagerGraphCapturer()
    prompts = [list(range(20, 41)), [7, 8, 9], list(range(100, 160)), [11] * 5, [300]]
    # the decode batch shrinks from 5 rows (eager: above 4) to 1 as requests finish
    if sp is None:
        sp = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in range(2, 7)]
    else:
        prompts = prompts[: len(sp)]
    extra = {"return_logprob": True, "top_logprobs_num": 3} if logprobs else {}
    outs = engine.generate(input_ids=prompts, sampling_params=sp, **extra)
    replays = _num_replays(runner) if graphs else 0
    engine.shutdown()
    if logprobs:
        metas = [{k: v for k, v in o["meta_info"].items() if k != "e2e_latency"} for o in outs]
        return [(o["output_ids"], m) for o, m in zip(outs, metas, strict=True)], replays
    return [o["output_ids"] for o in outs], replays


def test_engine_tokens_with_graphs_equal_without():
    """Greedy generation through the plain loop: decode steps replayed (eager double) give
    the tokens of the eager run."""
    got, replays = _generate(tiny_model("llama"), True)
    want, _ = _generate(tiny_model("llama"), False)
    assert got == want
    assert replays > 0


def test_bfloat16_graph_logits_sample_as_the_eager_ones(monkeypatch):
    """A bfloat16 model's replayed decode steps hand the sampler bfloat16 logits (no float32
    copy in the graph); greedy, temperature (seeded) and logprob rows give the eager run's
    tokens and logprobs. Four requests of equal length: every decode batch fills the graph of
    4 exactly (no padded rows, whose matmul could round apart)."""
    from engine.sampling.sampler import Sampler

    seen = []
    call = Sampler.__call__
    monkeypatch.setattr(Sampler, "__call__", lambda self, logits, *a: seen.append(logits.dtype)
                        or call(self, logits, *a))  # fmt: skip
    sp = [{"max_new_tokens": 5, "ignore_eos": True, **p} for p in (
        {"temperature": 0}, {"temperature": 0.8, "sampling_seed": 3},
        {"temperature": 1.2, "top_p": 0.9, "sampling_seed": 4}, {"top_k": 1})]  # fmt: skip
    path = tiny_model("llama")
    got, replays = _generate(path, True, sp, logprobs=True, dtype="bfloat16")
    assert replays > 0 and torch.bfloat16 in seen
    seen.clear()
    want, _ = _generate(path, False, sp, logprobs=True, dtype="bfloat16")
    assert torch.bfloat16 not in seen
    assert got == want


def test_hybrid_window_memory_replays_over_translated_slots():
    """With hybrid sliding-window memory the windowed layers' slots are translated into the
    backend's static buffers before each replay: the tokens of the eager run without it
    (a 32-key window, prompts up to 60 tokens: window KV is freed as they decode)."""
    path = tiny_model("gemma3_text")
    kw = dict(chunked_prefill_size=128, swa_full_tokens_ratio=0.5)
    got, replays = _generate(path, True, hybrid_swa_memory=True, **kw)
    want, _ = _generate(path, False, **kw)
    assert got == want
    assert replays > 0
