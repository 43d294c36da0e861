"""How a chat choice's output becomes reasoning, content and tool calls as it arrives
(`ChatSplit`: the reasoning parser first, then the tools' `ChoiceTools`); the tool modes are
explained in services/router_chat.py, the reasoning parsers in services/reasoning_parsers.py."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from services.reasoning_parsers import ReasoningStream
from services.tool_call_objects import CallDelta, CallObjects
from services.tool_parsers import KEEPS_SPECIAL_TOKENS, ToolCallStream


@dataclass
class ToolMode:
    """How one request's output becomes tool calls; `parser` is set for `auto`."""

    kind: Literal["auto", "required", "named"]
    name: str | None = None
    parser: str | None = None

    @property
    def keeps_special_tokens(self) -> bool:
        return self.parser in KEEPS_SPECIAL_TOKENS


@dataclass
class ChoiceTools:
    """One choice's tool calls as its text arrives: `step` returns (content, call deltas)."""

    mode: ToolMode
    calls: list[dict[str, Any]] = field(default_factory=list)
    _stream: ToolCallStream | None = None  # auto: the parser's format
    _list: CallObjects = field(default_factory=CallObjects)  # required: a JSON list of calls

    def __post_init__(self) -> None:
        if self.mode.kind == "auto":
            assert self.mode.parser is not None
            self._stream = ToolCallStream(self.mode.parser)

    @property
    def called(self) -> bool:
        """Whether the output made calls (so finish_reason "stop" becomes "tool_calls")."""
        return bool(self.calls) and self.mode.kind != "named"

    def step(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        if self._stream is not None:
            content, found = self._stream.feed(text)
            if finished:
                rest, more = self._stream.finish()
                content, found = content + rest, found + more
            return content, [self._delta(d) for d in found]
        if self.mode.kind == "named":
            if not self.calls:  # the call opens with its first arguments
                return "", [self._add(self.mode.name or "", text)] if text or finished else []
            return "", [self._delta(CallDelta(0, None, text))] if text else []
        found = self._list.feed(text)  # each call from its header on, as it comes
        if not finished:
            return "", [self._delta(d) for d in found]
        self._list.finish()  # cut off (max_tokens): what is not a call yet is text, verbatim
        text = self._list.rest() if self._list.calls else self._list.text
        return text, [self._delta(d) for d in found]

    def _delta(self, d: CallDelta) -> dict[str, Any]:
        """The OpenAI delta of a call's piece, the call itself kept up to date."""
        if d.name is not None:
            return self._add(d.name, d.arguments)
        self.calls[d.index]["function"]["arguments"] += d.arguments
        return {"index": d.index, "function": {"arguments": d.arguments}}

    def _add(self, name: str, arguments: str) -> dict[str, Any]:
        call = {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call, "function": dict(call["function"])}


@dataclass
class Part:
    """What a piece of a chat choice's text turned out to be."""

    content: str
    reasoning: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # tool call deltas


class ChatSplit:
    """One chat choice's text, as it arrives, as reasoning, content and tool calls."""

    def __init__(self, tool_mode: ToolMode | None, reasoning_parser: str | None) -> None:
        self.tools = ChoiceTools(tool_mode) if tool_mode is not None else None
        self.reasoning = ReasoningStream(reasoning_parser) if reasoning_parser else None

    @property
    def calls(self) -> list[dict[str, Any]]:
        return self.tools.calls if self.tools is not None else []

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def step(self, text: str, final: bool) -> Part:
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
            if final:
                more, rest = self.reasoning.finish()
                reasoning, text = reasoning + more, text + rest
        if self.tools is None:
            return Part(text, reasoning)
        content, calls = self.tools.step(text, final)
        return Part(content, reasoning, calls)
