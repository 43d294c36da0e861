"""Sampler: greedy equivalences, seeds, penalties, filters, distribution and logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.sampling.sampler import Sampler
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.sampling.sampling_params import SamplingParams

SP = SamplingParams


def make_info(params: list[SamplingParams], vocab: int, **kw) -> SamplingBatchInfo:
    kw.setdefault("step_positions", [0] * len(params))
    return SamplingBatchInfo.from_params(params, vocab, "cpu", **kw)


def sample(logits: torch.Tensor, params: list[SamplingParams], seed: int = 0, **kw):
    nums = kw.pop("top_logprobs_nums", None)
    ret = kw.pop("return_logprob", False)
    return Sampler(seed=seed)(logits, make_info(params, logits.shape[1], **kw), ret, nums)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def chi2_critical(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 4.75 is a 1e-6 tail."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(counts: torch.Tensor, expected_p: torch.Tensor, n: int) -> float:
    keep = expected_p > 0
    exp = expected_p[keep] * n
    return float((((counts[keep].double() - exp) ** 2) / exp).sum())


@pytest.mark.parametrize("kind", ["top_k=1", "temperature=0", "top_p=1e-6"])
def test_greedy_equivalents_give_exact_argmax_in_a_mixed_batch(kind: str) -> None:
    greedy = {
        "top_k=1": SP(top_k=1, temperature=1.3),
        "temperature=0": SP(temperature=0.0),
        "top_p=1e-6": SP(top_p=1e-6, temperature=1.5),
    }[kind]
    logits = random_logits(64, 500, seed=1)
    # Rows alternate between the greedy kind and plain high-temperature sampling.
    params = [greedy if i % 2 == 0 else SP(temperature=2.0) for i in range(64)]
    out = sample(logits, params)
    expect = logits.argmax(-1)
    assert torch.equal(out.next_token_ids[::2], expect[::2])
    assert not torch.equal(out.next_token_ids[1::2], expect[1::2])  # the others do sample
    assert out.next_token_ids.dtype == torch.int64 and out.logprobs is None


def test_all_greedy_batch_and_logits_not_modified() -> None:
    logits = random_logits(8, 50, seed=2)
    before = logits.clone()
    out = sample(logits, [SP(temperature=0.0, repetition_penalty=1.5)] * 8, output_ids=[[1]] * 8)
    assert torch.equal(logits, before)
    assert out.next_token_ids.shape == (8,)


def seeded_target_tokens(position: int, batch: int, steps: int, sampler_seed: int) -> list[int]:
    """Tokens of one seeded request over `steps` steps, placed at `position` of a batch."""
    vocab = 256
    target = SP(temperature=0.8, top_k=100, top_p=0.97, sampling_seed=1234)
    target_logits = random_logits(1, vocab, seed=3, scale=1.5)[0]
    others = [
        SP(),
        SP(temperature=0.0),
        SP(top_k=5, sampling_seed=99),
        SP(min_p=0.2, temperature=0.5),
        SP(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3),
        SP(top_p=0.5, sampling_seed=1),
    ]
    sampler = Sampler(seed=sampler_seed)
    tokens = []
    for step in range(steps):
        params = [others[(i + step) % len(others)] for i in range(batch)]
        params[position] = target
        logits = random_logits(batch, vocab, seed=100 + step)
        logits[position] = target_logits
        steps_pos = [step + i for i in range(batch)]
        steps_pos[position] = step
        outputs = [[(7 * i + step) % vocab] * 3 for i in range(batch)]
        info = SamplingBatchInfo.from_params(
            params, vocab, "cpu", output_ids=outputs, input_ids=outputs, step_positions=steps_pos
        )
        tokens.append(int(sampler(logits, info).next_token_ids[position]))
    return tokens


def test_seeded_request_is_independent_of_batch_position_and_composition() -> None:
    alone = seeded_target_tokens(position=0, batch=1, steps=16, sampler_seed=0)
    assert len(set(alone)) > 8  # it really samples, and the step changes the draw
    assert seeded_target_tokens(0, 1, 16, sampler_seed=77) == alone
    assert seeded_target_tokens(17, 50, 16, sampler_seed=5) == alone
    assert seeded_target_tokens(49, 50, 16, sampler_seed=6) == alone


def test_seed_changes_the_draws() -> None:
    logits = random_logits(1, 1000, seed=4, scale=0.5).expand(64, -1)
    a = sample(logits, [SP(sampling_seed=1)] * 64, step_positions=list(range(64)))
    b = sample(logits, [SP(sampling_seed=2)] * 64, step_positions=list(range(64)))
    assert (a.next_token_ids != b.next_token_ids).sum() > 50


def test_seeded_step_positions_default_to_output_length() -> None:
    logits = random_logits(1, 300, seed=5, scale=0.5)
    explicit = sample(logits, [SP(sampling_seed=3)], step_positions=[4])
    implied = sample(logits, [SP(sampling_seed=3)], step_positions=None, output_ids=[[1] * 4])
    assert torch.equal(explicit.next_token_ids, implied.next_token_ids)
    with pytest.raises(ValueError, match="step_positions"):
        make_info([SP(sampling_seed=3)], 300, step_positions=None)


def test_unseeded_draws_differ_but_follow_the_sampler_seed() -> None:
    logits = torch.zeros(64, 1000)
    params = [SP()] * 64
    info = make_info(params, 1000)
    sampler = Sampler(seed=11)
    first = sampler(logits, info).next_token_ids
    second = sampler(logits, info).next_token_ids
    assert (first != second).sum() > 50
    assert torch.equal(Sampler(seed=11)(logits, info).next_token_ids, first)


def reference_penalties(
    row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams
) -> torch.Tensor:
    out = row.clone()
    for t in set(prompt) | set(output):
        r = p.repetition_penalty
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t, c in Counter(output).items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_penalties_match_a_per_request_python_computation() -> None:
    vocab = 12
    logits = torch.tensor([[3.0, -2.0, 1.5, -0.5, 0.0, 2.5, -4.0, 1.0, 0.7, -1.2, 2.0, 0.3]] * 6)
    prompts = [[0, 1, 2], [0, 1, 2], [3, 3], [5], [0, 1, 9], [4]]
    outputs = [[2, 5, 5, 6], [1, 1, 7], [3, 8, 8, 8], [5, 10], [1, 6, 6, 10, 11], []]
    params = [
        SP(temperature=0.0, repetition_penalty=1.7),
        SP(temperature=0.0, repetition_penalty=0.6),  # < 1 rewards repeats
        SP(temperature=0.0, frequency_penalty=0.9),
        SP(temperature=0.0, presence_penalty=1.4),
        SP(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.8),
        SP(temperature=0.0),  # no penalty inside a penalised batch
    ]
    info = make_info(params, vocab, output_ids=outputs, input_ids=prompts)
    assert info.penalties is not None
    got = info.penalties.apply(logits)
    for i, p in enumerate(params):
        want = reference_penalties(logits[i], prompts[i], outputs[i], p)
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
    out = Sampler()(logits, info, True, None)
    assert torch.equal(out.next_token_ids, got.argmax(-1))
    torch.testing.assert_close(
        out.logprobs, got.log_softmax(-1).gather(1, got.argmax(-1)[:, None])[:, 0]
    )


def test_no_penalty_tensors_without_penalties() -> None:
    info = make_info(
        [SP(), SP(temperature=0.0)], 50, output_ids=[[1, 2], [3]], input_ids=[[4], [5]]
    )
    assert info.penalties is None


@pytest.mark.parametrize("sorted_path", [False, True])
def test_min_p_keeps_exactly_the_tokens_above_the_threshold(sorted_path: bool) -> None:
    probs = torch.tensor([0.4, 0.2, 0.11, 0.09, 0.08, 0.06, 0.04, 0.02])
    n = 20000
    params = [SP(min_p=0.25)] * n  # threshold 0.25 * 0.4 = 0.1: keeps tokens 0, 1, 2
    if sorted_path:
        params[-1] = SP(top_k=3)  # one row that needs a sort sends the batch down that path
    info = make_info(params, 8)
    assert info.need_top_k == sorted_path
    out = Sampler(seed=3)(probs.log().expand(n, -1), info, False, None)
    counts = torch.bincount(out.next_token_ids[:-1], minlength=8)
    assert counts[3:].sum() == 0 and (counts[:3] > 0).all()
    expect = torch.tensor([0.4, 0.2, 0.11, 0, 0, 0, 0, 0], dtype=torch.float64) / 0.71
    assert chi2(counts, expect, n - 1) < chi2_critical(2)


def truncated_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Softmax(logits / T), smallest prefix (by probability) with mass >= top_p, renormalised."""
    p = torch.softmax(logits.double() / temperature, -1)
    sorted_p, order = p.sort(descending=True)
    mass_before = sorted_p.cumsum(0) - sorted_p
    keep_sorted = mass_before < top_p
    n_keep = int(keep_sorted.sum())
    # The cut must not sit within float32 rounding of top_p, or the test would be fragile.
    assert mass_before[n_keep - 1] < top_p - 0.01 and sorted_p[:n_keep].sum() > top_p + 0.01
    out = torch.zeros_like(p)
    out[order[:n_keep]] = sorted_p[:n_keep]
    return out / out.sum()


