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
whitespace before one) is held until the next text decides it. What follows an opening is read
by `CallObjects` (services/tool_call_objects.py): a call goes out at its header (its name), then
its arguments as they come. If an opening's text makes no call (bad JSON, no name, non-object
arguments, cut off before the arguments began), it is released as content, verbatim (with the
whitespace before it); text after a region's calls that is not a call is content too.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.router_stream import prefix_tail
from services.tool_call_objects import CallDelta, CallObjects, ToolCall

PARSERS = ("hermes", "llama3", "mistral")
ALIASES = {"qwen25": "hermes", "qwen": "hermes", "qwen3": "hermes", "llama3_json": "llama3"}
KEEPS_SPECIAL_TOKENS = {"mistral"}  # its marker is a special token


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
    """Content and tool call deltas of one output, from its text as it grows (module doc)."""

    def __init__(self, parser: str) -> None:
        self.fmt = _FORMATS[canonical(parser)]
        self.pending = ""  # content held back, or the end of an open region not yet read
        self.region: CallObjects | None = None  # the calls being read, once opened
        self.opening = ""  # the text that opened the region (whitespace before it too)
        self.decided = False  # at_start_only formats: whether the output begins with a call
        self.done = False  # the rest of the output is content (a region without an end failed)
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """Content and call deltas that `text` (the next piece of output) makes certain."""
        if self.region is None and not self.pending and self._plain(text):
            return text, []  # the common case, content far from any call: nothing to hold
        self.pending += text
        content: list[str] = []
        deltas: list[CallDelta] = []
        while True:
            if self.region is not None:
                if not self._read_region(content, deltas):
                    break
                continue
            released, opened = self._scan_content()
            content.append(released)
            if not opened:
                break
        return "".join(content), deltas

    def _plain(self, text: str) -> bool:
        if self.done or self.fmt.at_start_only:
            return self.done or self.decided
        return self.fmt.start[0] not in text and not text[-1:].isspace()

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What is left once the output is complete."""
        if self.region is not None:
            deltas = self.region.feed(self.pending)
            self.pending = ""
            return self._end_region(""), deltas
        rest, self.pending = self.pending, ""
        return ("" if self.num_calls and not rest.strip() else rest), []

    # -- content ------------------------------------------------------------------------------
    def _scan_content(self) -> tuple[str, bool]:
        """Release content up to an opening (entering the call) or up to what must be held."""
        text, fmt = self.pending, self.fmt
        if self.done:
            self.pending = ""
            return text, False
        if fmt.at_start_only:
            return self._scan_start(text)
        pos = text.find(fmt.start)
        if pos >= 0:
            before = text[:pos].rstrip()
            self.opening = text[len(before) : pos + len(fmt.start)]
            self._open(text[pos + len(fmt.start) :])
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
            self.decided = True
            body = stripped.removeprefix(fmt.start)
            self.opening = text[: len(text) - len(body)]
            self._open(body)
            return "", True
        if not stripped or fmt.start.startswith(stripped):
            return "", False  # not decided yet
        self.decided, self.pending = True, ""
        return text, False

    # -- calls --------------------------------------------------------------------------------
    def _open(self, rest: str) -> None:
        self.region, self.pending = CallObjects(self.num_calls), rest

    def _read_region(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """Read the open region on; True if it ended (its closing tag came, or its calls
        stopped and it has no closing tag), with what follows it left in `pending`."""
        region, end = self.region, self.fmt.end
        assert region is not None
        if end is None:
            deltas += region.feed(self.pending)
            self.pending = ""
            if region.junk_at is None:
                return False
            content.append(self._end_region(""))
            self.done = True  # the output's calls are over: the rest is content
            return True
        pos = self.pending.find(end)
        if pos < 0:  # read all but what may begin the closing tag
            cut = len(self.pending) - prefix_tail(self.pending, end)
            deltas += region.feed(self.pending[:cut])
            self.pending = self.pending[cut:]
            return False
        deltas += region.feed(self.pending[:pos])
        self.pending = self.pending[pos + len(end) :]
        content.append(self._end_region(end))
        if not content[-1]:
            self.pending = self.pending.lstrip()  # whitespace after calls is dropped
        return True

    def _end_region(self, end: str) -> str:
        """The content a region leaves: none if it was all calls; from where its calls stopped
        if it made some; all of it, verbatim with its opening and closing, if it made none."""
        region = self.region
        assert region is not None
        region.finish()
        self.region = None
        self.num_calls += region.calls
        if region.junk_at is None:
            return ""
        if region.calls:
            return region.rest()
        return self.opening + region.text + end


def parse(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """The content and tool calls of a complete output."""
    stream = ToolCallStream(parser)
    content, deltas = stream.feed(text)
    rest, more = stream.finish()
    return content + rest, calls_of(deltas + more)


def calls_of(deltas: list[CallDelta]) -> list[ToolCall]:
    """The calls that deltas make, their pieces joined."""
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for d in deltas:
        if d.name is not None:
            names[d.index] = d.name
        arguments.setdefault(d.index, []).append(d.arguments)
    return [ToolCall(names[i], "".join(arguments[i])) for i in sorted(names)]
