"""One request's output as the router assembles it from detokenizer rows.

Rows of one request may arrive out of order (consecutive steps handled by different
detokenizers) or twice (redelivery after a detokenizer died). `OutputAssembler` releases
them in token order, ignoring ranges it has seen, and trims stop strings: text is released
only up to the first stop string, and while the request runs, any tail of the text that
could still grow into a stop string is held back.

Invariant: released text is never taken back, and a stop string completed by later rows
always starts after the released text: if it began earlier, its start would have been a
tail that could still become a stop string, which is held back.

`Choice` accumulates one sub-request's deltas for its response; `usage` sums OpenAI's usage.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shared.messages import DetokRow, FinishReason, PromptLogprobs

if TYPE_CHECKING:
    from services.router_tools import ChatSplit


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Delta:
    """What became releasable after some rows: new text, new tokens, and the end if reached.

    `top_logprobs[i]` lists (token id, logprob) pairs for output token i of this delta.
    """

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # in the request's first delta
    prompt_tokens: int | None = None  # the prompt's length, once a row has said it
    prompt_ids: list[int] | None = None  # in the request's first delta, when asked for
    embedding: bytes | None = None  # an embedding request's, in its last delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopMatcher:
    """Finds stop strings in text that grows at its end."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.max_len = max(map(len, self.stops), default=0)

    def find(self, text: str, new_from: int) -> tuple[int, str] | None:
        """(start, stop) of the stop string that ends first among those ending after
        `new_from` (text up to there was searched before); the longer one on a tie.

        "Ends first" is where generation would have stopped had the text come one character
        at a time, so the answer does not depend on how the text was split into rows.
        """
        if not self.stops:
            return None
        lo = max(0, new_from - self.max_len + 1)
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            pos = text.find(stop, lo)
            if pos >= 0 and (best is None or (pos + len(stop), pos) < best[:2]):
                best = (pos + len(stop), pos, stop)
        return None if best is None else (best[1], best[2])

    def hold_back(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        return max((prefix_tail(text, stop) for stop in self.stops), default=0)


def prefix_tail(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (text to hold
    back while it may still grow into `tag`)."""
    start = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while start >= 0:  # the earliest start whose tail begins the tag is the longest
        if tag.startswith(text[start:]):
            return len(text) - start
        start = text.find(tag[0], start + 1)
    return 0


class OutputAssembler:
    """Reorders one request's `DetokRow`s and turns them into `Delta`s (see module doc).

    Only the text not released yet is kept (`pending_text`: a held-back tail plus what the
    last rows added): every stop string found later starts inside it (see the module's
    invariant), so work per row does not grow with the length of the output.
    """

    def __init__(self, stops: list[str] | None = None, keep_stop: bool = False) -> None:
        self.matcher = StopMatcher(stops or [])
        self.keep_stop = keep_stop  # the text ends with the stop string (no_stop_trim)
        self.pending_text = ""
        self.num_released = 0  # characters released so far
        self.finish_reason: FinishReason | None = None
        self.usage: Usage | None = None
        self.stopped_here = False  # the router found a stop string the worker did not report
        self.num_rows_seen = 0
        self._next = 0  # first output token index not yet consumed
        self._pending: dict[int, DetokRow] = {}
        self._last: DetokRow | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, rows: Iterable[DetokRow]) -> Delta | None:
        """Take rows as they arrived; return what they made releasable, or None if nothing."""
        if self.finished:
            return None
        delta = Delta()
        new_from = len(self.pending_text)
        for row in rows:
            self.num_rows_seen += 1
            if self.finished or row.start < self._next:
                continue  # after the end, or a range already consumed (redelivery)
            if row.start > self._next:
                self._stash(row)
                continue
            self._consume(row, delta)
            while not self.finished and self._next in self._pending:
                self._consume(self._pending.pop(self._next), delta)
        self._trim_stop(new_from)
        return self._release(delta)

    def _stash(self, row: DetokRow) -> None:
        old = self._pending.get(row.start)
        if old is None or (row.end, row.finished) > (old.end, old.finished):
            self._pending[row.start] = row

    def _consume(self, row: DetokRow, delta: Delta) -> None:
        self._next = row.end
        self._last = row
        self.pending_text += row.text
        delta.output_ids += row.output_ids
        delta.prompt_tokens = row.prompt_tokens
        if row.token_logprobs is not None:
            delta.token_logprobs = (delta.token_logprobs or []) + row.token_logprobs
        if row.top_logprobs_ids is not None and row.top_logprobs_vals is not None:
            pairs = [
                list(zip(ids, vals, strict=True))
                for ids, vals in zip(row.top_logprobs_ids, row.top_logprobs_vals, strict=True)
            ]
            delta.top_logprobs = (delta.top_logprobs or []) + pairs
        if row.prompt_logprobs is not None:
            delta.prompt_logprobs = row.prompt_logprobs
        if row.prompt_ids is not None:
            delta.prompt_ids = row.prompt_ids
        if row.embedding is not None:
            delta.embedding = row.embedding
        if row.finished:
            self._finish(row.finish_reason, row)

    def _finish(self, reason: FinishReason | None, row: DetokRow) -> None:
        self.finish_reason = reason
        self.usage = Usage(row.prompt_tokens, row.completion_tokens, row.cached_tokens)
        self._pending.clear()

    def _trim_stop(self, new_from: int) -> None:
        """Cut the text at the first stop string; end the request there if the worker didn't."""
        text = self.pending_text
        hit = self.matcher.find(text, new_from)
        matched = self.finish_reason.matched if self.finish_reason is not None else None
        if hit is None and isinstance(matched, str) and matched in text:
            hit = (text.find(matched), matched)  # a stop the worker matched that we did not
        if hit is None:
            return
        pos, stop = hit
        self.pending_text = text[: pos + len(stop) * self.keep_stop]
        if not self.finished:
            self.stopped_here = True
            assert self._last is not None
            self._finish(None, self._last)
        self.finish_reason = FinishReason("stop", stop)

    def _release(self, delta: Delta) -> Delta | None:
        keep = 0 if self.finished else self.matcher.hold_back(self.pending_text)
        if len(self.pending_text) > keep:
            cut = len(self.pending_text) - keep
            delta.text, self.pending_text = self.pending_text[:cut], self.pending_text[cut:]
            self.num_released += cut
        if self.finished:
            delta.finish_reason, delta.usage = self.finish_reason, self.usage
        if not delta.text and not delta.output_ids and not delta.finished:
            return None
        return delta


@dataclass
class Choice:
    """One sub-request's output, accumulated (text as pieces: joined only when needed)."""

    index: int
    rid: str = ""
    pieces: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: Any = None
    usage: Usage | None = None
    prompt: PromptLogprobs | None = None
    split: ChatSplit | None = None  # chat with tools or reasoning: what its text is
    prompt_tokens: int = 0
    prompt_ids: list[int] | None = None
    arrived: float | None = None  # the request's arrival (time.perf_counter), if known
    e2e_latency: float | None = None  # seconds from arrival to the end (SGLang's meta_info)

    def add(self, delta: Delta) -> None:
        self.pieces.append(delta.text)
        self.output_ids += delta.output_ids
        self.token_logprobs += delta.token_logprobs or []
        self.top_logprobs += delta.top_logprobs or []
        if delta.prompt_logprobs is not None:
            self.prompt = delta.prompt_logprobs
        if delta.prompt_tokens is not None:
            self.prompt_tokens = delta.prompt_tokens
        if delta.prompt_ids is not None:
            self.prompt_ids = delta.prompt_ids
        if delta.finished:
            self.finish_reason, self.usage = delta.finish_reason, delta.usage
            if self.arrived is not None:
                self.e2e_latency = time.perf_counter() - self.arrived

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def finish_type(self) -> str | None:
        if self.finish_reason is None:
            return None
        if self.finish_reason.type == "stop" and self.split is not None and self.split.called:
            return "tool_calls"
        return self.finish_reason.type

    @property
    def matched(self) -> int | str | None:
        return None if self.finish_reason is None else self.finish_reason.matched


def usage(choices: list[Choice], prompt_of: dict[int, int]) -> dict[str, Any]:
    """OpenAI usage: each prompt counted once (n samples share it), completions summed."""
    firsts: dict[int, Usage] = {}
    for c in choices:
        if c.usage is not None:
            firsts.setdefault(prompt_of[c.index], c.usage)
    prompt = sum(u.prompt_tokens for u in firsts.values())
    cached = sum(u.cached_tokens for u in firsts.values())
    completion = sum(c.usage.completion_tokens for c in choices if c.usage is not None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