DIST_LOGITS = torch.tensor([1.2, -0.3, 0.8, 2.0, -1.5, 0.1, 1.7, -0.7, 0.5, 1.0, -2.2, 0.0])


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_top_p_distribution_matches_analytic(seeded: bool) -> None:
    n, temperature, top_p = 20000, 0.7, 0.9
    expect = truncated_distribution(DIST_LOGITS, temperature, top_p)
    if seeded:  # every row its own seed: checks the counter-based hash is a fair source
        params = [SP(temperature=temperature, top_p=top_p, sampling_seed=s) for s in range(n)]
    else:
        params = [SP(temperature=temperature, top_p=top_p)] * n
    out = sample(DIST_LOGITS.expand(n, -1), params, seed=123)
    counts = torch.bincount(out.next_token_ids, minlength=12)
    assert counts[expect == 0].sum() == 0, "a token outside top-p was sampled"
    df = int((expect > 0).sum()) - 1
    assert chi2(counts, expect, n) < chi2_critical(df)


def test_one_seed_over_many_steps_follows_the_distribution() -> None:
    n, temperature = 20000, 1.3
    params = [SP(temperature=temperature, sampling_seed=2024)] * n
    out = sample(DIST_LOGITS.expand(n, -1), params, step_positions=list(range(n)))
    counts = torch.bincount(out.next_token_ids, minlength=12)
    full = torch.softmax(DIST_LOGITS.double() / temperature, -1)
    assert chi2(counts, full, n) < chi2_critical(11)


