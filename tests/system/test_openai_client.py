"""The official `openai` client against the full stack: chat and completions, whole and
streamed, usage, logprobs, n with seeds, model listing, and errors as its exceptions."""

from __future__ import annotations

import io
import json
import re
import time

import httpx2 as httpx
import openai
import pytest

from tests.system.procs import Stack
from tests.system.router_stack import STACK_LORAS

pytest_plugins = ["tests.system.router_stack"]

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(http_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=http_stack.router_url + "/v1", api_key="unused", max_retries=0)


def test_models_list_names_the_served_model(client: openai.OpenAI, served_model: str) -> None:
    # (then the LoRA adapters the shared stack serves, tests/system/test_router_lora.py)
    assert [m.id for m in client.models.list().data] == [served_model, *sorted(STACK_LORAS)]


def test_chat_whole_and_streamed_agree_and_report_usage(
    client: openai.OpenAI, served_model: str
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi! 你好"}]
    whole = client.chat.completions.create(
        model=served_model, messages=messages, max_tokens=20, **GREEDY
    )
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 20 and whole.usage.prompt_tokens > 5
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 20
    chunks = list(
        client.chat.completions.create(
            model=served_model,
            messages=messages,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_whole_and_streamed_with_logprobs(
    client: openai.OpenAI, served_model: str
) -> None:
    whole = client.completions.create(
        model=served_model, prompt="The capital of France is", max_tokens=12, logprobs=2, **GREEDY
    )
    choice = whole.choices[0]
    assert whole.usage.completion_tokens == 12
    assert len(choice.logprobs.tokens) == 12 and len(choice.logprobs.token_logprobs) == 12
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    # greedy: each token is the most likely one
    assert all(
        lp == pytest.approx(max(top.values()))
        for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs)
    )
    stream = client.completions.create(
        model=served_model,
        prompt="The capital of France is",
        max_tokens=12,
        stream=True,
        **GREEDY,
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == choice.text


def test_n_samples_with_a_seed_are_reproducible(client: openai.OpenAI, served_model: str) -> None:
    def sample() -> list[str]:
        out = client.completions.create(
            model=served_model,
            prompt="Once",
            max_tokens=16,
            n=3,
            seed=123,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert out.usage.completion_tokens == 48
        return [c.text for c in out.choices]

    first = sample()
    assert sample() == first
    assert len(set(first)) > 1  # seeds differ per choice


def test_errors_raise_the_clients_exceptions(client: openai.OpenAI, served_model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=served_model, prompt="word " * 3000, max_tokens=4)
    assert info.value.code == "prompt_too_long"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=served_model, messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    assert info.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)


def test_truncate_prompt_tokens_keeps_the_prompts_end(
    client: openai.OpenAI, served_model: str, http_stack: Stack
) -> None:
    # vLLM's truncate_prompt_tokens: the last k tokens, as if they were the whole prompt
    prompt = "".join(f"word{i} " for i in range(900))
    ids = client.post("/tokenize", body={"prompt": prompt}, cast_to=dict)["tokens"]
    assert len(ids) > 1000  # over the tiny model's 1024-token context
    def create(prompt: object, max_tokens: int = 8, **extra: object) -> object:
        return client.completions.create(
            model=served_model, prompt=prompt, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True, **extra},
        )  # fmt: skip

    cut, same = create(prompt, truncate_prompt_tokens=40), create(ids[-40:])
    assert cut.usage.prompt_tokens == 40 and cut.choices[0].text == same.choices[0].text
    context = httpx.get(http_stack.router_url + "/get_model_info").json()
    fit = create(prompt, truncate_prompt_tokens=-1)
    assert fit.usage.prompt_tokens == context["max_context_length"] - 8
    refused = (
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 40, "echo": True}, "echo with truncate_prompt_tokens"),
    )
    for extra, param in refused:
        with pytest.raises(openai.BadRequestError) as info:
            create("x", 1, **extra)
        assert info.value.param == param
    with pytest.raises(openai.BadRequestError, match="more than the context length"):
        create("x", 1, truncate_prompt_tokens=100_000)


