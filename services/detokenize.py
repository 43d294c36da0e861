"""Stateless incremental detokenization: the text a step's new tokens add to a request.

A detokenizer keeps no per-request state. Each row of a step message carries the new
tokens (output positions [start, start + n)) and a window of up to `DETOK_WINDOW_LEN`
output tokens just before them. The delta is

    stable(prefix + window + new) minus stable(prefix + window)

where `stable` decodes and then holds back what later tokens could still change, so that
the deltas of all steps, concatenated in token order, equal
`tokenizer.decode(output_ids, clean_up_tokenization_spaces=False)`.

The details, checked on byte-level BPE (gpt2, qwen) and SentencePiece-style byte fallback
(llama, mistral) tokenizers:

* `prefix` is one fixed ordinary token (the one for "a"). SentencePiece decoders strip
  the leading space of the whole text; with the prefix in front that rule hits the prefix,
  never the window. When the window begins at the first output token (`len(window) ==
  start`) there is no earlier text and the prefix is left out, so the first token's
  leading space is stripped exactly as `decode(output_ids)` strips it.
* An incomplete UTF-8 character at the end decodes to U+FFFD; it is held back until the
  character completes (or the request finishes). Byte-level BPE decodes an incomplete
  character to exactly one U+FFFD, so one trailing U+FFFD is dropped from the text.
  The byte-fallback decoder differs (DESIGN.md's "exactly one" is true of byte-level
  only): it turns *every* byte of a run of `<0xNN>` tokens into U+FFFD when the run is not
  valid UTF-8, so "你" spread over three byte tokens reads "\ufffd\ufffd" after two. For
  those tokenizers the byte tokens of an incomplete trailing character (at most three)
  are removed before decoding instead, using their byte values.
* For the same reason, byte-fallback continuation-byte tokens at the start of the window
  (the tail of a character that began before the window, already sent) are dropped:
  left in, they would turn the whole run into U+FFFD in this view only.

Invalid UTF-8 (common from random test models): byte-level BPE output differs from
`decode` only in the number of U+FFFD. Byte-fallback output can differ inside an invalid
run of byte tokens, because `decode` turns the run's valid characters into U+FFFD as
well, and a run longer than the window cannot be seen whole by a stateless detokenizer;
the text outside invalid runs is exact.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from shared.messages import DetokOutputMsg, DetokRow, StepOutputMsg, StepRow

REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_MAX_INCOMPLETE_BYTES = 3  # an incomplete UTF-8 character has at most 3 of its 4 bytes


def byte_fallback_table(tokenizer: Any) -> dict[int, int]:
    """Token id → byte value for the `<0xNN>` tokens of a byte-fallback vocabulary.

    Empty for other tokenizers (a byte-level BPE vocabulary has no such tokens).
    """
    table = {}
    for token, token_id in tokenizer.get_vocab().items():
        match = _BYTE_TOKEN.fullmatch(token)
        if match:
            table[token_id] = int(match.group(1), 16)
    return table if len(table) == 256 else {}


def _utf8_len(lead: int) -> int:
    """Bytes of the character a lead byte starts; 0 for a continuation or invalid byte."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def _is_continuation(byte: int | None) -> bool:
    return byte is not None and byte & 0xC0 == 0x80


