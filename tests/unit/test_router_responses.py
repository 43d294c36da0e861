"""Response and SSE chunk shapes, built from deltas without a server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from services.router_logprobs import TokenNames, generate_obj, openai_logprobs
from services.router_protocol import SubRequest
from services.router_responses import Formatter
from services.router_stream import Choice, Delta, Usage, usage
from services.router_tools import Part
from shared.messages import FinishReason, PromptLogprobs


def formatter(
    kind: str,
    logprobs: bool = False,
    n: int = 1,
    outputs: list[list[Delta]] | None = None,
    echo: bool = False,
    texts: bool = False,
    arrived: float | None = None,
    **options: bool,
) -> Formatter:
    """A Formatter over `n` fake handles; handle i yields the deltas `outputs[i]` (`texts`:
    SGLang's return_text_in_logprobs; `arrived`: the request's arrival, None: unknown, so
    that responses carry no latency and compare equal)."""

    def handle(i: int) -> SimpleNamespace:
        async def deltas() -> AsyncIterator[Delta]:
            for d in (outputs or [[]] * n)[i]:
                yield d

        top = 2 if logprobs else 0
        sub = SubRequest(i, 0, {}, text="x", return_logprob=logprobs, top_logprobs_num=top,
                         echo=echo, return_text_in_logprobs=texts)  # fmt: skip
        return SimpleNamespace(public_rid=f"r{i}", sub=sub, deltas=deltas, close=lambda: None,
                               arrived=arrived)  # fmt: skip

    handles = [handle(i) for i in range(n)]
    return Formatter(kind, "cmpl-1", 7, "m", TokenNames(), handles, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("text", ["plain", 'quote " and \\ back', "你好 😀", "\n\t\u2028", ""])
def test_fast_text_chunks_are_byte_identical_to_the_full_form(kind: str, text: str) -> None:
    f = formatter(kind, n=3)
    for index in (0, 2):
        c = Choice(index, rid=f"r{index}", pieces=["earlier"], output_ids=[1])
        d = Delta(text=text, output_ids=[5])
        assert f._chunk(c, d, first=False) == f._full_chunk(c, d, first=False)


@pytest.mark.parametrize("arguments", ['{"a": 1', 'quote \\" and \\\\', "你好 😀", ""])
def test_fast_argument_chunks_are_byte_identical_to_the_full_form(arguments: str) -> None:
    f = formatter("chat", n=2)
    for index, call in ((0, 0), (1, 3), (1, 0)):
        c = Choice(index, rid=f"r{index}", pieces=["earlier"], output_ids=[1])
        d = Delta(text="x", output_ids=[5])
        part = Part("", calls=[{"index": call, "function": {"arguments": arguments}}])
        fast = f._chunk(c, d, False, part)
        assert fast == f._full_chunk(c, d, False, part)
        assert json.loads(fast[6:])["choices"][0]["delta"]["tool_calls"][0]["index"] == call
    opening = {"index": 0, "id": "call_1", "type": "function",
               "function": {"name": "f", "arguments": "{"}}  # fmt: skip
    part = Part("", calls=[opening])  # a call's first delta: the full form
    assert json.loads(f._chunk(c, d, False, part)[6:])["choices"][0]["delta"]["tool_calls"] == [
        opening]  # fmt: skip


def test_chat_chunks_name_the_role_first_then_only_content() -> None:
    f = formatter("chat")
    c = Choice(0)
    first = json.loads(f._chunk(c, Delta(text="Hi", output_ids=[1]), first=True)[6:])
    later = json.loads(f._chunk(c, Delta(text=" there", output_ids=[2]), first=False)[6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert later["choices"][0]["delta"] == {"content": " there"}
    assert later["object"] == "chat.completion.chunk" and later["id"] == "cmpl-1"


def test_final_chunk_carries_finish_reason_and_matched_stop() -> None:
    f = formatter("completion")
    c = Choice(0)
    d = Delta(
        text="end", output_ids=[3], finish_reason=FinishReason("stop", "</s>"), usage=Usage(4, 3, 1)
    )
    c.add(d)
    choice = json.loads(f._chunk(c, d, first=False)[6:])["choices"][0]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", "</s>")


def test_usage_counts_each_prompt_once_and_sums_completions() -> None:
    choices = [Choice(i, usage=Usage(10 + i // 2, 5, 4)) for i in range(4)]
    got = usage(choices, {0: 0, 1: 0, 2: 1, 3: 1})
    assert got == {
        "prompt_tokens": 21,
        "completion_tokens": 20,
        "total_tokens": 41,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_logprobs_shapes_of_completions_and_chat() -> None:
    lps, tops = [-0.5, -1.0], [[(7, -0.5), (8, -0.9), (9, -2.0)], [(8, -1.0), (7, -1.5)]]
    comp = openai_logprobs(TokenNames(), False, 2, [7, 8], lps, tops)
    assert comp == {
        "tokens": ["token_id:7", "token_id:8"],
        "token_logprobs": lps,
        "top_logprobs": [
            {"token_id:7": -0.5, "token_id:8": -0.9},
            {"token_id:8": -1.0, "token_id:7": -1.5},
        ],
        "text_offset": [0, 10],
    }
    chat = openai_logprobs(TokenNames(), True, 2, [7, 8], lps, tops)["content"]
    assert chat[0]["token"] == "token_id:7" and chat[0]["bytes"] == list(b"token_id:7")
    assert [t["logprob"] for t in chat[1]["top_logprobs"]] == [-1.0, -1.5]


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (FinishReason("length"), {"type": "length", "length": 3}),
        (FinishReason("stop", 2), {"type": "stop", "matched": 2}),
        (FinishReason("abort", message="gone"), {"type": "abort", "message": "gone"}),
    ],
)
def test_generate_meta_finish_reason_has_sglang_shape(reason: FinishReason, expected: dict) -> None:
    """`/generate`'s `meta_info.finish_reason` as SGLang writes it: a length finish carries
    the length (not a null `matched`), a stop its match, an abort its message."""
    c = Choice(0, rid="r0", output_ids=[4, 5, 6])
    c.add(Delta(text="", output_ids=[], finish_reason=reason, usage=Usage(2, 3, 0)))
    meta = generate_obj(c, "abc", 0, False, 0)["meta_info"]
    assert meta["finish_reason"] == expected


def generate_outputs(index: int) -> list[Delta]:
    """One `/generate` output in deltas: multi-byte text, a token whose text is held back,
    logprobs, and a last delta that carries only the finish."""
    base = 10 * index
    return [
        Delta("你好", [base + 1, base + 2], [-0.1, -0.2], [[(base + 1, -0.1)], [(base + 2, -0.2)]]),
        Delta("", [base + 3], [-0.3], [[(base + 3, -0.3), (9, -1.0)]]),
        Delta(" 🙂x", [base + 4], [-0.4], [[(base + 4, -0.4)]]),
        Delta(finish_reason=FinishReason("length"), usage=Usage(1, 4, 0)),
    ]


def generate_streams(n: int, incremental: bool) -> tuple[dict[int, list[dict]], object]:
    """(each choice's streamed `/generate` objects, the non-streamed response)."""
    outputs = [generate_outputs(i) for i in range(n)]
    options = {"batch": n > 1, **({"incremental": True} if incremental else {})}

    async def run() -> tuple[list[bytes], object]:
        chunks = [c async for c in formatter("generate", True, n, outputs, **options).chunks()]
        return chunks, await formatter("generate", True, n, outputs, **options).response()

    chunks, whole = asyncio.run(run())
    assert chunks[-1] == b"data: [DONE]\n\n"
    streams: dict[int, list[dict]] = {i: [] for i in range(n)}
    for chunk in chunks[:-1]:
        obj = json.loads(chunk[len("data: ") :])
        streams[obj.pop("index", 0)].append(obj)
    return streams, whole


LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs")


def counts(obj: dict) -> dict:
    return {k: v for k, v in obj["meta_info"].items() if k not in LOGPROB_KEYS}


@pytest.mark.parametrize("n", [1, 2])
def test_incremental_generate_chunks_add_up_to_the_cumulative_stream_and_the_response(
    n: int,
) -> None:
    """With `--incremental-streaming-output`, the chunks of a `/generate` stream (single or
    batch) are disjoint pieces: joined, they are the cumulative stream's last chunk and the
    non-streamed response; `meta_info`'s counts and finish reason are the same in both modes."""
    incremental, _ = generate_streams(n, incremental=True)
    cumulative, whole = generate_streams(n, incremental=False)
    for i in range(n):
        inc, cum = incremental[i], cumulative[i]
        assert len(inc) == len(cum) == 4
        joined = {
            "text": "".join(o["text"] for o in inc),
            "output_ids": [t for o in inc for t in o["output_ids"]],
            "meta_info": dict(inc[-1]["meta_info"]),
        }
        for key in LOGPROB_KEYS:
            joined["meta_info"][key] = [x for o in inc for x in o["meta_info"][key]]
        assert joined == cum[-1] == (whole[i] if n > 1 else whole)  # type: ignore[index]
        assert [o["output_ids"] for o in inc] == [d.output_ids for d in generate_outputs(i)]
        for o_inc, o_cum in zip(inc, cum, strict=True):
            assert len(o_inc["meta_info"]["output_token_logprobs"]) == len(o_inc["output_ids"])
            assert counts(o_inc) == counts(o_cum)  # completion_tokens etc.: the whole output's
        assert inc[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_generate_stream_is_cumulative_by_default() -> None:
    """Without the flag, every chunk carries the text and ids so far (SGLang's default)."""
    stream = generate_streams(1, incremental=False)[0][0]
    texts = [o["text"] for o in stream]
    assert texts == ["你好", "你好", "你好 🙂x", "你好 🙂x"]
    assert [len(o["output_ids"]) for o in stream] == [2, 3, 4, 4]


PROMPT = PromptLogprobs(0, [1, 2, 3], [-1.0, -2.0], [[7, 8], [9, 8]], [[-0.5, -0.9], [-0.1, -3.0]])


def echo_outputs() -> list[Delta]:
    return [
        Delta("ab", [4], [-0.25], [[(4, -0.25)]], prompt_logprobs=PROMPT),
        Delta("c", [5], [-0.5], [[(5, -0.5)]], FinishReason("length"), Usage(3, 2, 0)),
    ]


@pytest.mark.parametrize("logprobs", [False, True])
def test_echo_puts_the_prompt_and_its_logprobs_before_the_output(logprobs: bool) -> None:
    """`echo` (vLLM / OpenAI legacy completions): the prompt's text first, and with logprobs
    its tokens too (none for the first); streamed, in each choice's first chunk."""

    async def run() -> tuple[dict, list[dict]]:
        whole = await formatter("completion", logprobs, 1, [echo_outputs()], echo=True).response()
        f = formatter("completion", logprobs, 1, [echo_outputs()], echo=True)
        chunks = [json.loads(c[6:]) for c in [c async for c in f.chunks()][:-1]]
        return whole, chunks

    whole, chunks = asyncio.run(run())
    choice = whole["choices"][0]
    assert choice["text"] == "xabc"
    assert [c["choices"][0]["text"] for c in chunks] == ["xab", "c"]
    if not logprobs:
        assert choice["logprobs"] is None
        return
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in (1, 2, 3, 4, 5)]
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.25, -0.5]
    assert lp["top_logprobs"][:3] == [
        None, {"token_id:7": -0.5, "token_id:8": -0.9}, {"token_id:9": -0.1, "token_id:8": -3.0}
    ]  # fmt: skip
    first, last = (c["choices"][0]["logprobs"] for c in chunks)
    assert first["token_logprobs"] == [None, -1.0, -2.0, -0.25]
    assert last["token_logprobs"] == [-0.5]