def test_echo_with_logprobs_scores_the_prompt_like_lm_eval(
    client: openai.OpenAI, served_model: str, http_stack: Stack
) -> None:
    """lm-evaluation-harness's loglikelihood request (`local-completions`): token-id prompts,
    `echo`, `logprobs=1`, `max_tokens=1`; it reads `token_logprobs[ctxlen:-1]` and checks
    greediness against `top_logprobs`. The prompt logprobs equal transformers'."""
    import torch

    from tests.factories import _hf_model

    prompts = [[1, 300, 301, 302, 303, 304], [1, 400, 401]]
    out = client.completions.create(
        model=served_model, prompt=prompts, max_tokens=1, logprobs=1, echo=True, temperature=0,
        seed=1234,
    )  # fmt: skip
    model = _hf_model(http_stack.model)
    for choice, ids in zip(sorted(out.choices, key=lambda c: c.index), prompts, strict=True):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1))
        got = torch.tensor(lp.token_logprobs[1 : len(ids)], dtype=torch.float64)
        torch.testing.assert_close(got, want.squeeze(1), atol=1e-3, rtol=0)
        for tok, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert len(top) == 1 and tok <= max(top.values()) + 1e-6
    # echo without logprobs: the prompt's text goes first, whole and streamed
    whole = client.completions.create(
        model=served_model, prompt="Echo me", max_tokens=4, echo=True, **GREEDY
    )
    assert whole.choices[0].text.startswith("Echo me")
    stream = client.completions.create(
        model=served_model, prompt="Echo me", max_tokens=4, echo=True, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text
    # max_tokens 0 with echo: the prompt only
    only = client.completions.create(model=served_model, prompt="Echo me", max_tokens=0, echo=True)
    assert only.choices[0].text == "Echo me" and only.usage.completion_tokens == 0


def test_vllm_prompt_logprobs_rank_the_prompt_like_transformers(
    client: openai.OpenAI, served_model: str, http_stack: Stack
) -> None:
    """vLLM's `prompt_logprobs=k`: per prompt token its logprob and rank (how many tokens are
    at least as likely) and the k best, as transformers computes them; a completion's per
    choice, a chat's in the body; a 400 when streaming."""
    import torch

    from tests.factories import _hf_model

    ids = [1, 300, 301, 302, 303, 304, 305]
    out = client.completions.create(
        model=served_model, prompt=ids, max_tokens=2, logprobs=1, n=2, temperature=1.0,
        extra_body={"prompt_logprobs": 3},
    )  # fmt: skip
    with torch.inference_mode():
        logits = _hf_model(http_stack.model)(torch.tensor([ids])).logits[0, :-1].double()
    ref = torch.log_softmax(logits, -1)
    for choice in out.choices:
        got = choice.model_extra["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        assert len(choice.logprobs.top_logprobs[0]) == 1  # the output's own k
        for row, (tid, entry) in enumerate(zip(ids[1:], got[1:], strict=True)):
            mine = entry.pop(str(tid))
            assert abs(mine["logprob"] - ref[row, tid].item()) < 1e-3
            # the rank counts the tokens at least as likely (float32 vs float64: a 1e-4 band)
            lo = int((ref[row] > ref[row, tid] + 1e-4).sum()) + 1
            assert lo <= mine["rank"] <= int((ref[row] >= ref[row, tid] - 1e-4).sum())
            best = ref[row].topk(3)
            pairs = zip(best.values.tolist(), best.indices.tolist(), strict=True)
            want = {t: (j + 1, v) for j, (v, t) in enumerate(pairs)}
            for key, cand in entry.items():  # the 3 best (but the token itself, if among them)
                rank, value = want[int(key)]
                assert cand["rank"] == rank and abs(cand["logprob"] - value) < 1e-3
            assert len(entry) == 3 - (mine["rank"] <= 3)
    messages = [{"role": "user", "content": "Rank me"}]
    chat = client.chat.completions.create(
        model=served_model, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    ranked = chat.model_extra["prompt_logprobs"]
    assert ranked[0] is None and all(len(e) == 1 for e in ranked[1:])
    assert len(ranked) == chat.usage.prompt_tokens and chat.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=served_model, prompt="x", max_tokens=1, stream=True,
            extra_body={"prompt_logprobs": 1},
        )  # fmt: skip
    assert info.value.param == "prompt_logprobs"


def test_allowed_token_ids_are_the_only_tokens_sampled(
    client: openai.OpenAI, served_model: str
) -> None:
    allowed = [300, 301, 302]
    pieces = [client.post("/detokenize", body={"tokens": [t]}, cast_to=dict)["prompt"]
              for t in allowed]  # fmt: skip
    assert all(p.isascii() and p for p in pieces)
    out = client.completions.create(
        model=served_model, prompt="Hello", max_tokens=12, temperature=1.0, seed=1, logprobs=5,
        extra_body={"ignore_eos": True, "allowed_token_ids": allowed},
    )  # fmt: skip
    choice = out.choices[0]
    assert re.fullmatch("(?:" + "|".join(map(re.escape, pieces)) + ")+", choice.text), choice.text
    assert len(choice.logprobs.tokens) == 12 and set(choice.logprobs.tokens) <= set(pieces)
    for top in choice.logprobs.top_logprobs:  # the others are impossible
        assert {k for k, v in top.items() if v > -1e9} <= set(pieces)
    for bad in ([], [10**9], "300"):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=served_model, prompt="x", max_tokens=1,
                                      extra_body={"allowed_token_ids": bad})  # fmt: skip
        assert "allowed_token_ids" in str(info.value)


def test_bad_words_are_never_completed(
    client: openai.OpenAI, served_model: str, http_stack: Stack
) -> None:
    """vLLM's bad_words: a word of the greedy output, banned, is not written again; the output
    is the greedy one until the word would be completed."""
    from engine.tokenizer import bad_words_ids, load_tokenizer

    tok = load_tokenizer(http_stack.model)
    extra = {"return_token_ids": True, "ignore_eos": True}
    kw = dict(model=served_model, prompt="The old house", max_tokens=24, temperature=0)
    base = client.completions.create(**kw, extra_body=extra).choices[0].model_extra["token_ids"]

    def spans(ids: list[int], word: list[int]) -> list[int]:
        return [i for i in range(len(ids)) if ids[i : i + len(word)] == word]

    words = [w for t in base if (w := tok.decode([t]).strip()).isalpha()]
    word, seqs = next((w, ss) for w in words for ss in [bad_words_ids(tok, [w])]
                      if any(spans(base, s) for s in ss))  # fmt: skip
    out = client.completions.create(**kw, extra_body=extra | {"bad_words": [word]})
    ids = out.choices[0].model_extra["token_ids"]
    assert not any(spans(ids, s) for s in seqs), (word, seqs, ids)
    cut = min(i + len(s) - 1 for s in seqs for i in spans(base, s))
    assert ids[:cut] == base[:cut] and ids[cut] != base[cut]
    for bad in (["  "], "word", [3]):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=served_model, prompt="x", max_tokens=1,
                                      extra_body={"bad_words": bad})  # fmt: skip
        assert "bad_words" in str(info.value)