def test_logprobs_are_log_softmax_after_temperature_before_filters() -> None:
    logits = random_logits(4, 200, seed=6)
    params = [SP(temperature=0.5, top_k=5), SP(top_p=0.3), SP(temperature=2.0), SP(temperature=0)]
    out = sample(logits, params, return_logprob=True, top_logprobs_nums=[0, 3, 5, 1])
    temps = torch.tensor([[0.5], [1.0], [2.0], [1.0]])
    full = torch.log_softmax(logits / temps, -1)
    want = full.gather(1, out.next_token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs, want)
    assert out.top_logprobs is not None and out.top_logprobs[0] == ([], [])
    for i, k in enumerate([0, 3, 5, 1]):
        ids, values = out.top_logprobs[i]
        assert len(ids) == len(values) == k
        assert values == sorted(values, reverse=True)
        assert ids == full[i].topk(k).indices.tolist()
        torch.testing.assert_close(torch.tensor(values), full[i, ids])


def test_top_logprobs_absent_unless_asked_and_finite_on_masked_logits() -> None:
    logits = random_logits(2, 30, seed=7)
    logits[:, 10:] = float("-inf")
    assert (
        sample(logits, [SP()] * 2, return_logprob=True, top_logprobs_nums=[0, 0]).top_logprobs
        is None
    )
    assert sample(logits, [SP()] * 2, top_logprobs_nums=[2, 2]).top_logprobs is None
    out = sample(logits, [SP()] * 2, return_logprob=True, top_logprobs_nums=[30, 1])
    assert out.top_logprobs is not None
    assert all(math.isfinite(v) for v in out.top_logprobs[0][1])
    assert (out.next_token_ids < 10).all()


def test_logit_bias_forces_and_bans_tokens_per_row_and_counts_in_logprobs() -> None:
    """OpenAI's logit_bias: added to the row's logits before greedy, sampling and logprobs;
    other rows and the caller's logits are untouched."""
    logits = random_logits(4, 32, seed=5)
    before = logits.clone()
    argmax = logits.argmax(-1)
    ban = str(int(argmax[1]))
    params = [
        SP(temperature=0.0, logit_bias={"7": 100.0}),  # greedy, forced to 7
        SP(temperature=0.0, logit_bias={ban: -100.0}),  # greedy, its argmax banned
        SP(temperature=1.0, sampling_seed=3, logit_bias={"11": 100.0, "12": -5.0}),
        SP(temperature=0.0),
    ]
    out = sample(logits, params, return_logprob=True)
    assert torch.equal(logits, before)
    ids = out.next_token_ids.tolist()
    assert ids[0] == 7 and ids[2] == 11 and ids[3] == int(argmax[3])
    biased = logits[1].clone()
    biased[int(ban)] -= 100.0
    assert ids[1] == int(biased.argmax()) != int(argmax[1])
    assert out.logprobs[0] == pytest.approx(0.0, abs=1e-6)  # 7 holds all the mass
    want = torch.log_softmax(biased, -1)[ids[1]]
    assert out.logprobs[1] == pytest.approx(float(want), abs=1e-5)
    info = make_info(params, 32)
    assert info.bias_rows.tolist() == [0, 1, 2, 2] and info.bias_ids.tolist()[2:] == [11, 12]
    assert make_info([SP()], 32).bias_rows is None


