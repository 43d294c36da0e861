"""Request validation and translation of the router's APIs (no server needed)."""

from __future__ import annotations

import json

import pytest

from services.router_generate import GenerateRequest
from services.router_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_max_tokens,
    parse_body,
)


def subs_of(model: type, body: dict) -> list:
    return parse_body(model, json.dumps(body).encode()).to_subrequests()


def error_of(model: type, body: dict | bytes) -> ApiError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as info:
        parse_body(model, raw).to_subrequests()
    return info.value


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(
    ("model", "body", "param", "code"),
    [
        (CompletionRequest, b"{not json", None, "invalid_json"),
        (CompletionRequest, b"[1, 2]", None, "invalid_value"),
        (CompletionRequest, {"prompt": "x"}, "model", "missing_required_parameter"),
        (CompletionRequest, {**COMP, "max_tokens": "5"}, "max_tokens", "invalid_value"),
        (CompletionRequest, {**COMP, "max_tokens": 5.0}, "max_tokens", "invalid_value"),
        (CompletionRequest, {**COMP, "temperature": "0.5"}, "temperature", "invalid_value"),
        (CompletionRequest, {**COMP, "temperature": -0.1}, "temperature", "invalid_value"),
        (CompletionRequest, {**COMP, "top_p": 0}, "top_p", "invalid_value"),
        (CompletionRequest, {**COMP, "top_p": 1.5}, "top_p", "invalid_value"),
        (CompletionRequest, {**COMP, "top_k": 0}, "top_k", "invalid_value"),
        (CompletionRequest, {**COMP, "min_p": 2}, "min_p", "invalid_value"),
        (CompletionRequest, {**COMP, "n": 0}, "n", "invalid_value"),
        (CompletionRequest, {**COMP, "presence_penalty": 3}, "presence_penalty", "invalid_value"),
        (CompletionRequest, {**COMP, "repetition_penalty": 0}, "repetition_penalty",
         "invalid_value"),
        (CompletionRequest, {**COMP, "stop": ""}, "stop", "invalid_value"),
        (CompletionRequest, {**COMP, "stop": [1]}, "stop", "invalid_value"),
        (CompletionRequest, {**COMP, "stream": "yes"}, "stream", "invalid_value"),
        (CompletionRequest, {**COMP, "seed": 2**64}, "seed", "invalid_value"),
        (CompletionRequest, {**COMP, "logprobs": 21}, "logprobs", "invalid_value"),
        (CompletionRequest, {**COMP, "prompt_logprobs": -1}, "prompt_logprobs", "invalid_value"),
        (CompletionRequest, {**COMP, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
         "invalid_value"),
        (ChatCompletionRequest, {**CHAT, "prompt_logprobs": 21}, "prompt_logprobs",
         "invalid_value"),
        (CompletionRequest, {**COMP, "stop_token_ids": [-1]}, "stop_token_ids.0",
         "invalid_value"),
        (CompletionRequest, {"model": "m", "prompt": []}, "prompt", "invalid_value"),
        (CompletionRequest, {"model": "m", "prompt": [1, "a"]}, "prompt", "invalid_value"),
        (CompletionRequest, {**COMP, "suffix": "x"}, "suffix", "unsupported"),
        (CompletionRequest, {**COMP, "logit_bias": {"a": 2.0}}, "logit_bias", "invalid_value"),
        (CompletionRequest, {**COMP, "logit_bias": {"1": 101}}, "logit_bias", "invalid_value"),
        (ChatCompletionRequest, {"model": "m", "messages": []}, "messages", "invalid_value"),
        (ChatCompletionRequest, {"model": "m", "messages": [{"role": "bot", "content": "x"}]},
         "messages.0.role", "invalid_value"),
        (ChatCompletionRequest, {**CHAT, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
        (ChatCompletionRequest, {**CHAT, "tools": [{"type": "function"}]}, "tools.0.function",
         "missing_required_parameter"),
        (ChatCompletionRequest, {**CHAT, "tools": [{"type": "retrieval"}]}, "tools.0.type",
         "invalid_value"),
        (ChatCompletionRequest, {**CHAT, "tools": []}, "tools", "invalid_value"),
        (ChatCompletionRequest, {**CHAT, "tool_choice": "any"}, "tool_choice", "invalid_value"),
        (ChatCompletionRequest, {"model": "m", "messages": [{"role": "assistant", "tool_calls": [
            {"id": "1", "function": {"name": "f", "arguments": {}}}]}]},
         "messages.0.tool_calls.0.function.arguments", "invalid_value"),
        (ChatCompletionRequest, {"model": "m", "messages": [
            {"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "unsupported"),
        (GenerateRequest, {"text": "a", "input_ids": [1]}, "text", "invalid_value"),
        (GenerateRequest, {"text": "a", "sampling_params": {"max_new_token": 3}},
         "sampling_params.max_new_token", "invalid_value"),
        (GenerateRequest, {"input_ids": [[1], []]}, "input_ids", "invalid_value"),
        (GenerateRequest, {"text": "a", "logprob_start_len": -2}, "logprob_start_len",
         "invalid_value"),
        (GenerateRequest, {"text": ["a", "b"], "logprob_start_len": [0]}, "logprob_start_len",
         "invalid_value"),
        (GenerateRequest, {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params",
         "invalid_value"),
        # cache salts: non-empty strings (vLLM: "must be a non-empty string if provided")
        (CompletionRequest, {**COMP, "cache_salt": ""}, "cache_salt", "invalid_value"),
        (ChatCompletionRequest, {**CHAT, "cache_salt": 5}, "cache_salt", "invalid_value"),
        (ChatCompletionRequest, {**CHAT, "extra_key": ["a"]}, "extra_key", "invalid_value"),
        (CompletionRequest, {**COMP, "cache_salt": "x" * 4097}, "cache_salt", "invalid_value"),
        (GenerateRequest, {"text": ["a", "b"], "extra_key": ["k"]}, "extra_key",
         "invalid_value"),
        (GenerateRequest, {"text": "a", "extra_key": ""}, "extra_key", "invalid_value"),
        # integers the messages cannot carry (64 bits), in unbounded fields and free dicts
        (CompletionRequest, {**COMP, "min_tokens": 2**64}, "min_tokens", "invalid_value"),
        (CompletionRequest, {**COMP, "truncate_prompt_tokens": 2**63}, "truncate_prompt_tokens",
         "invalid_value"),
        (CompletionRequest, {"model": "m", "prompt": [1, 2**63]}, "prompt.0.1", "invalid_value"),
        (GenerateRequest, {"input_ids": [[1], [2, 2**63]]}, "input_ids.1.1",
         "invalid_value"),
        (ChatCompletionRequest, {**CHAT, "chat_template_kwargs": {"k": [0, 2**70]}},
         "chat_template_kwargs.k.1", "invalid_value"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_naming_the_field(
    model: type, body: dict | bytes, param: str | None, code: str
) -> None:
    err = error_of(model, body)
    assert err.status == 400
    assert (err.param, err.code) == (param, code)
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error" and body["message"]


def test_completion_maps_openai_fields_to_sampling_params() -> None:
    body = {**COMP, "max_tokens": 7, "temperature": 0, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
            "stop": "\n", "seed": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.1, "ignore_eos": True, "stop_token_ids": [7],
            "skip_special_tokens": False, "logprobs": 2, "user": "ignored",
            "logit_bias": {"5": -100, "6": 1.5}}  # fmt: skip
    (sub,) = subs_of(CompletionRequest, body)
    assert sub.text == "hi" and sub.stop == ["\n"]
    assert sub.return_logprob and sub.top_logprobs_num == 2
    assert sub.sampling_params == {
        "max_new_tokens": 7, "temperature": 0.0, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "stop": ["\n"], "sampling_seed": 3, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "ignore_eos": True,
        "stop_token_ids": [7], "skip_special_tokens": False,
        "logit_bias": {"5": -100.0, "6": 1.5},
    }  # fmt: skip


def test_unset_fields_are_left_to_the_engine_defaults() -> None:
    (sub,) = subs_of(CompletionRequest, COMP)
    assert sub.sampling_params == {"max_new_tokens": 16}  # OpenAI's completions default
    (sub,) = subs_of(ChatCompletionRequest, CHAT)
    assert sub.sampling_params == {} and not sub.return_logprob


def test_n_fans_out_with_distinct_seeds_and_prompt_batches_keep_their_index() -> None:
    subs = subs_of(CompletionRequest, {"model": "m", "prompt": [[1, 2], [3]], "n": 2, "seed": 9})
    assert [(s.index, s.prompt_index, s.input_ids) for s in subs] == [
        (0, 0, [1, 2]), (1, 0, [1, 2]), (2, 1, [3]), (3, 1, [3])]  # fmt: skip
    assert [s.sampling_params["sampling_seed"] for s in subs] == [9, 10, 9, 10]


def test_chat_flattens_text_parts_and_prefers_max_completion_tokens() -> None:
    body = {"model": "m", "max_tokens": 50, "max_completion_tokens": 5, "logprobs": True,
            "top_logprobs": 3, "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]}]}  # fmt: skip
    (sub,) = subs_of(ChatCompletionRequest, body)
    assert [(m.role, m.content) for m in sub.messages] == [("system", "be brief"), ("user", "ab")]
    assert sub.sampling_params["max_new_tokens"] == 5
    assert sub.return_logprob and sub.top_logprobs_num == 3


def test_generate_batches_and_per_prompt_params() -> None:
    body = {
        "input_ids": [[1, 2], [3]],
        "return_logprob": True,
        "top_logprobs_num": 2,
        "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2, "n": 2}],
    }
    req = parse_body(GenerateRequest, json.dumps(body).encode())
    assert req.is_batch
    subs = req.to_subrequests()
    assert [(s.index, s.prompt_index, s.sampling_params["max_new_tokens"]) for s in subs] == [
        (0, 0, 1), (1, 1, 2), (2, 1, 2)]  # fmt: skip
    assert all(s.return_logprob and s.top_logprobs_num == 2 for s in subs)
    single = parse_body(GenerateRequest, b'{"text": "x"}')
    assert not single.is_batch and single.to_subrequests()[0].text == "x"
    assert single.to_subrequests()[0].logprob_start_len == -1


def test_logprob_start_len_per_prompt_and_echo_scores_the_prompt() -> None:
    body = {"input_ids": [[1, 2], [3]], "return_logprob": True, "logprob_start_len": [0, 5],
            "sampling_params": [{}, {"n": 2}]}  # fmt: skip
    subs = parse_body(GenerateRequest, json.dumps(body).encode()).to_subrequests()
    assert [s.logprob_start_len for s in subs] == [0, 5, 5]
    one = parse_body(GenerateRequest, b'{"text": ["a", "b"], "logprob_start_len": 1}')
    assert [s.logprob_start_len for s in one.to_subrequests()] == [1, 1]
    (echo,) = subs_of(CompletionRequest, {**COMP, "echo": True, "logprobs": 0})
    assert echo.echo and echo.return_logprob and echo.logprob_start_len == 0
    (plain,) = subs_of(CompletionRequest, {**COMP, "echo": True})
    assert plain.echo and not plain.return_logprob and plain.logprob_start_len == -1


def test_max_tokens_beyond_the_context_is_refused_before_sending() -> None:
    subs = subs_of(CompletionRequest, {**COMP, "max_tokens": 4096})
    check_max_tokens(subs, None, "max_tokens")  # no worker known yet: the tokenizer checks
    check_max_tokens(subs, 8192, "max_tokens")
    with pytest.raises(ApiError) as info:
        check_max_tokens(subs, 4096, "max_tokens")
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"


def test_min_tokens_is_sglangs_min_new_tokens() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 8, "min_tokens": 3}
    sub = CompletionRequest.model_validate(body).to_subrequests()[0]
    assert sub.sampling_params == {"max_new_tokens": 8, "min_new_tokens": 3}
    gen = GenerateRequest.model_validate({"text": "hi", "sampling_params": {"min_new_tokens": 2}})
    assert gen.to_subrequests()[0].sampling_params["min_new_tokens"] == 2
    with pytest.raises(ApiError, match="min_tokens"):
        subs_of(CompletionRequest, {**body, "min_tokens": -1})


def test_chat_template_options_and_echo() -> None:
    body = {**CHAT, "add_generation_prompt": False, "continue_final_message": True,
            "echo": True}  # fmt: skip
    (sub,) = subs_of(ChatCompletionRequest, body)
    assert not sub.add_generation_prompt and sub.continue_final_message and sub.echo
    (sub,) = subs_of(ChatCompletionRequest, CHAT)
    assert sub.add_generation_prompt and not sub.continue_final_message and not sub.echo
    for both in ({**CHAT, "continue_final_message": True},
                 {**CHAT, "continue_final_message": True, "add_generation_prompt": True}):
        with pytest.raises(ApiError) as err:
            subs_of(ChatCompletionRequest, both)
        assert err.value.status == 400 and "add_generation_prompt=false" in str(err.value)


def test_vllm_prompt_logprobs_are_asked_of_the_engine_besides_the_outputs() -> None:
    (sub,) = subs_of(CompletionRequest, {**COMP, "prompt_logprobs": 4, "logprobs": 1})
    assert (sub.prompt_logprobs, sub.return_logprob, sub.top_logprobs_num) == (4, True, 1)
    (sub,) = subs_of(ChatCompletionRequest, {**CHAT, "prompt_logprobs": 0})
    assert (sub.prompt_logprobs, sub.return_logprob) == (0, False)  # no output logprobs shown
    (sub,) = subs_of(ChatCompletionRequest, CHAT)
    assert sub.prompt_logprobs is None


def test_prompt_logprobs_are_computed_once_per_prompt_with_n() -> None:
    """n samples of a prompt share its prompt logprobs: only the first asks the engine for
    them (the others sample from the prefix cache); every choice still shows them."""
    from types import SimpleNamespace

    from services.router_requests import Broker

    body = {**COMP, "prompt": ["a b", "c"], "n": 3, "prompt_logprobs": 2, "logprobs": 1}
    subs = subs_of(CompletionRequest, body)
    assert [s.prompt_scored_by for s in subs] == [None, 0, 0, None, 3, 3]
    assert all(s.prompt_logprobs == 2 for s in subs)
    broker = SimpleNamespace(router_id="router-0")
    msgs = [
        Broker._tokenize_msg(  # type: ignore[arg-type]
            broker, SimpleNamespace(sub=s, rid=f"r{s.index}", worker=SimpleNamespace(worker_id="w"))
        )
        for s in subs
    ]
    asks = [(m.logprob_start_len, m.return_prompt_ranks, m.top_logprobs_num) for m in msgs]
    assert asks == [(0, True, 2), (-1, False, 1), (-1, False, 1)] * 2


def test_reasoning_effort_goes_to_the_chat_template_unless_its_kwargs_name_it() -> None:
    (sub,) = subs_of(ChatCompletionRequest, {**CHAT, "reasoning_effort": "low"})
    assert sub.chat_template_kwargs == {"reasoning_effort": "low"}
    body = {**CHAT, "reasoning_effort": "low",
            "chat_template_kwargs": {"reasoning_effort": "high", "x": 1}}  # fmt: skip
    (sub,) = subs_of(ChatCompletionRequest, body)
    assert sub.chat_template_kwargs == {"reasoning_effort": "high", "x": 1}
    (sub,) = subs_of(ChatCompletionRequest, CHAT)
    assert sub.chat_template_kwargs is None
    error = error_of(ChatCompletionRequest, {**CHAT, "reasoning_effort": "extreme"})
    assert (error.status, error.param) == (400, "reasoning_effort")


def test_a_responses_reasoning_effort_is_the_chats() -> None:
    from services.responses_api import ResponsesRequest

    def chat_of(**body: object) -> ChatCompletionRequest:
        raw = json.dumps({"model": "m", "input": "hi", **body}).encode()
        return ResponsesRequest.parse(raw).to_chat()

    (sub,) = chat_of(reasoning={"effort": "medium", "summary": "auto"}).to_subrequests()
    assert sub.chat_template_kwargs == {"reasoning_effort": "medium"}
    assert chat_of(reasoning={"summary": "auto"}).reasoning_effort is None
    with pytest.raises(ApiError) as info:
        chat_of(reasoning={"effort": "extreme"})
    assert (info.value.status, info.value.param) == (400, "reasoning.effort")


def test_cache_salts_reach_every_subrequest() -> None:
    """vLLM's `cache_salt` and SGLang's `extra_key` (joined as SGLang joins them, when both
    are given) on every sub-request of the OpenAI endpoints (n, prompt batches), the
    Responses API's chat and `/generate` (one key for all prompts or one each)."""
    from services.responses_api import ResponsesRequest

    subs = subs_of(CompletionRequest, {**COMP, "prompt": ["a", "b"], "n": 2, "cache_salt": "t1"})
    assert [s.cache_salt for s in subs] == ["t1"] * 4
    (sub,) = subs_of(ChatCompletionRequest, {**CHAT, "extra_key": "k"})
    assert sub.cache_salt == "k"
    (sub,) = subs_of(ChatCompletionRequest, {**CHAT, "cache_salt": "s", "extra_key": "k"})
    assert sub.cache_salt == "sk"
    (sub,) = subs_of(ChatCompletionRequest, CHAT)
    assert sub.cache_salt is None
    raw = json.dumps({"model": "m", "input": "hi", "cache_salt": "t2"}).encode()
    (sub,) = ResponsesRequest.parse(raw).to_chat().to_subrequests()
    assert sub.cache_salt == "t2"
    subs = subs_of(GenerateRequest, {"text": ["a", "b", "c"], "extra_key": ["x", None, "y"]})
    assert [s.cache_salt for s in subs] == ["x", None, "y"]
    subs = subs_of(GenerateRequest, {"text": ["a", "b"], "extra_key": "z"})
    assert [s.cache_salt for s in subs] == ["z", "z"]


def test_return_text_in_logprobs_reaches_every_generate_subrequest() -> None:
    subs = subs_of(GenerateRequest, {"text": ["a", "b"], "return_logprob": True,
                                     "return_text_in_logprobs": True})  # fmt: skip
    assert [s.return_text_in_logprobs for s in subs] == [True, True]
    (sub,) = subs_of(GenerateRequest, {"text": "a", "return_logprob": True})
    assert sub.return_text_in_logprobs is False
