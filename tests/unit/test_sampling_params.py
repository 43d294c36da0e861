"""SamplingParams: SGLang defaults, validation that names the field, dict conversion."""

from __future__ import annotations

import dataclasses

import pytest

from engine.sampling.sampling_params import TOP_K_ALL, SamplingParams


def test_defaults_match_sglang() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.sampling_seed) == (None, None, False, None)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert (p.return_logprob, p.top_logprobs_num, p.n) == (False, 0, 1)
    assert not p.is_greedy and not p.has_penalty


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("max_new_tokens", -1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.01),
        ("frequency_penalty", -2.5),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("presence_penalty", 3.0),
        ("top_logprobs_num", -1),
        ("n", 0),
        ("stop", ["ok", ""]),
        ("sampling_seed", 1 << 64),
        ("logprob_start_len", -2),
        ("logit_bias", {"5": 100.5}),
        ("logit_bias", {"5": float("nan")}),
        ("logit_bias", {"x5": 1.0}),
        ("logit_bias", {"-5": 1.0}),
        ("logit_bias", {"100": 1.0}),  # outside the vocabulary of 100
        ("min_new_tokens", -1),
        ("min_new_tokens", 129),  # above max_new_tokens (128)
    ],
)
def test_verify_rejects_out_of_range_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).verify(vocab_size=100)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, max_new_tokens=0),
        dict(repetition_penalty=2.0, frequency_penalty=-2.0, presence_penalty=2.0),
        dict(stop_token_ids=[0, 99], top_logprobs_num=100, n=4, sampling_seed=-(1 << 63)),
        dict(min_new_tokens=16, max_new_tokens=16),
    ],
)
def test_verify_accepts_range_edges(kwargs: dict) -> None:
    SamplingParams(**kwargs).verify(vocab_size=100)


def test_verify_checks_stop_token_ids_against_vocab() -> None:
    p = SamplingParams(stop_token_ids=[5, 100])
    p.verify()  # no vocab known: nothing to check against
    with pytest.raises(ValueError, match="stop_token_ids"):
        p.verify(vocab_size=100)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1]).verify(vocab_size=100)


def test_normalize_greedy_top_k_and_stop() -> None:
    p = SamplingParams(temperature=0.0, top_k=50, stop="###")
    assert p.normalize() is p
    assert (p.temperature, p.top_k, p.stop, p.stop_token_ids) == (1.0, 1, ["###"], [])
    assert p.is_greedy
    q = SamplingParams(temperature=1e-7)
    assert q.is_greedy and q.normalize().top_k == 1
    r = SamplingParams(temperature=0.5, stop=["a", "b"], stop_token_ids=[3]).normalize()
    assert (r.temperature, r.top_k, r.stop, r.stop_token_ids) == (0.5, TOP_K_ALL, ["a", "b"], [3])
    assert not r.is_greedy
    before = dataclasses.replace(r)
    assert r.normalize() == before  # idempotent
    r.verify(vocab_size=10)  # a normalized TOP_K_ALL still validates


def test_stop_strs_without_normalize() -> None:
    assert SamplingParams(stop="x").stop_strs == ["x"]
    assert SamplingParams(stop=None).stop_strs == []


def test_dict_round_trip() -> None:
    p = SamplingParams(
        max_new_tokens=7,
        temperature=0.3,
        top_k=20,
        stop=["\n"],
        stop_token_ids=[2],
        sampling_seed=42,
        return_logprob=True,
        top_logprobs_num=3,
    )
    d = p.to_dict()
    assert d["stop"] == ["\n"] and d["sampling_seed"] == 42
    assert SamplingParams.from_dict(d) == p


def test_from_dict_rejects_unknown_key() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams.from_dict({"temperature": 0.5, "max_tokens": 3})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "0.5"),
        ("top_k", 1.5),
        ("top_k", True),
        ("max_new_tokens", None),
        ("ignore_eos", 1),
        ("stop", [1, 2]),
        ("stop", 5),
        ("stop_token_ids", ["a"]),
        ("stop_token_ids", [1.0]),
        ("sampling_seed", 1.0),
        ("normalize_embedding", 1),
    ],
)
def test_from_dict_rejects_wrong_types(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_every_field_is_type_checked() -> None:
    """Each field's default goes through `from_dict` (a type spec the checker does not know
    would raise AssertionError: a 500 for a request that uses the field)."""
    defaults = SamplingParams()
    for field in dataclasses.fields(SamplingParams):
        value = getattr(defaults, field.name)
        assert getattr(SamplingParams.from_dict({field.name: value}), field.name) == value
    assert SamplingParams.from_dict({"normalize_embedding": False}).normalize_embedding is False


def test_from_dict_accepts_ints_for_floats_and_none_for_optionals() -> None:
    p = SamplingParams.from_dict(
        {"temperature": 0, "top_p": 1, "stop": None, "sampling_seed": None}
    )
    assert isinstance(p.temperature, float) and p.temperature == 0.0
    assert isinstance(p.top_p, float)
    assert SamplingParams.from_dict({"stop": "x"}).stop == "x"
