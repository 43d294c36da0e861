"""CUDA graphs for decode, captured and replayed on a GPU (Triton attention, tiny Llama).

Replays against the eager forward on the same KV state: float32 to 1e-4, bfloat16 close;
batches padded to a larger captured size; a change of batch membership between replays; the
graph reading placeholders' tokens from the FutureMap at replay time; the default size list
(35 graphs in one memory pool); and the engine's greedy tokens with graphs on and off, in the
plain and the overlap loop. The bfloat16 runner also with --enable-pdl: graphs of
programmatic dependent launches (tests/gpu/test_pdl_gpu.py: the engine's tokens with it).
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.factories import require_compiled_cuda  # noqa: E402

require_compiled_cuda()

from engine.config import EngineArgs, ModelConfig  # noqa: E402
from engine.forward_batch import ForwardBatch  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.overlap.future_map import FutureMap  # noqa: E402
from tests.factories import count_graph_replays, mixed_prompts, tiny_model  # noqa: E402
from tests.runner_batches import (  # noqa: E402
    decode_batch,
    eager_forward,
    kv_restore,
    kv_snapshot,
)

SIZES = (1, 2, 4, 8, 16, 24)


def _runner(dtype: str, **kwargs: object) -> ModelRunner:
    path = tiny_model("llama")
    kwargs = {"max_running_requests": 32, "cuda_graph_bs": SIZES, **kwargs}
    args = EngineArgs(
        model_path=path,
        device="cuda",
        dtype=dtype,
        attention_backend="triton",
        max_total_tokens=8192,
        disable_overlap_schedule=True,  # the runner captures at init
        **kwargs,  # type: ignore[arg-type]
    )
    runner = ModelRunner(ModelConfig.from_pretrained(path), args)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for buf in runner.kv_pool.k_buffer + runner.kv_pool.v_buffer:  # a context to attend
        buf.copy_(torch.randn(buf.shape, generator=gen, device="cuda", dtype=buf.dtype))
    return runner


@pytest.fixture(scope="module", params=["float32", "bfloat16", "bfloat16-pdl"])
def runner(request) -> ModelRunner:
    """(bfloat16-pdl: --enable-pdl, graphs captured with programmatic dependent launches)"""
    dtype, _, pdl = request.param.partition("-")
    return _runner(dtype, enable_pdl=bool(pdl))


_decode_batch, _kv, _restore = decode_batch, kv_snapshot, kv_restore


def _random_batch(runner: ModelRunner, n: int, seed: int) -> ForwardBatch:
    rng = random.Random(seed)
    rows = rng.sample(range(runner.req_to_token_pool.size), n)
    max_len = min(300, (runner.max_total_tokens - 1) // n)  # distinct slots for every token
    return _decode_batch(runner, rows, [rng.randint(1, max_len) for _ in rows], seed)


def _eager(runner: ModelRunner, fb: ForwardBatch) -> torch.Tensor:
    """Eager logits; the KV pool is left as it was."""
    return eager_forward(runner, fb)[0]


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        return
    # bfloat16: a padded batch may run other GEMM kernels (another summation order)
    err = (got - want).abs().max().item()
    assert err <= 0.03 * want.abs().max().item(), f"max abs error {err}"
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"greedy tokens agree on {agree:.0%} of rows"


def _replay(runner: ModelRunner, fb: ForwardBatch) -> torch.Tensor:
    graphs = runner.graph_runner
    assert graphs is not None and graphs.can_run(fb)
    saved = _kv(runner)
    logits = graphs.replay(fb).clone()
    _restore(runner, saved)
    return logits


def test_graphs_are_captured_at_init(runner):
    from kernels.jit import pdl_on

    assert pdl_on() == runner.args.enable_pdl  # (the H100 supports it)
    graphs = runner.graph_runner
    assert graphs is not None and sorted(graphs.graphs) == list(SIZES)
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g in graphs.graphs.values())


@pytest.mark.parametrize("n", [1, 3, 8, 17])
def test_replay_matches_eager(runner, n):
    fb = _random_batch(runner, n, seed=n)
    got = _replay(runner, fb)
    assert got.shape == (n, runner.model_config.vocab_size)
    _assert_close(got, _eager(runner, fb), runner.dtype)


def test_replay_after_membership_change(runner):
    """One graph (size 8) replayed for batches of other rows, lengths and sizes in turn; the
    first batch again at the end."""
    batches = [_random_batch(runner, n, seed=100 + i) for i, n in enumerate([7, 5, 8, 6])]
    batches.append(batches[0])
    for fb in batches:
        _assert_close(_replay(runner, fb), _eager(runner, fb), runner.dtype)


def test_replay_on_a_side_stream(runner):
    """As the overlap executor replays: on its forward stream."""
    fb = _random_batch(runner, 5, seed=7)
    want = _eager(runner, fb)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = _replay(runner, fb)
    torch.cuda.current_stream().wait_stream(stream)
    _assert_close(got, want, runner.dtype)


def test_placeholders_resolved_in_graph():
    runner = _runner("float32")
    fm = FutureMap(runner.req_to_token_pool.size, "cuda")
    runner.capture_cuda_graphs(fm)
    graphs = runner.graph_runner
    assert graphs is not None and graphs.future_map is fm
    fb = _random_batch(runner, 3, seed=5)
    slots = fm.alloc_future_indices(3)
    placeholders = torch.tensor(slots.placeholders(), dtype=torch.int64, device="cuda")
    for step in range(2):  # the graph reads the map's tokens at replay, stored after capture
        real_ids = torch.randint(8, runner.model_config.vocab_size, (3,), device="cuda")
        fm.store_to_map(slots, real_ids)
        fb.input_ids = real_ids.clone()
        want = _eager(runner, fb)
        fb.input_ids = placeholders.clone()
        assert graphs.can_run(fb, fm)
        torch.testing.assert_close(_replay(runner, fb), want, atol=1e-4, rtol=1e-4)
        assert torch.equal(fb.input_ids, placeholders), f"step {step}: caller's ids changed"
        assert torch.equal(graphs.input_ids[:3], real_ids)


def test_default_sizes_share_one_pool():
    """The default list up to 256 (35 graphs, largest first); a batch of 200 padded to 200,
    and one of 129 padded to 136."""
    runner = _runner("float32", max_running_requests=256, cuda_graph_bs=None)
    graphs = runner.graph_runner
    assert graphs is not None and len(graphs.graphs) == 35
    for n in (200, 129):
        fb = _random_batch(runner, n, seed=n)
        _assert_close(_replay(runner, fb), _eager(runner, fb), torch.float32)


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_greedy_tokens_with_and_without_graphs(overlap, monkeypatch):

    replays = count_graph_replays(monkeypatch)
    path = tiny_model("llama")
    prompts = mixed_prompts(ModelConfig.from_pretrained(path).vocab_size, n=12, max_len=120)
    # the decode batch shrinks from 12 rows (eager, above 8) to 1 as requests finish
    _graphs_against_eager(replays, path, prompts, overlap)


def _graphs_against_eager(replays: list[int], path: str, prompts, overlap: bool,
                          **kw: object) -> None:  # fmt: skip
    """The engine's greedy tokens with the decode graphs equal its eager ones (float32,
    Triton), the batch shrinking as requests of 4, 7, 10... tokens finish; `kw`: the
    engine's and generate's other arguments (LoRA: `lora_paths`, `lora_path`)."""
    from engine.engine import Engine

    params = [{"max_new_tokens": 4 + 3 * i, "temperature": 0, "ignore_eos": True}
              for i in range(len(prompts))]  # fmt: skip
    per_request = {k: kw.pop(k) for k in ("lora_path",) if k in kw}

    def generate(graphs: bool) -> list[list[int]]:
        engine = Engine(model_path=path, device="cuda", dtype="float32",
                        attention_backend="triton", max_total_tokens=8192,
                        disable_overlap_schedule=not overlap, disable_cuda_graph=not graphs,
                        cuda_graph_bs=(1, 2, 4, 8), skip_tokenizer_init=True,
                        **kw)  # fmt: skip
        outs = engine.generate(input_ids=prompts, sampling_params=params, **per_request)
        engine.shutdown()
        return [o["output_ids"] for o in outs]

    want = generate(graphs=False)
    assert not replays
    got = generate(graphs=True)
    assert replays and max(replays) <= 8
    assert got == want


@pytest.mark.parametrize("overlap", [False, True])
def test_lora_adapters_replay_in_graphs(monkeypatch, overlap: bool) -> None:
    """LoRA adapters in real CUDA graphs: each graph records every adapted layer over every
    slot with its static mask (a capture without it would record no delta), a replay fills
    the mask; batches mixing two adapters and the base model, shrinking through the sizes,
    give the eager engine's tokens (float32, Triton), in the plain and the overlap loop."""
    from tests.factories import tiny_lora

    replays = count_graph_replays(monkeypatch)
    path = tiny_model("llama")
    a = tiny_lora(path, 1)
    b = tiny_lora(path, 2, rank=4, targets=("q_proj", "v_proj", "down_proj"))
    prompts = mixed_prompts(ModelConfig.from_pretrained(path).vocab_size, n=7, max_len=60)
    names = [None, "a", "b", "a", None, "b", "a"]
    _graphs_against_eager(replays, path, prompts, overlap, lora_paths=(f"a={a}", f"b={b}"),
                          lora_path=names)  # fmt: skip