def test_allowed_token_ids_limit_each_rows_choice_and_logprobs() -> None:
    """vLLM's allowed_token_ids: a row samples (greedy or not) only among its tokens, its
    logprobs are the softmax over them; rows without the list are untouched."""
    vocab = 40
    logits = random_logits(3, vocab, seed=9)
    before = logits.clone()
    greedy_allowed = [3, 17, 21]
    params = [
        SP(temperature=0.0, allowed_token_ids=greedy_allowed),
        SP(temperature=1.0, sampling_seed=5, allowed_token_ids=[2, 30]),
        SP(temperature=0.0),
    ]
    seen = set()
    for step in range(40):
        out = sample(logits, params, return_logprob=True, top_logprobs_nums=[5, 2, 0],
                     step_positions=[step] * 3)  # fmt: skip
        ids = out.next_token_ids.tolist()
        best = max(greedy_allowed, key=lambda t: float(logits[0, t]))
        assert ids[0] == best and ids[1] in (2, 30) and ids[2] == int(logits[2].argmax())
        seen.add(ids[1])
        want = torch.log_softmax(logits[0, greedy_allowed], -1).max()
        assert out.logprobs[0] == pytest.approx(float(want), abs=1e-5)
        top_ids, top_lps = out.top_logprobs[0]
        assert set(top_ids[:3]) == set(greedy_allowed) and max(top_lps[3:]) < -1e30
    assert seen == {2, 30}  # both drawn over the steps
    assert torch.equal(logits, before)
    info = make_info(params, vocab)
    assert info.allowed_rows.tolist() == [0, 1] and info.allowed.sum(1).tolist() == [3, 2]
    assert make_info([SP()], vocab).allowed_rows is None
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SP(allowed_token_ids=[1, 40]).verify(vocab)
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SP(allowed_token_ids=[]).verify(vocab)


def test_min_new_tokens_bans_eos_and_stop_tokens_below_the_minimum_only() -> None:
    from engine.sampling.sampling_batch_info import SamplingInfoCache

    vocab, eos = 16, (2, 3)
    params = [
        SamplingParams(temperature=0.0, min_new_tokens=4, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, min_new_tokens=4, ignore_eos=True, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, min_new_tokens=4),
        SamplingParams(temperature=0.0),
    ]
    logits = torch.zeros(4, vocab)
    logits[:, [2, 3, 7]] = 10.0  # the stops lead; next best: token 9
    logits[:, 9] = 5.0
    info = SamplingBatchInfo.from_params(params, vocab, "cpu", step_positions=[3, 3, 4, 0],
                                         eos_token_ids=eos)  # fmt: skip
    biased = info.apply_logit_bias(logits)
    assert torch.isinf(biased[0, [2, 3, 7]]).all()  # EOS and its stop token, still at 3 < 4
    assert torch.isinf(biased[1, 7]) and not torch.isinf(biased[1, [2, 3]]).any()  # ignore_eos
    assert not torch.isinf(biased[2:]).any()  # at its minimum; no minimum
    ids = Sampler(seed=0)(logits, info).next_token_ids.tolist()
    assert ids[0] == 9 and ids[1] in (2, 3) and ids[2] in (2, 3, 7)
    # step-dependent: never reused by the cache
    cache = SamplingInfoCache()
    kwargs = {"step_positions": [0, 0, 0, 0], "eos_token_ids": eos}
    cache.get(params, vocab, "cpu", **kwargs)
    cache.get(params, vocab, "cpu", **kwargs)
    assert cache.hits == 0
    with pytest.raises(ValueError, match="min_new_tokens needs step_positions"):
        SamplingBatchInfo.from_params(params, vocab, "cpu", eos_token_ids=eos)


