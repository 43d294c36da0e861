"""The scheduler's per-step host shortcuts: fast list-to-tensor conversion, the reused sampling
info, and the packed index tensors of a forward batch, each against the plain computation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.forward_batch import ForwardMode
from engine.host_tensors import int64_rows, int64_tensor
from engine.model_runner import ModelRunner
from engine.sampling.sampling_batch_info import SamplingBatchInfo, SamplingInfoCache
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.schedule_batch import ModelWorkerBatch

# -- int64 tensors --------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[], [0], [3, -1, 2**62, -(2**63)], list(range(1000))])
def test_int64_tensor_equals_torch_tensor(values):
    got = int64_tensor(values)
    assert got.dtype == torch.int64 and got.shape == (len(values),)
    assert torch.equal(got, torch.tensor(values, dtype=torch.int64))


def test_int64_tensor_outlives_its_temporary_list():
    t = int64_tensor([i * 7 for i in range(100)])
    _ = [list(range(1000)) for _ in range(100)]  # reuse freed memory, if any was freed
    assert t.tolist() == [i * 7 for i in range(100)]


def test_int64_tensor_rejects_what_int64_cannot_hold():
    with pytest.raises(OverflowError):
        int64_tensor([2**63])
    with pytest.raises(TypeError):
        int64_tensor([1.5])


def test_int64_rows():
    rows = [[1, 2, 3], [4, 5, 6]]
    assert torch.equal(int64_rows(rows), torch.tensor(rows))
    assert int64_rows([[], []]).shape == (2, 0)
    with pytest.raises(ValueError, match="unequal"):
        int64_rows([[1, 2], [3]])


# -- sampling info cache --------------------------------------------------------------------------


def _params(n: int, **kw) -> list[SamplingParams]:
    out = [SamplingParams(temperature=0.0 if i % 2 else 0.7, top_p=0.9, **kw) for i in range(n)]
    for p in out:
        p.normalize()
    return out


def _same_info(a: SamplingBatchInfo, b: SamplingBatchInfo) -> bool:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        if not same:
            return False
    return True


def test_cache_reuses_the_info_of_the_same_requests():
    cache, params = SamplingInfoCache(), _params(5)
    first = cache.get(params, 100, "cpu")
    assert cache.get(list(params), 100, "cpu") is first and cache.hits == 1
    assert _same_info(first, SamplingBatchInfo.from_params(params, 100, "cpu"))


def test_cache_rebuilds_when_the_batch_changes():
    cache, params = SamplingInfoCache(), _params(5)
    first = cache.get(params, 100, "cpu")
    changes = [params[:4], params[1:], params[::-1], params[:2] + _params(1) + params[3:]]
    for changed in changes:
        info = cache.get(changed, 100, "cpu")
        assert info is not first
        assert _same_info(info, SamplingBatchInfo.from_params(changed, 100, "cpu"))
    assert cache.hits == 0


def test_cache_holds_its_params_so_their_identities_stay_unique():
    cache = SamplingInfoCache()
    cache.get(_params(3), 100, "cpu")  # the caller drops its list at once
    info = cache.get(_params(3, top_k=1), 100, "cpu")  # new objects: never a false hit
    assert cache.hits == 0 and info.is_all_greedy


@pytest.mark.parametrize("kind", ["seeded", "penalty"])
def test_step_dependent_infos_are_never_reused(kind):
    kw = {"sampling_seed": 5} if kind == "seeded" else {"frequency_penalty": 0.5}
    cache, params = SamplingInfoCache(), _params(3, **kw)
    outputs: list[list[int]] = [[], [], []]
    for step in range(3):
        info = cache.get(params, 100, "cpu", output_ids=outputs, input_ids=[[1]] * 3,
                         step_positions=[step] * 3)
        if kind == "seeded":
            assert info.seed_steps.tolist() == [step] * 3
        else:
            assert info.penalties is not None
        for o in outputs:
            o.append(7)
    assert cache.hits == 0


# -- packed forward batch -------------------------------------------------------------------------


class _Runner:
    device = torch.device("cpu")
    req_to_token_pool = type("Pool", (), {"req_to_token": torch.zeros(4, 8, dtype=torch.int32)})
    kv_pool = attn_backend = pooling = None
    build_forward_batch = ModelRunner.build_forward_batch


def _mwb(mode: ForwardMode) -> ModelWorkerBatch:
    extend = mode == ForwardMode.EXTEND
    return ModelWorkerBatch(
        forward_mode=mode,
        input_ids=[11, 12, 13, 14, 15] if extend else [21, -3],
        positions=[0, 1, 2, 4, 5] if extend else [7, 9],
        out_cache_loc=torch.tensor([5, 6, 7, 8, 9] if extend else [30, 31]),
        req_pool_indices=[2, 0],
        seq_lens=[3, 6] if extend else [8, 10],
        extend_prefix_lens=[0, 4] if extend else None,
        extend_seq_lens=[3, 2] if extend else None,
        sampling_params=[SamplingParams(), SamplingParams()],
        output_ids=[[], []],
        prompt_ids=[[1], [2]],
        return_logprob=False,
        top_logprobs_nums=[0, 0],
    )


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_forward_batch_tensors_equal_the_lists(mode):
    mwb = _mwb(mode)
    fb = _Runner().build_forward_batch(mwb)
    for name in ("input_ids", "positions", "req_pool_indices", "seq_lens"):
        t = getattr(fb, name)
        assert t.dtype == torch.int64 and t.tolist() == getattr(mwb, name), name
    assert fb.out_cache_loc.tolist() == mwb.out_cache_loc.tolist()
    if mode == ForwardMode.EXTEND:
        assert fb.extend_start_loc.tolist() == [0, 3]
        assert fb.extend_seq_lens.tolist() == mwb.extend_seq_lens
        assert fb.last_token_indices.tolist() == [2, 4]
        assert fb.decode_rows is None
    else:
        assert fb.extend_seq_lens is None
        # the rows a graph replay loads with one copy
        assert fb.decode_rows.tolist() == [mwb.req_pool_indices, mwb.seq_lens, mwb.input_ids,
                                           mwb.positions]  # fmt: skip
        from engine.cuda_graph_runner import _packed

        assert _packed(fb)
    fb.input_ids[1] = 99  # resolving placeholders writes in place: rows are separate
    assert fb.positions.tolist() == mwb.positions and fb.seq_lens.tolist() == mwb.seq_lens


# -- overlap loop ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seeded", [False, True])
def test_overlap_decode_of_the_batch_in_flight_skips_the_placeholder_map(seeded):
    """A decode step of the same batch as the one in flight takes its input ids straight from
    that batch's placeholders; the request -> placeholder map is built only when something
    reads it (step positions of seeded rows). Outputs are checked against the plain loop by
    tests/integration/test_overlap.py."""
    from benchmarks.overlap import NULL_VOCAB, _close, _null_scheduler, _requests

    scheduler = _null_scheduler(4, "thread", 16)
    try:
        for rid, ids, params in _requests(4, NULL_VOCAB, 16):
            if seeded:
                params = dataclasses.replace(params, temperature=1.0, sampling_seed=5)
            scheduler.add_request(rid, ids, params)
        for _ in range(4):  # prefill, then decode steps
            scheduler.step()
        record = scheduler._in_flight[-1]
        assert record.forward_mode == ForwardMode.DECODE
        scheduler.step()
        assert scheduler.last_batch.input_ids == record.placeholders
        assert all(p < 0 for p in record.placeholders)
        if seeded:
            assert scheduler._pending == dict(zip(record.reqs, record.placeholders))
        else:
            assert scheduler._pending is None
    finally:
        _close(scheduler)


def test_process_executor_sends_an_unchanged_sampling_info_once():
    """The CPU device process keeps the last info it received; the scheduler sends a marker in
    place of that very object, and the device counts an info as received even when the batch
    that carried it fails."""
    from types import SimpleNamespace

    import numpy as np

    from engine.overlap.device_process import SAME_INFO, Device
    from engine.overlap.process_executor import ProcessExecutor

    a, b = (SamplingBatchInfo.from_params([SamplingParams(temperature=t)], 64, "cpu")
            for t in (0.5, 0.9))  # fmt: skip
    ex = ProcessExecutor.__new__(ProcessExecutor)  # (no device process: only the messages)
    ex._last_info = None
    assert ex._info_message(None) is None
    sent_a = ex._info_message(a)
    assert sent_a != SAME_INFO and ex._info_message(a) == SAME_INFO
    sent_b = ex._info_message(b)
    assert sent_b != SAME_INFO and ex._info_message(a) != SAME_INFO  # a again, after b

    def failing_forward(*_):
        raise RuntimeError("the batch fails")

    runner = SimpleNamespace(device="cpu", build_forward_batch=lambda mwb: mwb,
                             forward=failing_forward)  # fmt: skip
    device = Device(runner, max_bs=4)
    mwb = SimpleNamespace(out_cache_loc=np.zeros(1, dtype=np.int64), kv_transfers=None)
    answer = device.run(("forward", 0, mwb, None, sent_b))
    assert answer[0] == "error" and "the batch fails" in answer[2]
    assert device._info(SAME_INFO) is device.last_info
    assert torch.equal(device.last_info.temperatures, b.temperatures)