@pytest.mark.parametrize("texts", [False, True], ids=["ids", "texts"])
@pytest.mark.parametrize("incremental", [False, True])
def test_generate_reports_the_prompt_logprobs(incremental: bool, texts: bool) -> None:
    """SGLang's `input_token_logprobs` / `input_top_logprobs`: [logprob, id, text] from the
    start position (None for the prompt's first token; the text None unless
    `return_text_in_logprobs`, as SGLang gives them); in every cumulative chunk, in the
    first incremental one. The output's entries have the same shape."""

    def make() -> Formatter:
        options = {"incremental": True} if incremental else {}
        return formatter("generate", True, 1, [echo_outputs()], texts=texts, **options)

    async def run() -> tuple[dict, list[dict]]:
        whole = await make().response()
        return whole, [json.loads(c[6:]) for c in [c async for c in make().chunks()][:-1]]

    whole, chunks = asyncio.run(run())
    name = "token_id:{}".format if texts else lambda t: None  # (no tokenizer.json here)
    want = {
        "input_token_logprobs": [[None, 1, name(1)], [-1.0, 2, name(2)], [-2.0, 3, name(3)]],
        "input_top_logprobs": [None, [[-0.5, 7, name(7)], [-0.9, 8, name(8)]],
                               [[-0.1, 9, name(9)], [-3.0, 8, name(8)]]],
    }  # fmt: skip
    assert {k: whole["meta_info"][k] for k in want} == want
    out = whole["meta_info"]["output_token_logprobs"]
    assert [e[1:] for e in out] == [[t, name(t)] for t in whole["output_ids"]]
    assert all(len(row[0]) == 3 for row in whole["meta_info"]["output_top_logprobs"])
    has = ["input_token_logprobs" in c["meta_info"] for c in chunks]
    assert has == ([True, False] if incremental else [True, True])
    assert {k: chunks[0]["meta_info"][k] for k in want} == want