def test_return_token_ids_gives_the_prompts_and_outputs_ids(
    client: openai.OpenAI, served_model: str
) -> None:
    """vLLM's return_token_ids: a completion choice's prompt_token_ids and token_ids; a chat's
    prompt ids in the body (after the template); streamed, each chunk's ids."""
    ids = client.post("/tokenize", body={"prompt": "Count: one two"}, cast_to=dict)["tokens"]
    extra = {"return_token_ids": True, "ignore_eos": True}
    out = client.completions.create(model=served_model, prompt=ids, max_tokens=10,
                                    temperature=0, extra_body=extra)  # fmt: skip
    choice = out.choices[0].model_extra
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 10
    text = client.post("/detokenize", body={"tokens": choice["token_ids"]}, cast_to=dict)
    assert text["prompt"] == out.choices[0].text
    chunks = list(client.completions.create(
        model=served_model, prompt=ids, max_tokens=10, temperature=0, stream=True,
        extra_body=extra))  # fmt: skip
    streamed = [c.choices[0].model_extra for c in chunks if c.choices]
    assert streamed[0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c for c in streamed[1:])
    assert [t for c in streamed for t in c["token_ids"]] == choice["token_ids"]
    messages = [{"role": "user", "content": "Hi there"}]
    templated = client.post("/tokenize", body={"messages": messages}, cast_to=dict)["tokens"]
    chat = client.chat.completions.create(
        model=served_model, messages=messages, max_tokens=6, n=2, temperature=1.0, seed=4,
        extra_body=extra)  # fmt: skip
    assert chat.model_extra["prompt_token_ids"] == templated
    assert [len(c.model_extra["token_ids"]) for c in chat.choices] == [6, 6]
    chunks = list(client.chat.completions.create(
        model=served_model, messages=messages, max_tokens=6, n=2, temperature=1.0, seed=4,
        stream=True, extra_body=extra))  # fmt: skip
    for i, c in enumerate(chat.choices):
        mine = [k for k in chunks if k.choices and k.choices[0].index == i]
        assert mine[0].model_extra["prompt_token_ids"] == templated
        got = [t for k in mine for t in k.choices[0].model_extra["token_ids"]]
        assert got == c.model_extra["token_ids"]  # seeded: the same samples
    plain = client.completions.create(model=served_model, prompt=ids, max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_extra


def test_logit_bias_forces_a_token(client: openai.OpenAI, served_model: str) -> None:
    out = client.completions.create(
        model=served_model, prompt="Hello", max_tokens=3, logit_bias={"300": 100}, temperature=1.0,
        logprobs=1, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.choices[0].logprobs.token_logprobs == pytest.approx([0.0] * 3, abs=1e-4)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=served_model, prompt="x", max_tokens=1, logit_bias={"999999": 1}
        )
    assert "logit_bias" in str(info.value)


def test_structured_outputs_as_openai_and_vllm_clients_send_them(
    client: openai.OpenAI, served_model: str
) -> None:
    import json
    import re

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": schema}}
    # Streamed and whole (sampled, seeded): the text is a JSON document the schema accepts.
    for stream in (False, True):
        kwargs = {"model": served_model, "max_tokens": 60, "temperature": 0.7, "seed": 3}
        messages = [{"role": "user", "content": "A trip, as JSON"}]
        if stream:
            chunks = client.chat.completions.create(
                messages=messages, response_format=fmt, stream=True, **kwargs
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            resp = client.chat.completions.create(messages=messages, response_format=fmt, **kwargs)
            assert resp.choices[0].finish_reason == "stop"
            text = resp.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
    # vLLM's and SGLang's extra fields on /v1/completions
    resp = client.completions.create(
        model=served_model, prompt="Weather:", max_tokens=20, n=4, temperature=1.0,
        extra_body={"guided_choice": ["sunny", "rainy day"]},
    )  # fmt: skip
    assert {c.text for c in resp.choices} <= {"sunny", "rainy day"}
    resp = client.chat.completions.create(  # vLLM's form since v0.12
        model=served_model, messages=messages, max_tokens=20, n=4, temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy day"]}},
    )  # fmt: skip
    assert {c.message.content for c in resp.choices} <= {"sunny", "rainy day"}
    resp = client.completions.create(
        model=served_model, prompt="A trip, as JSON:", max_tokens=200, temperature=0.7, seed=3,
        extra_body={"structured_outputs": {"json": schema}},
    )  # fmt: skip
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].text), schema)
    resp = client.completions.create(
        model=served_model, prompt="Code:", max_tokens=20, extra_body={"regex": "[A-Z]{3}-[0-9]{2}"}
    )
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", resp.choices[0].text)
    # xgrammar's structural tag (SGLang's and vLLM's response_format type): the tagged JSON
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<trip>", "end": "</trip>",
        "content": {"type": "json_schema", "json_schema": schema}}}  # fmt: skip
    resp = client.chat.completions.create(
        model=served_model, messages=messages, max_tokens=200, temperature=0.7, seed=5,
        response_format=tag,  # type: ignore[arg-type]
    )  # fmt: skip
    text = resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop" and re.fullmatch("<trip>.*</trip>", text, re.S)
    jsonschema.validate(json.loads(text.removeprefix("<trip>").removesuffix("</trip>")), schema)
    with pytest.raises(openai.BadRequestError, match="Format type not recognized"):
        client.completions.create(
            model=served_model, prompt="x", max_tokens=5,
            extra_body={"structured_outputs": {"structural_tag": '{"format": {"type": "x"}}'}},
        )  # fmt: skip
    # A regex that does not compile is the client's 400, with the reason.
    with pytest.raises(openai.BadRequestError, match="parenthesis is not closed"):
        client.completions.create(
            model=served_model, prompt="x", max_tokens=5, extra_body={"regex": "(ab"}
        )
    with pytest.raises(openai.BadRequestError, match="only one structured output option"):
        client.completions.create(
            model=served_model, prompt="x", max_tokens=5,
            extra_body={"regex": "a+", "response_format": {"type": "json_object"}},
        )  # fmt: skip


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


