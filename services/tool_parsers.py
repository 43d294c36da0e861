"""Tool calls in generated text: the formats models write them in, parsed whole or as they stream.

A parser splits a model's output into content (text for the user) and tool calls. The formats
(names as SGLang's and vLLM's `--tool-call-parser`):

* `hermes` (also `qwen25`, `qwen`): each call is `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, after optional content (Hermes 2/3, Qwen2.5, Qwen3 and sluice's tiny models).
* `llama3` (also `llama3_json`): the whole output is `{"name": ..., "parameters": {...}}`, maybe
  after `<|python_tag|>`, several calls separated by `;` (Llama 3.1/3.2 JSON tool calling).
* `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (Mistral's
  v3 tokenizer format; `[TOOL_CALLS]` is a special token, so the router keeps special tokens).

Streaming and whole parsing are one code path (`ToolCallStream`; `parse` feeds everything and
finishes), so a stream's content and calls always equal the whole response's. Released content
is never taken back: a tail that could still begin a call (a prefix of the opening tag, or
whitespace before one) is held until the next text decides it. A call that does not parse (bad
JSON, no name, non-object arguments, cut off by max_tokens) is released as content, verbatim
(with the whitespace before it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from services.router_stream import prefix_tail

PARSERS = ("hermes", "llama3", "mistral")
ALIASES = {"qwen25": "hermes", "qwen": "hermes", "qwen3": "hermes", "llama3_json": "llama3"}
KEEPS_SPECIAL_TOKENS = {"mistral"}  # its marker is a special token


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class _Format:
    start: str  # what opens the calls
    end: str | None  # what closes one call (None: the calls run to the end of the output)
    at_start_only: bool = False  # calls only if the output begins with them (llama3)
    also_starts: str | None = None  # a second opening (llama3: a bare "{")


_FORMATS = {
    "hermes": _Format("<tool_call>", "</tool_call>"),
    "llama3": _Format("<|python_tag|>", None, at_start_only=True, also_starts="{"),
    "mistral": _Format("[TOOL_CALLS]", None),
}


def canonical(name: str) -> str:
    """The parser's own name for `name` (an alias allowed); ValueError if unknown."""
    name = ALIASES.get(name, name)
    if name not in _FORMATS:
        known = ", ".join(sorted([*PARSERS, *ALIASES]))
        raise ValueError(f"unknown tool call parser {name!r} (known: {known})")
    return name


def infer_parser(chat_template: str | None) -> str | None:
    """The format a chat template teaches its model, if it renders tools in a known one."""
    if not chat_template or "tools" not in chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return "llama3"
    return None