def test_prompt_logprob_ranks_count_the_tokens_at_least_as_likely(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """vLLM's rank of each scored prompt token: 1 + how many others have a logprob at least
    as high (ties rank the token below them), across row slices and requests."""
    from types import SimpleNamespace

    from engine.sampling import sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "PROMPT_LOGPROB_SLICE", 3)  # several slices
    vocab = 50
    logits = random_logits(7, vocab, seed=4).round()  # rounded: many ties
    targets = [0, 5, 9, 17, 30, 49, 2]
    params = [SP(temperature=1.0), SP(temperature=0.5)]
    mwb = SimpleNamespace(
        prompt_logprob_counts=[4, 3], prompt_logprob_targets=targets, top_logprobs_nums=[2, 0],
        prompt_ranks=False,
    )  # fmt: skip
    info = make_info(params, vocab)
    unranked = sampler_mod.prompt_logprobs(logits, info, mwb)  # type: ignore[arg-type]
    assert [entry[2] for entry in unranked] == [None, None]  # not asked for: not computed
    mwb.prompt_ranks = True
    out = sampler_mod.prompt_logprobs(logits, info, mwb)  # type: ignore[arg-type]
    assert [entry[:2] for entry in out] == [entry[:2] for entry in unranked]
    temps = torch.tensor([1.0] * 4 + [0.5] * 3).unsqueeze(1)
    ref = torch.log_softmax(logits.double() / temps, dim=-1)
    want_ranks = [int((ref[r] >= ref[r, t]).sum()) for r, t in enumerate(targets)]
    assert out[0][2] == want_ranks[:4] and out[1][2] == want_ranks[4:]
    assert any(r > 1 for r in want_ranks) and any(
        int((ref[r] == ref[r, t]).sum()) > 1 for r, t in enumerate(targets)
    )  # the case has ranks below the best, and ties
    for (_lps, top, ranks), rows in ((out[0], range(4)),):
        assert top is not None
        for (ids, _vals), r, rank in zip(top, rows, ranks, strict=True):
            if rank <= 2 and ref[r].eq(ref[r, targets[r]]).sum() == 1:
                assert ids[rank - 1] == targets[r]  # ranked k: it is the k-th best


class _Conversions(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that copy a tensor of `shape` (a float32 conversion is one)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape, self.seen = torch.Size(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in ("_to_copy", "copy_", "clone") and any(
            isinstance(a, torch.Tensor) and a.shape == self.shape for a in args
        ):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


CASES_16BIT = {
    "greedy": ([SP(temperature=0.0)] * 6, {}),
    "temperature": ([SP(temperature=0.0), SP(temperature=0.8), SP(temperature=1.3, top_p=0.9),
                     SP(temperature=1.0, sampling_seed=5), SP(top_k=3), SP(min_p=0.2)], {}),
    "greedy_logprobs": ([SP(temperature=0.0)] * 6,
                        {"return_logprob": True, "top_logprobs_nums": [2, 0, 0, 0, 0, 1]}),
    "logprobs": ([SP(temperature=0.0)] * 3 + [SP(temperature=0.7)] * 3,
                 {"return_logprob": True, "top_logprobs_nums": [0, 3, 0, 2, 0, 5]}),
    "penalties": ([SP(temperature=0.0, frequency_penalty=0.9)] + [SP(temperature=0.0)] * 5,
                  {"output_ids": [[1, 2]] * 6, "input_ids": [[4]] * 6}),
    "logit_bias": ([SP(temperature=0.0, logit_bias={"7": 2.5})] + [SP(temperature=0.9)] * 5,
                   {"return_logprob": True}),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES_16BIT)
def test_16bit_logits_sample_as_their_float32_values(case: str) -> None:
    """A CUDA graph hands the sampler its 16-bit logits (rows strided where its buffer is
    padded: engine/cuda_graph_runner.py). Every path gives what the same values in float32
    give (the argmax, the draws, seeded or not, the logprobs: equal), and a batch whose
    logits nothing changes is not converted (greedy: the argmax of the 16-bit rows; a
    temperature's division converts as it reads)."""
    params, kw = CASES_16BIT[case]
    buffer = torch.zeros(6, 320, dtype=torch.bfloat16)
    buffer[:, :300] = random_logits(6, 300, seed=8)
    logits = buffer[:, :300]
    want = sample(logits.float(), params, seed=1, **dict(kw))
    with _Conversions((6, 300)) as log:
        got = sample(logits, params, seed=1, **dict(kw))
    assert torch.equal(got.next_token_ids, want.next_token_ids)
    if kw.get("return_logprob"):
        assert got.logprobs.dtype == torch.float32 and torch.equal(got.logprobs, want.logprobs)
    assert got.top_logprobs == want.top_logprobs
    if "logprobs" not in case:  # (where they are asked for, log_softmax converts: it must)
        assert ("_to_copy" in log.seen) == (case in ("penalties", "logit_bias"))