def _no_blank_tokens(model: str) -> dict[str, int]:
    """A logit_bias banning the tokens that are only whitespace: a random model left free to
    pick JSON's optional whitespace fills any budget with it (real models write compact
    JSON)."""
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    special = set(tok.all_special_ids)
    return {
        str(i): -100 for i in range(len(tok)) if not tok.decode([i]).strip() and i not in special
    }


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in "\\^$.|?*+()[]{}" else ch for ch in text)


def _streamed_tools(chunks) -> tuple[str, dict[int, dict], str | None]:  # type: ignore[no-untyped-def]
    """Content, tool calls (by index, arguments joined) and the finish reason of a stream."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] = call["name"] or (d.function and d.function.name)
            call["arguments"] += (d.function and d.function.arguments) or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_tool_calls_auto_parsed_from_the_models_own_format(
    client: openai.OpenAI, served_model: str
) -> None:
    """tool_choice auto: the output (forced here by a regex into the tiny model's Hermes
    format, text before the calls included) comes back as content plus tool_calls, whole and
    streamed alike, with finish_reason tool_calls; a plain answer stays plain content."""
    import json

    written = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        "</tool_call>"
    )
    kwargs = {
        "model": served_model,
        "messages": [{"role": "user", "content": "Weather in Oslo, and the time?"}],
        "tools": [WEATHER, TIME],
        "max_tokens": 200,
        "temperature": 0,
        "extra_body": {"regex": _regex_literal(written)},
    }
    resp = client.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)
    stream = client.chat.completions.create(stream=True, **kwargs)
    content, streamed, finish = _streamed_tools(stream)
    assert (content, finish) == ("Let me look.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    # The arguments stream piece by piece (the call opens at its header), not whole at the end.
    num_call_chunks = sum(
        bool(c.choices and c.choices[0].delta.tool_calls)
        for c in client.chat.completions.create(stream=True, **kwargs)
    )
    assert num_call_chunks > 2
    # A call that goes wrong before its header is content, verbatim; no call, finish "stop".
    broken = '<tool_call>\n{"name": "get_weather" "arguments": {"city": "Oslo"}}\n</tool_call>'
    kwargs["extra_body"] = {"regex": _regex_literal(broken)}
    resp = client.chat.completions.create(**kwargs)
    assert resp.choices[0].message.content == broken
    assert not resp.choices[0].message.tool_calls and resp.choices[0].finish_reason == "stop"
    # After its header it is a call already (it has streamed): its arguments are what came.
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    kwargs["extra_body"] = {"regex": _regex_literal(broken)}
    resp = client.chat.completions.create(**kwargs)
    (call,) = resp.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": }')
    assert not resp.choices[0].message.content and resp.choices[0].finish_reason == "tool_calls"


def test_reasoning_is_split_off_whole_and_streamed(
    client: openai.OpenAI, served_model: str
) -> None:
    """The stack's router runs `--reasoning-parser qwen3`: a think block opening the output
    (forced here by a regex) comes back as reasoning_content, the rest as content or tool
    calls; an output without one is all content."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    kwargs = {
        "model": served_model,
        "messages": [{"role": "user", "content": "Think, then answer."}],
        "max_tokens": 120,
        "temperature": 0,
    }
    for written, tools, want in (
        ("<think>\nweigh it up\n</think>\n\nIt is sunny.", None, ("weigh it up", "It is sunny.")),
        ("<think>need the time</think>\n" + call, [TIME], ("need the time", None)),
        ("No block, just text.", None, (None, "No block, just text.")),
    ):
        extra = {"extra_body": {"regex": _regex_literal(written)}}
        if tools:
            extra["tools"] = tools
        message = client.chat.completions.create(**kwargs, **extra).choices[0].message
        assert (message.reasoning_content, message.content) == want
        assert bool(message.tool_calls) == bool(tools)
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(stream=True, **kwargs, **extra):
            delta = chunk.choices[0].delta if chunk.choices else None
            reasoning += (delta and getattr(delta, "reasoning_content", None)) or ""
            content += (delta and delta.content) or ""
        assert (reasoning or None, content or None) == want
    # SGLang's separate_reasoning false: the block stays in the content
    written = "<think>keep me</think> Fine."
    extra = {"regex": _regex_literal(written), "separate_reasoning": False}
    message = client.chat.completions.create(**kwargs, extra_body=extra).choices[0].message
    assert (getattr(message, "reasoning_content", None), message.content) == (None, written)