class ToolCallStream:
    """Content and tool calls of one output, from its text as it grows (see module doc)."""

    def __init__(self, parser: str) -> None:
        self.fmt = _FORMATS[canonical(parser)]
        self.parser = canonical(parser)
        self.pending = ""  # text not yet released: held back, or the body of an open call
        self.in_call = False
        self.searched = 0  # how much of an open call's body holds no closing tag
        self.opening = ""  # the text that opened the current call (whitespace before it too)
        self.decided = False  # at_start_only formats: whether the output begins with a call
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content and calls that `text` (the next piece of output) makes certain."""
        if not self.in_call and not self.pending and self._plain(text):
            return text, []  # the common case, content far from any call: nothing to hold
        self.pending += text
        content, calls = [], []
        while True:
            if self.in_call:
                if not self._close_call(content, calls):
                    break
                continue
            released, opened = self._scan_content()
            content.append(released)
            if not opened:
                break
        return "".join(content), calls

    def _plain(self, text: str) -> bool:
        if self.fmt.at_start_only:
            return self.decided
        return self.fmt.start[0] not in text and not text[-1:].isspace()

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left once the output is complete."""
        if self.in_call:
            body, self.pending, self.in_call = self.pending, "", False
            calls = self._parse_body(body)
            if calls is not None:
                self.num_calls += len(calls)
                return "", calls
            return self.opening + body, []
        rest, self.pending = self.pending, ""
        return ("" if self.num_calls and not rest.strip() else rest), []

    # -- content ------------------------------------------------------------------------------
    def _scan_content(self) -> tuple[str, bool]:
        """Release content up to an opening (entering the call) or up to what must be held."""
        text, fmt = self.pending, self.fmt
        if fmt.at_start_only:
            return self._scan_start(text)
        pos = text.find(fmt.start)
        if pos >= 0:
            before = text[:pos].rstrip()
            self.opening = text[len(before) : pos + len(fmt.start)]
            self.pending, self.in_call = text[pos + len(fmt.start) :], True
            return before, True
        head = text[: len(text) - prefix_tail(text, fmt.start)]
        cut = len(head.rstrip())  # whitespace before a possible opening waits too
        released, self.pending = text[:cut], text[cut:]
        return released, False

    def _scan_start(self, text: str) -> tuple[str, bool]:
        if self.decided:
            self.pending = ""
            return text, False
        stripped = text.lstrip()
        fmt = self.fmt
        if stripped.startswith(fmt.start) or (
            fmt.also_starts and stripped.startswith(fmt.also_starts)
        ):
            self.decided, self.in_call = True, True
            self.pending = stripped.removeprefix(fmt.start)
            self.opening = text[: len(text) - len(self.pending)]
            return "", True
        if not stripped or fmt.start.startswith(stripped):
            return "", False  # not decided yet
        self.decided, self.pending = True, ""
        return text, False

    # -- calls --------------------------------------------------------------------------------
    def _close_call(self, content: list[str], calls: list[ToolCall]) -> bool:
        """End the open call if its closing tag has come; False if it has not."""
        end = self.fmt.end
        if end is None:
            return False
        pos = self.pending.find(end, max(0, self.searched - len(end) + 1))
        if pos < 0:
            self.searched = len(self.pending)  # a long call is not searched again and again
            return False
        self.searched = 0
        body, self.pending = self.pending[:pos], self.pending[pos + len(end):]
        self.in_call = False
        parsed = self._parse_body(body)
        if parsed is None:
            content.append(self.opening + body + end)
        else:
            calls.extend(parsed)
            self.num_calls += len(parsed)
            self.pending = self.pending.lstrip()
        return True

    def _parse_body(self, body: str) -> list[ToolCall] | None:
        """The calls in one body, or None if it is not a valid one."""
        if self.parser == "hermes":
            call = _call(_loads(body))
            return None if call is None else [call]
        if self.parser == "mistral":
            return json_calls(body)
        return _calls(_json_sequence(body))


class JsonListItems:
    """The items of a JSON list, each as soon as it is complete, from the list's text as it
    grows (tool_choice "required": its grammar keeps the output a list of call objects).
    `rest()` is the text after the last complete item while the list is not closed."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = self.closed = False
        self._open: list[str] | None = None  # the text of the item being written
        self._since: list[str] = []  # the text after the last complete item

    def feed(self, text: str) -> list[str]:
        items, start, cut = [], 0, 0
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self._open, start = [], i
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and self._open is not None:
                    items.append("".join(self._open) + text[start : i + 1])
                    self._open, self._since, cut = None, [], i + 1
                elif self.depth == 0:
                    self.closed = True
        if self._open is not None:
            self._open.append(text[start:])
        self._since.append(text[cut:])
        return items

    def rest(self) -> str:
        return "" if self.closed else "".join(self._since)


def json_calls(text: str) -> list[ToolCall] | None:
    """The calls in a JSON list of `{"name", "arguments" | "parameters"}` objects (or in one
    such object), or None if the text is not that."""
    items = _loads(text)
    return _calls([items] if isinstance(items, dict) else items)


def json_call(text: str) -> ToolCall | None:
    """The call in one `{"name", "arguments" | "parameters"}` object, or None."""
    return _call(_loads(text))


def _calls(items: Any) -> list[ToolCall] | None:
    if not isinstance(items, list) or not items:
        return None
    calls = [_call(item) for item in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def parse(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """The content and tool calls of a complete output."""
    stream = ToolCallStream(parser)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return content + rest, calls + more


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


_SEPARATOR = re.compile(r"\s*(?:;\s*)?")  # between llama3's calls


def _json_sequence(text: str) -> list[Any] | None:
    """JSON values separated by ";" (and whitespace), or None if that is not what it is."""
    decoder, items, pos = json.JSONDecoder(), [], 0
    text = text.strip()
    while pos < len(text):
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        items.append(value)
        pos = _SEPARATOR.match(text, pos).end()  # type: ignore[union-attr]
    return items


def _call(obj: Any) -> ToolCall | None:
    """A call from `{"name": str, "arguments" | "parameters": object}`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON text
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