class StepDetokenizer:
    """Computes text deltas for step rows with one tokenizer; holds no request state."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_values = byte_fallback_table(tokenizer)
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.prefix_ids = [self._ordinary_token()]
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

    def _ordinary_token(self) -> int:
        ids = self.tokenizer.encode("a", add_special_tokens=False)
        if not ids or self.tokenizer.decode(ids[-1:]) == "":
            raise ValueError("the tokenizer has no ordinary token for 'a' to anchor decoding")
        return ids[-1]

    def delta(
        self,
        new_ids: list[int],
        window_ids: list[int],
        start: int,
        finished: bool,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """The text that output tokens [start, start + len(new_ids)) add.

        `window_ids` are the output tokens just before `start`; `finished` releases what
        is held back (the request has no further tokens).
        """
        flags = (skip_special_tokens, spaces_between_special_tokens)
        if len(window_ids) >= start:  # the window starts at the first output token
            prefix, window = [], list(window_ids)
        else:
            prefix, window = self.prefix_ids, self._drop_leading_continuations(window_ids)
        base = self._stable_text(prefix + window, True, flags)
        full = self._stable_text(prefix + window + list(new_ids), not finished, flags)
        # `full` extends `base` except inside invalid byte-fallback runs (see the module
        # docstring); `len(base)` characters were sent either way.
        return full[len(base) :]

    def _stable_text(self, ids: list[int], hold: bool, flags: tuple[bool, bool]) -> str:
        if hold and self.byte_values:
            ids = ids[: len(ids) - self._incomplete_tail_len(ids, flags[0])]
        text = self._decode(ids, flags)
        if hold and text.endswith(REPLACEMENT_CHAR):
            text = text[:-1]
        return text

    def _decode(self, ids: list[int], flags: tuple[bool, bool]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            # What a fast tokenizer's decode() runs, minus its Python layers (a third of
            # the time); spaces_between_special_tokens only matters to slow tokenizers.
            return self._backend.decode(ids, skip_special_tokens=flags[0])
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=flags[0],
            spaces_between_special_tokens=flags[1],
            clean_up_tokenization_spaces=False,
        )

    def _incomplete_tail_len(self, ids: list[int], skip_special: bool) -> int:
        """How many trailing tokens are byte tokens of an incomplete UTF-8 character."""
        tail: list[int] = []  # positions of the trailing byte tokens, last first
        for pos in range(len(ids) - 1, -1, -1):
            token = ids[pos]
            if skip_special and token in self.special_ids:
                continue  # removed before decoding: the byte run goes on across it
            if token not in self.byte_values:
                break
            tail.append(pos)
            if len(tail) == _MAX_INCOMPLETE_BYTES:
                break
        for have, pos in enumerate(tail, start=1):
            byte = self.byte_values[ids[pos]]
            if not _is_continuation(byte):
                return len(ids) - pos if _utf8_len(byte) > have else 0
        return 0  # no lead byte: stray continuation bytes, invalid whatever follows

    def _drop_leading_continuations(self, window_ids: list[int]) -> list[int]:
        skip = 0
        while skip < len(window_ids) and _is_continuation(self.byte_values.get(window_ids[skip])):
            skip += 1
        return list(window_ids[skip:])

    # -- messages ---------------------------------------------------------------------------
    def row_text(self, row: StepRow) -> str:
        return self.delta(
            row.new_ids,
            row.window_ids,
            row.start,
            row.finished,
            row.skip_special_tokens,
            row.spaces_between_special_tokens,
        )

    def detokenize_step(self, msg: StepOutputMsg) -> list[DetokOutputMsg]:
        """One `DetokOutputMsg` per router with rows in `msg`, rows in message order."""
        by_router: dict[str, list[DetokRow]] = defaultdict(list)
        for row in msg.rows():
            by_router[row.router_id].append(
                DetokRow(
                    rid=row.rid,
                    start=row.start,
                    end=row.start + len(row.new_ids),
                    text=self.row_text(row),
                    output_ids=row.new_ids,
                    finish_reason=row.finish_reason,
                    prompt_tokens=row.prompt_tokens,
                    completion_tokens=row.completion_tokens,
                    cached_tokens=row.cached_tokens,
                    token_logprobs=row.token_logprobs,
                    top_logprobs_ids=row.top_logprobs_ids,
                    top_logprobs_vals=row.top_logprobs_vals,
                    prompt_logprobs=row.prompt_logprobs,
                    prompt_ids=row.prompt_ids,
                    embedding=row.embedding,
                )
            )
        return [
            DetokOutputMsg.from_rows(rows, router_id=router, worker_id=msg.worker_id, step=msg.step)
            for router, rows in by_router.items()
        ]