def test_tool_choice_named_and_required_constrain_the_calls(
    client: openai.OpenAI, served_model: str, http_stack: Stack
) -> None:
    """A named function: one call to it, arguments valid for its schema (streamed as they
    are generated); required: at least one call of the listed tools (exactly one without
    parallel calls); sampled with a seed, so whole and streamed agree."""
    import json

    import jsonschema

    base = {
        "model": served_model,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [WEATHER, TIME],
        "max_tokens": 400,
        "temperature": 0.8,
        "seed": 5,
        "logit_bias": _no_blank_tokens(http_stack.model),
    }
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(tool_choice=named, **base)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(tool_choice=named, stream=True, **base))
    content, streamed, finish = _streamed_tools(chunks)
    assert (content, finish) == ("", "stop")
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        ("get_weather", call.function.arguments)
    ]
    num_argument_chunks = sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks)
    assert num_argument_chunks > 1  # the arguments streamed, not sent at the end
    # required, one call (parallel_tool_calls false): always exactly one valid call
    for seed in range(3):
        args = {**base, "seed": seed, "parallel_tool_calls": False}
        resp = client.chat.completions.create(tool_choice="required", **args)
        (call,) = resp.choices[0].message.tool_calls
        assert resp.choices[0].finish_reason == "tool_calls"
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        stream = client.chat.completions.create(tool_choice="required", stream=True, **args)
        _, streamed, finish = _streamed_tools(stream)
        assert finish == "tool_calls"
        assert [(s["name"], s["arguments"]) for s in streamed.values()] == [
            (call.function.name, call.function.arguments)
        ]
    # required with parallel calls: a random model rarely closes the list; cut off by
    # max_tokens, the calls begun before the cut stay calls (they streamed from their header),
    # the last one with the arguments that came; an unfinished header is content, verbatim;
    # finish "length"
    for max_tokens in (60, 200):
        args = {**base, "max_tokens": max_tokens}
        choice = client.chat.completions.create(tool_choice="required", **args).choices[0]
        calls = choice.message.tool_calls or []
        cut = choice.finish_reason == "length" and not choice.message.content
        for k, call in enumerate(calls):
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            if cut and k == len(calls) - 1:  # cut off inside its arguments
                assert call.function.arguments.startswith("{")
                continue
            schema = tool["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
        if choice.finish_reason == "length":
            assert calls or choice.message.content
            text = choice.message.content or ""
            assert not text or text.lstrip("[, \n\t").startswith('{"name":')
        else:
            assert choice.finish_reason == "tool_calls" and calls
        stream = client.chat.completions.create(tool_choice="required", stream=True, **args)
        content, streamed, finish = _streamed_tools(stream)
        assert finish == choice.finish_reason and content == (choice.message.content or "")
        assert [(s["name"], s["arguments"]) for s in streamed.values()] == [
            (c.function.name, c.function.arguments) for c in calls]  # fmt: skip


def test_a_conversation_with_tool_results_renders_like_transformers(
    client: openai.OpenAI, served_model: str, http_stack: Stack
) -> None:
    """The assistant's earlier calls and the tool's answers go through the model's own chat
    template: the prompt has exactly as many tokens as transformers renders for it."""
    from engine.tokenizer import load_tokenizer

    paris = '{"city": "Paris", "days": 1}'
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": paris},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    resp = client.chat.completions.create(
        model=served_model, messages=messages, tools=[WEATHER], max_tokens=1
    )
    tok = load_tokenizer(http_stack.model)
    reference = [dict(m) for m in messages]
    reference[2] = {**messages[2], "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}
    ]}  # fmt: skip
    text = tok.apply_chat_template(
        reference, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert '"arguments": {"city": "Paris", "days": 1}' in text
    assert resp.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_tool_errors_are_the_clients_exceptions(client: openai.OpenAI, served_model: str) -> None:
    base = {"model": served_model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    cases = [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope', which is not among the tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required",
             "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),  # fmt: skip
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ]}]},
            "only assistant messages carry tool_calls",
        ),  # fmt: skip
    ]
    for extra, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(**{**base, **extra})


