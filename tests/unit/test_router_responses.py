"""Response and SSE chunk shapes, built from deltas without a server."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from services.router_protocol import SubRequest
from services.router_responses import Choice, Formatter, TokenNames, usage
from services.router_stream import Delta, Usage
from shared.messages import FinishReason


def formatter(kind: str, logprobs: bool = False, n: int = 1) -> Formatter:
    handles = [
        SimpleNamespace(
            rid=f"r{i}",
            sub=SubRequest(
                i, 0, {}, text="x", return_logprob=logprobs, top_logprobs_num=2 if logprobs else 0
            ),
        )
        for i in range(n)
    ]
    return Formatter(kind, "cmpl-1", 7, "m", TokenNames(), handles)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("text", ["plain", 'quote " and \\ back', "你好 😀", "\n\t\u2028", ""])
def test_fast_text_chunks_are_byte_identical_to_the_full_form(kind: str, text: str) -> None:
    f = formatter(kind, n=3)
    for index in (0, 2):
        c = Choice(index, rid=f"r{index}", pieces=["earlier"], output_ids=[1])
        d = Delta(text=text, output_ids=[5])
        assert f._chunk(c, d, first=False) == f._full_chunk(c, d, first=False)


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
    comp = formatter("completion", logprobs=True)._logprobs([7, 8], lps, tops)
    assert comp == {
        "tokens": ["token_id:7", "token_id:8"],
        "token_logprobs": lps,
        "top_logprobs": [
            {"token_id:7": -0.5, "token_id:8": -0.9},
            {"token_id:8": -1.0, "token_id:7": -1.5},
        ],
        "text_offset": [0, 10],
    }
    chat = formatter("chat", logprobs=True)._logprobs([7, 8], lps, tops)["content"]
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
    meta = formatter("generate")._generate_obj(c, [4, 5, 6], "abc")["meta_info"]
    assert meta["finish_reason"] == expected
