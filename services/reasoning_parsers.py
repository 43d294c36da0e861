"""Reasoning in generated text: `<think>...</think>` split off as `reasoning_content`.

The router's `--reasoning-parser` (SGLang's and vLLM's flag of that name) says how a model
writes its reasoning:

* `qwen3`: the output may open with `<think>`; then everything up to `</think>` is reasoning.
  An output that does not open with it is all content (Qwen3 with `enable_thinking` false,
  whose template writes an empty think block into the prompt).
* `deepseek-r1` (also `qwen3-thinking`): the chat template already opened the think block in
  the prompt, so the output starts in reasoning (a leading `<think>` is dropped too) and is all
  reasoning until `</think>`; cut off before it, it is all reasoning.

Whitespace around the block is trimmed: the reasoning's leading and trailing whitespace, and the
leading whitespace of the content after it (an output without a think block is left as is).
Streaming and whole parsing are one code path (`parse` feeds the whole text and finishes), so a
stream's pieces always join to the whole response's; released text is never taken back: a tail
that could still begin a tag, or whitespace that could still turn out to be trailing, is held
until the next text decides it.
"""

from __future__ import annotations

from services.router_stream import prefix_tail

REASONING_PARSERS = ("qwen3", "deepseek-r1", "qwen3-thinking")
_FORCED = {"deepseek-r1", "qwen3-thinking"}  # the prompt opened the think block
OPEN, CLOSE = "<think>", "</think>"


class ReasoningStream:
    """Reasoning and content of one output, from its text as it grows (see module doc)."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            known = ", ".join(REASONING_PARSERS)
            raise ValueError(f"unknown reasoning parser {parser!r} (known: {known})")
        self.forced = parser in _FORCED
        self.state = "start"  # start: before the output shows whether it reasons
        self.pending = ""
        self.lead = True  # the current part has released nothing yet (its whitespace is trimmed)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text`, the next piece of output, makes certain."""
        if self.state == "content" and not self.lead:
            return "", text  # the common case after the reasoning: content as it comes
        self.pending += text
        reasoning, content = "", ""
        if self.state == "start":
            self._start()
        if self.state == "reasoning":
            reasoning = self._scan_reasoning()
        if self.state == "content":
            content = self._take_content()
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        if self.state == "start":  # too short to decide: what it is, by the same rules
            self.state = "reasoning" if self.forced or rest.lstrip() == OPEN else "content"
            if self.state == "reasoning":
                rest = rest.lstrip().removeprefix(OPEN)
            else:
                self.lead = False  # no think block: the content as written
        if self.state == "reasoning":
            return _trimmed(rest, self.lead), ""
        return "", rest.lstrip() if self.lead else rest

    def _start(self) -> None:
        stripped = self.pending.lstrip()
        if stripped.startswith(OPEN):
            self.state, self.pending = "reasoning", stripped[len(OPEN) :]
        elif self.forced and (not OPEN.startswith(stripped) or len(stripped) >= len(OPEN)):
            self.state = "reasoning"
        elif not self.forced and stripped and not OPEN.startswith(stripped):
            self.state, self.lead = "content", False  # no think block: the content as written
        # else: empty, or a proper prefix of <think>: wait for more

    def _scan_reasoning(self) -> str:
        text = self.pending
        pos = text.find(CLOSE)
        if pos >= 0:
            self.state, self.pending = "content", text[pos + len(CLOSE) :]
            out = _trimmed(text[:pos], self.lead)
            self.lead = True
            return out
        head = text[: len(text) - prefix_tail(text, CLOSE)]
        cut = len(head.rstrip())  # trailing whitespace waits: it may end the reasoning
        released, self.pending = text[:cut], text[cut:]
        return self._lead_trim(released)

    def _take_content(self) -> str:
        text, self.pending = self.pending, ""
        return self._lead_trim(text)

    def _lead_trim(self, text: str) -> str:
        if self.lead:
            text = text.lstrip()
            if not text:
                return ""
            self.lead = False
        return text


def _trimmed(text: str, lead: bool) -> str:
    return (text.lstrip() if lead else text).rstrip()


def parse(parser: str, text: str) -> tuple[str, str]:
    """The reasoning and content of a complete output."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text)
    more, rest = stream.finish()
    return reasoning + more, content + rest
