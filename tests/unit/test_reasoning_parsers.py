"""Reasoning parsers (services/reasoning_parsers.py): think blocks split off whole and streamed,
and a chat choice's split into reasoning, content and tool calls (`ChatSplit`)."""

from __future__ import annotations

import random

import pytest

from services.reasoning_parsers import REASONING_PARSERS, ReasoningStream, parse
from services.router_tools import ChatSplit, ToolMode
from shared.settings import REASONING_PARSERS as SETTING_CHOICES

CASES = [
    ("qwen3", "<think>\nplan a\nplan b\n</think>\n\nAnswer.", ("plan a\nplan b", "Answer.")),
    ("qwen3", " No think block: left as is ", ("", " No think block: left as is ")),
    ("qwen3", "  <think>x</think>", ("x", "")),
    ("qwen3", "<think>cut off by max_tokens  ", ("cut off by max_tokens", "")),
    ("qwen3", "<thi", ("", "<thi")),  # too short to be a block
    ("qwen3", "a <think>b</think>", ("", "a <think>b</think>")),  # a block only at the start
    ("qwen3", "<think> a </think> b </think> c", ("a", "b </think> c")),
    ("deepseek-r1", "plan\n</think>\n\nAnswer", ("plan", "Answer")),
    ("deepseek-r1", "<think>plan</think>Answer", ("plan", "Answer")),
    ("deepseek-r1", "all reasoning, never closed", ("all reasoning, never closed", "")),
    ("deepseek-r1", "</think>only content", ("", "only content")),
    ("qwen3-thinking", "", ("", "")),
]  # fmt: skip


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_whole_and_streamed_in_any_pieces_agree(
    parser: str, text: str, expected: tuple[str, str]
) -> None:
    assert parse(parser, text) == expected
    for seed in range(100):
        rng = random.Random(seed)
        stream, reasoning, content, i = ReasoningStream(parser), "", "", 0
        while i < len(text):
            j = i + rng.randint(1, 5)
            r, c = stream.feed(text[i:j])
            reasoning, content, i = reasoning + r, content + c, j
            # released text is never taken back: what is out is a prefix of the final
            assert expected[0].startswith(reasoning) and expected[1].startswith(content)
        r, c = stream.finish()
        assert (reasoning + r, content + c) == expected, seed


def test_reasoning_is_released_as_it_comes_and_content_after_it() -> None:
    stream = ReasoningStream("qwen3")
    assert stream.feed("<think>\nstep one") == ("step one", "")
    assert stream.feed(" and two\n</thi") == (" and two", "")  # newline and tag prefix wait
    assert stream.feed("nk>\n\nDone") == ("", "Done")
    assert stream.feed(" now.") == ("", " now.")
    assert stream.finish() == ("", "")


def test_names_agree_with_the_settings_and_unknown_ones_fail() -> None:
    assert set(SETTING_CHOICES) == set(REASONING_PARSERS)
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'"):
        ReasoningStream("r1")


def test_chat_split_reasons_first_then_parses_tool_calls() -> None:
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    text = "<think>I need the weather.</think>\n" + call
    whole = ChatSplit(ToolMode("auto", parser="hermes"), "qwen3").step(text, True)
    assert (whole.reasoning, whole.content) == ("I need the weather.", "")
    assert [c["function"]["name"] for c in whole.calls] == ["f"]
    split = ChatSplit(ToolMode("auto", parser="hermes"), "qwen3")
    parts = [split.step(text[i : i + 7], i + 7 >= len(text)) for i in range(0, len(text), 7)]
    assert "".join(p.reasoning for p in parts) == whole.reasoning
    assert "".join(p.content for p in parts) == ""
    assert [c["function"] for p in parts for c in p.calls] == [c["function"] for c in whole.calls]
    assert split.called
