"""Malformed requests against the full stack: a seeded random mix of wrong types, out-of-range
numbers, odd strings and garbage bodies on every generating and tokenizing endpoint. None may
be a 5xx or a dropped connection, every refusal is a JSON error naming what is wrong, and
afterwards every service that was up still is and a plain request is answered."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import httpx2 as httpx
import pytest

from tests.system.procs import Stack

pytest_plugins = ["tests.system.router_stack"]

ODD: list[Any] = [
    None, True, 0, -1, 1, 2**63, -(2**63) - 1, 2**64, 1e308, 3.5, -0.0, "", "x", "\u0000",
    "\ud7ff\U0001f600", " " * 10, [], [None], [1, "a"], [-5], [10**12], [[1, 2], []], [2**64],
    {}, {"a": None}, {"99999999999999999999": 1}, {"-1": 5}, {"5": 1e308},
    [{"role": "user"}], [{"role": "user", "content": None}], [{"role": "tool", "content": "x"}],
    [{"type": "bogus"}], "auto", "none", {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"schema": "x"}},
    {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}},
    # plausible values, so that some spoiled requests get through to the worker
    False, 2, 0.5, "stop", [1, 2], ["a", "b"], {"k": "v"}, {"type": "text"}, "required",
]  # fmt: skip
SAMPLING_KEYS = ["max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
                 "n", "json_schema", "regex", "min_new_tokens", "frequency_penalty", "logit_bias",
                 "sampling_seed", "ignore_eos", "no_stop_trim", "bad_words"]  # fmt: skip
GARBAGE = [b"", b"{", b"[]", b"null", b"\xff\xfe", b"1", b'{"model": "' + b"a" * 100_000 + b'"}']


def endpoints(model: str) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """Each endpoint: a valid body, and the fields the fuzzer spoils."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return {
        "/v1/chat/completions": (chat, [
            "messages", "max_tokens", "temperature", "n", "stop", "stream", "logprobs",
            "top_logprobs", "tools", "tool_choice", "response_format", "seed", "logit_bias",
            "stream_options", "min_tokens", "bad_words", "allowed_token_ids",
            "chat_template_kwargs", "continue_final_message", "echo", "prompt_logprobs",
            "truncate_prompt_tokens", "structured_outputs", "guided_choice", "reasoning_effort",
            "rid", "priority", "stop_token_ids", "model"]),
        "/v1/completions": ({"model": model, "prompt": "hi", "max_tokens": 3}, [
            "prompt", "max_tokens", "n", "echo", "logprobs", "stop", "stream", "suffix", "seed",
            "logit_bias", "prompt_logprobs", "truncate_prompt_tokens", "min_tokens",
            "response_format", "guided_regex", "model"]),
        "/generate": ({"text": "hi", "sampling_params": {"max_new_tokens": 3}}, [
            "text", "input_ids", "sampling_params", "stream", "return_logprob",
            "top_logprobs_num", "logprob_start_len", "rid", "priority"]),
        "/v1/responses": ({"model": model, "input": "hi", "max_output_tokens": 3}, [
            "input", "instructions", "max_output_tokens", "tools", "tool_choice", "text",
            "include", "top_logprobs", "reasoning", "previous_response_id", "store", "stream",
            "truncation", "metadata", "conversation", "model"]),
        "/tokenize": ({"model": model, "prompt": "hi"}, [
            "prompt", "messages", "add_special_tokens", "return_token_strs", "tools"]),
        "/detokenize": ({"model": model, "tokens": [1, 2]}, ["tokens", "skip_special_tokens"]),
    }  # fmt: skip


def spoiled(rng: random.Random, body: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    body = copy.deepcopy(body)
    for _ in range(rng.choice([1, 1, 1, 2])):
        field = rng.choice(fields)
        if field == "sampling_params" and rng.random() < 0.7:
            body["sampling_params"][rng.choice(SAMPLING_KEYS)] = rng.choice(ODD)
        else:
            body[field] = rng.choice(ODD)
    if isinstance(body.get("n"), int) and body["n"] > 4:
        body["n"] = 1  # bounded work: n up to 4
    return body


def check(resp: httpx.Response, what: str) -> None:
    assert resp.status_code < 500, (what, resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert error["message"] and error["type"], (what, error)


@pytest.mark.parametrize("seed", [0, 1])
def test_malformed_requests_are_4xx_and_harm_nothing(
    http_stack: Stack, served_model: str, seed: int
) -> None:
    rng = random.Random(seed)
    targets = endpoints(served_model)
    alive = [s for s in http_stack.services if s.alive()]  # other tests may have killed some
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=http_stack.router_url, timeout=60) as client:
        for _ in range(100):
            path = rng.choice(list(targets))
            body = spoiled(rng, *targets[path])
            raw = json.dumps(body, allow_nan=True)
            resp = client.post(path, content=raw, headers={"content-type": "application/json"})
            check(resp, f"{path} {raw[:300]}")
            statuses[resp.status_code // 100] = statuses.get(resp.status_code // 100, 0) + 1
        for path in targets:
            for raw in GARBAGE:
                resp = client.post(path, content=raw, headers={"content-type": "application/json"})
                check(resp, f"{path} {raw[:40]!r}")
                assert resp.status_code == 400 or (raw == b"{}" and resp.status_code == 200)
        assert statuses.get(4, 0) > 20 and statuses.get(2, 0) > 5  # both kinds were exercised
        ok = client.post("/v1/completions", json={"model": served_model, "prompt": "hi",
                                                  "max_tokens": 2})  # fmt: skip
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert all(service.alive() for service in alive)


HUGE: list[Any] = [2**64, [1, 2**64], {"5": 2**64}]


def test_integers_beyond_64_bits_in_any_field_are_4xx(http_stack: Stack, served_model: str) -> None:
    """Every field of every endpoint (and every sampling key of /generate) given an integer
    the messages cannot carry, alone, in a list and in a mapping."""
    targets = endpoints(served_model)
    alive = [s for s in http_stack.services if s.alive()]
    with httpx.Client(base_url=http_stack.router_url, timeout=60) as client:
        for path, (valid, fields) in targets.items():
            spoils = [(f, v) for f in fields for v in HUGE]
            if path == "/generate":
                spoils += [(("sampling_params", k), v) for k in SAMPLING_KEYS for v in HUGE]
            for field, value in spoils:
                body = copy.deepcopy(valid)
                if isinstance(field, tuple):
                    body[field[0]][field[1]] = value
                else:
                    body[field] = value
                check(client.post(path, json=body), f"{path} {field}={value}")
    assert all(service.alive() for service in alive)