def test_an_assistant_prefill_is_continued_and_echoed(
    client: openai.OpenAI, served_model: str, http_stack: Stack
) -> None:
    """vLLM's continue_final_message: the output continues the last (assistant) message, whose
    turn the prompt leaves open; with echo, the content starts with that message."""
    from engine.tokenizer import load_tokenizer

    prefill = "Sure. Step 1:"
    messages = [{"role": "user", "content": "How do I boil an egg?"},
                {"role": "assistant", "content": prefill}]  # fmt: skip
    options = {"add_generation_prompt": False, "continue_final_message": True}
    ask = {"model": served_model, "messages": messages, "max_tokens": 8, "temperature": 0}
    plain = client.chat.completions.create(**ask, extra_body={**options, "ignore_eos": True})
    echoed = client.chat.completions.create(
        **ask, extra_body={**options, "ignore_eos": True, "echo": True}
    )
    assert echoed.choices[0].message.content == prefill + plain.choices[0].message.content
    chunks = client.chat.completions.create(
        **ask, stream=True, extra_body={**options, "ignore_eos": True, "echo": True}
    )
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert deltas[0].startswith(prefill) and "".join(deltas) == echoed.choices[0].message.content
    # the prompt is transformers' rendering with the turn left open: the same ids as a
    # completion continue the same way
    tok = load_tokenizer(http_stack.model)
    text = tok.apply_chat_template(messages, tokenize=False, **options)
    ids = tok.encode(text, add_special_tokens=False)
    assert text.endswith(prefill) and plain.usage.prompt_tokens == len(ids)
    completion = client.completions.create(
        model=served_model, prompt=ids, max_tokens=8, **GREEDY
    )
    assert completion.choices[0].text == plain.choices[0].message.content
    # echo without a prefill echoes nothing (the last message is the user's)
    ask["messages"] = messages[:1]
    opened = client.chat.completions.create(**ask, extra_body={"echo": True, "ignore_eos": True})
    alone = client.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    assert opened.choices[0].message.content == alone.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt=false"):
        client.chat.completions.create(**ask, extra_body={"continue_final_message": True})