RANKED = PromptLogprobs(
    0, [1, 2, 8], [-1.0, -2.0], [[7, 8], [9, 8]], [[-0.5, -0.9], [-0.1, -2.0]], [4, 2]
)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_vllm_prompt_logprobs_rank_the_prompt_tokens_with_their_best_candidates(
    kind: str,
) -> None:
    """vLLM's `prompt_logprobs`: None first, then {id: {logprob, rank, decoded_token}} with
    the prompt token first and the k best after it (a token among them once); per choice in a
    completion, in the body of a chat; output logprobs only if asked for."""
    outputs = [[Delta("ab", [4], [-0.25], [[(4, -0.25)]], FinishReason("length"), Usage(3, 1, 0),
                      prompt_logprobs=RANKED)]]  # fmt: skip
    f = formatter(kind, False, 1, outputs)
    f.subs[0].prompt_logprobs = 1
    body = asyncio.run(f.response())
    got = body["choices"][0]["prompt_logprobs"] if kind == "completion" else body["prompt_logprobs"]
    name = "token_id:{}".format
    assert got == [
        None,
        {2: {"logprob": -1.0, "rank": 4, "decoded_token": name(2)},
         7: {"logprob": -0.5, "rank": 1, "decoded_token": name(7)}},
        {8: {"logprob": -2.0, "rank": 2, "decoded_token": name(8)},
         9: {"logprob": -0.1, "rank": 1, "decoded_token": name(9)}},
    ]  # fmt: skip
    assert body["choices"][0]["logprobs"] is None
    f = formatter(kind, False, 1, outputs)
    assert "prompt_logprobs" not in json.dumps(asyncio.run(f.response()))  # not asked for


@pytest.mark.parametrize("stream", [False, True])
def test_generate_reports_sglangs_e2e_latency_once_ended(stream: bool) -> None:
    """SGLang's `meta_info.e2e_latency`: seconds from the request's arrival to its end, in
    the response (the last chunk when streamed; none before it)."""
    import time

    async def run() -> list[dict]:
        f = formatter("generate", False, 1, [generate_outputs(0)], arrived=time.perf_counter() - 2)
        if not stream:
            return [await f.response()]
        return [json.loads(c[6:]) for c in [c async for c in f.chunks()][:-1]]

    objs = asyncio.run(run())
    assert ["e2e_latency" in o["meta_info"] for o in objs] == [False] * (len(objs) - 1) + [True]
    assert 2 <= objs[-1]["meta_info"]["e2e_latency"] < 60
