"""Tool call objects read as their text streams: a call is sent as soon as its name is known,
then its arguments piece by piece (as OpenAI, SGLang and vLLM stream them).

`CallObjects` reads one region of output that holds calls (what follows a parser's opening
marker, or the whole output of `tool_choice: "required"`): call objects alone, in a JSON list,
or separated by `,` / `;`. An object is a call once its text begins with its *header*,
`{"name": "<name>", "arguments": {` (or `"parameters"`). From then on it stays a call: its
arguments stream as they come, with the whitespace between JSON tokens normalised the way
`json.dumps` writes it (`", "` and `": "`, strings verbatim), and if the output is cut off inside
them the call keeps what came (OpenAI's behaviour with finish_reason `length`). An object that
does not begin with a header (keys in another order, arguments written as a JSON text) is parsed
whole when it closes. The region's calls end at the first text that is neither a call nor a
separator (`junk_at`); what follows is content. Whether an object is a call depends only on its
text, never on how the text was split, so a stream's calls always equal the whole response's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

HEADER = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{'
)
_STRING_RUN = re.compile(r'[^"\\]+')
_TOKEN = re.compile(r'\s+|[^\s"\[\]{},:]+|.', re.DOTALL)  # outside strings
_SEPARATORS = frozenset("[],;")


@dataclass(frozen=True)
class CallDelta:
    """A piece of one call: its name on the call's first piece, then pieces of arguments."""

    index: int  # the call's number in the output
    name: str | None
    arguments: str


class JsonScanner:
    """Where a JSON text's strings and nesting are, character by character."""

    __slots__ = ("depth", "escaped", "in_string")

    def __init__(self, depth: int = 0) -> None:
        self.depth, self.in_string, self.escaped = depth, False, False

    def step(self, ch: str) -> None:
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
        elif ch in "]}":
            self.depth -= 1


class CallObjects:
    """The calls in one region of output, from its text as it grows (see module doc)."""

    def __init__(self, first_index: int = 0) -> None:
        self.text = ""  # the region so far
        self.pos = 0  # how far it is read
        self.next_index = first_index
        self.calls = 0  # calls made in this region
        self.junk_at: int | None = None  # where the text stops being calls
        self._state = self._between
        self._scan = JsonScanner()
        self._start = 0  # where the object being read begins

    def feed(self, text: str) -> list[CallDelta]:
        self.text += text
        out: list[CallDelta] = []
        while self.pos < len(self.text) and self.junk_at is None:
            self._state(out)
        return out

    def finish(self) -> None:
        """The region has ended: an object whose header never came is not a call."""
        if self.junk_at is None and self._state == self._head:
            self.junk_at = self._start

    def rest(self) -> str:
        """The region's text from where it stops being calls ("" if it is all calls)."""
        return "" if self.junk_at is None else self.text[self.junk_at :]

    # -- states: each reads on from `pos` -----------------------------------------------------
    def _between(self, out: list[CallDelta]) -> None:
        text, i = self.text, self.pos
        while i < len(text) and (text[i] in _SEPARATORS or text[i].isspace()):
            i += 1
        self.pos = i
        if i == len(text):
            return
        if text[i] == "{":
            self._start, self._scan, self._state = i, JsonScanner(1), self._head
            self.pos = i + 1  # (its opening brace read)
        else:
            self.junk_at = i

    def _head(self, out: list[CallDelta]) -> None:
        """An object before its header is complete: a call at its header, else at its close."""
        text = self.text
        header = HEADER.match(text, self._start)  # it cannot reach past the object's close
        name = _loads(header.group(1)) if header else None
        if isinstance(name, str) and name:
            assert header is not None
            self._emit(out, self._open(), name, "{")
            self.pos, self._scan, self._state = header.end(), JsonScanner(1), self._arguments
            return
        if self._read_to_close():
            call = json_call(text[self._start : self.pos])
            if call is None:
                self.junk_at = self._start
            else:
                self._emit(out, self._open(), call.name, call.arguments)
                self._state = self._between

    def _arguments(self, out: list[CallDelta]) -> None:
        """A call's arguments, normalised as they come (a token at a time outside strings)."""
        text, scan, i = self.text, self._scan, self.pos
        piece: list[str] = []
        while i < len(text):
            if scan.in_string:
                if scan.escaped:
                    token, scan.escaped = text[i], False
                elif (run := _STRING_RUN.match(text, i)) is not None:
                    token = run.group()
                else:
                    token = text[i]
                    # a backslash escapes the next character; a quote ends the string
                    scan.escaped = scan.in_string = token == "\\"
                piece.append(token)
                i += len(token)
                continue
            token = _TOKEN.match(text, i).group()  # type: ignore[union-attr]
            i += len(token)
            ch = token[0]
            if ch in ",:":
                piece.append(token + " ")
            elif not ch.isspace():
                piece.append(token)
                scan.step(ch)  # a quote, a bracket, or a literal's first character
                if scan.depth == 0:
                    self._scan, self._state = JsonScanner(1), self._rest_of_call
                    break
        self.pos = i
        if piece:
            self._emit(out, self.next_index - 1, None, "".join(piece))

    def _rest_of_call(self, out: list[CallDelta]) -> None:
        """After the arguments, to the call object's close (other keys are not read)."""
        if self._read_to_close():
            self._state = self._between

    def _read_to_close(self) -> bool:
        """Read on to the close of what `_scan` is in; whether it closed."""
        text, scan, i = self.text, self._scan, self.pos
        while i < len(text) and scan.depth:
            scan.step(text[i])
            i += 1
        self.pos = i
        return scan.depth == 0

    def _open(self) -> int:
        self.calls += 1
        self.next_index += 1
        return self.next_index - 1

    @staticmethod
    def _emit(out: list[CallDelta], index: int, name: str | None, arguments: str) -> None:
        if out and out[-1].index == index:  # one delta per call per feed
            last = out.pop()
            name, arguments = last.name, last.arguments + arguments
        out.append(CallDelta(index, name, arguments))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


def json_call(text: str) -> ToolCall | None:
    """The call in one whole `{"name", "arguments" | "parameters"}` object, or None."""
    obj = _loads(text)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON text
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