def test_responses_api_as_the_client_calls_it(
    client: openai.OpenAI, served_model: str, http_stack: Stack
) -> None:
    """`client.responses.create`, whole and streamed, gives the chat completion's text; a
    named function tool gives one function_call item whose arguments fit its schema."""
    import json

    import jsonschema

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(
        model=served_model, messages=messages, max_tokens=12, **GREEDY
    )
    ask = {"model": served_model, "instructions": "Be brief.", "input": "Hi",
           "max_output_tokens": 12, **GREEDY}  # fmt: skip
    resp = client.responses.create(**ask)
    assert resp.output_text == chat.choices[0].message.content
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 12
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    evs = list(client.responses.create(stream=True, **ask))
    text = "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    assert text == resp.output_text
    assert evs[-1].type == "response.incomplete" and evs[-1].response.output_text == text
    # a named function tool: the output is constrained to its arguments
    tool = {"type": "function", **WEATHER["function"]}
    called = client.responses.create(
        model=served_model,
        input="Weather?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=400,
        temperature=0.8,
        extra_body={"seed": 5, "logit_bias": _no_blank_tokens(http_stack.model)},
    )
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])


def test_responses_are_stored_and_continued_as_the_client_does_it(
    client: openai.OpenAI, served_model: str
) -> None:
    """`previous_response_id` means the whole conversation sent again; the stored response
    is retrieved, listed and deleted with the client's own calls."""
    ask = {"model": served_model, "max_output_tokens": 8, **GREEDY}
    first = client.responses.create(input="Hi", **ask)
    assert first.store and client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(input="And then?", previous_response_id=first.id, **ask)
    turns = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And then?"}]  # fmt: skip
    whole = client.responses.create(input=turns, store=False, **ask)
    assert not whole.store and second.previous_response_id == first.id
    assert second.output_text == whole.output_text
    assert second.usage.input_tokens == whole.usage.input_tokens
    items = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [item.role for item in items] == ["user", "assistant", "user"]  # two pages
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_responses_truncation_auto_drops_the_earliest_turns(
    client: openai.OpenAI, served_model: str, http_stack: Stack
) -> None:
    """A conversation longer than the tiny model's context: refused as it is ("disabled",
    the default), answered with `truncation="auto"` as if it began at the first turn from
    which it fits (found here with /tokenize), the instructions kept."""
    turns = []
    for t in range(24):
        turns += [{"role": "user", "content": f"question {t} " + "word " * 40},
                  {"role": "assistant", "content": f"answer {t} " + "more " * 40}]  # fmt: skip
    turns.append({"role": "user", "content": "last question"})
    ask = {"model": served_model, "instructions": "Be brief.", "max_output_tokens": 8, **GREEDY}
    context = httpx.get(http_stack.router_url + "/get_model_info").json()["max_context_length"]

    def prompt_len(items: list[dict]) -> int:
        messages = [{"role": "system", "content": "Be brief."}, *items]
        return client.post("/tokenize", body={"messages": messages}, cast_to=dict)["count"]

    assert prompt_len(turns) + 8 > context
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.responses.create(input=turns, **ask)
    first = next(s for s in range(0, len(turns), 2) if prompt_len(turns[s:]) + 8 <= context)
    assert first > 0
    cut = client.responses.create(input=turns, truncation="auto", **ask)
    same = client.responses.create(input=turns[first:], **ask)
    assert cut.truncation == "auto" and same.truncation == "disabled"
    assert cut.usage.input_tokens == same.usage.input_tokens == prompt_len(turns[first:])
    assert cut.output_text == same.output_text


def test_a_background_response_as_the_client_polls_streams_and_cancels_it(
    client: openai.OpenAI, served_model: str
) -> None:
    """`background=True`: queued at once, polled with `retrieve` until done (the same as a
    foreground response), its events streamed again with `retrieve(stream=True)` from a
    sequence number on (12 tokens: it ends incomplete); cancelling a finished one is the
    client's BadRequestError."""
    ask = {"model": served_model, "max_output_tokens": 12, **GREEDY}
    queued = client.responses.create(input="Tell me", background=True, **ask)
    assert queued.status == "queued" and queued.background
    deadline = time.monotonic() + 60
    while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    foreground = client.responses.create(input="Tell me", **ask)
    assert done.status == foreground.status and done.output_text == foreground.output_text
    events = list(client.responses.retrieve(queued.id, stream=True, starting_after=1))
    assert events[0].sequence_number == 2 and events[-1].type == f"response.{done.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        done.output_text
    )
    with pytest.raises(openai.BadRequestError, match=f"already {done.status}"):
        client.responses.cancel(queued.id)


def test_a_batch_answers_as_the_api_does(client: openai.OpenAI, served_model: str) -> None:
    """The Batch API on the real model: greedy chat and completion answers in the output file
    are the ones the same requests get over HTTP (services/batches.py)."""
    bodies = [{"model": served_model, "messages": [{"role": "user", "content": f"Count to {i}"}],
               "max_tokens": 12, "temperature": 0, "ignore_eos": True} for i in range(6)]
    lines = [{"custom_id": f"n{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
             for i, b in enumerate(bodies)]  # fmt: skip
    content = "\n".join(json.dumps(x) for x in lines).encode()
    uploaded = client.files.create(file=("chat.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert batch.status in ("validating", "in_progress", "finalizing"), batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 0)
    assert batch.error_file_id is None and batch.usage.output_tokens == 6 * 12
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == [f"n{i}" for i in range(6)]
    for body, line in zip(bodies, out, strict=True):
        extra = {"ignore_eos": body.pop("ignore_eos")}
        direct = client.chat.completions.create(**body, extra_body=extra)
        answered = line["response"]["body"]["choices"][0]["message"]["content"]
        assert answered == direct.choices[0].message.content and answered
