"""Messages bound for the detokenizers (stream `{p}:detok`, group `detokenizers`)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NamedTuple

from shared.messages.base import Message
from shared.messages.common import Columnar, FinishReason, PromptLogprobs, check_optional_lengths
from shared.messages.schema import MessageError


class StepRow(NamedTuple):
    """One request's share of a scheduler step (a row of `StepOutputMsg`).

    Token positions count output tokens only (0 is the first generated token):
    `new_ids` are output positions [start, start + len(new_ids)), and `window_ids` are the
    output tokens just before them, positions [start - len(window_ids), start). The window
    never reaches into the prompt; when `len(window_ids) == start` it begins at the first
    output token, which tells a detokenizer that no earlier text exists. A final row may
    carry no new tokens (an abort). `completion_tokens` is the output length after this
    step; the logprob fields, when requested, have one entry per new token.
    `prompt_logprobs` and `prompt_ids`, when requested, come with the request's first row.
    An embedding request's final row carries its `embedding` (float32, little-endian).
    """

    rid: str
    router_id: str
    start: int
    new_ids: list[int]
    window_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    token_logprobs: list[float] | None = None
    top_logprobs_ids: list[list[int]] | None = None
    top_logprobs_vals: list[list[float]] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_ids: list[int] | None = None
    embedding: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class StepOutputMsg(Columnar, Message):
    """worker → detokenizers: every request that produced output (or ended) in one step.

    Columnar: field `rids[i]`, `starts[i]`, ... form row i (see `StepRow`, `rows()` and
    `from_rows(rows, worker_id=..., step=...)`). A request is finished exactly when its
    finish reason is set. `step` counts the worker's scheduler steps.
    """

    TAG = "step_output"
    VERSION = 5  # 3: prompt logprobs carry ranks; 4: prompt_ids; 5: embeddings
    ROW = StepRow
    COLUMNS = (
        "rids", "router_ids", "starts", "new_ids", "window_ids", "finish_reasons",
        "prompt_tokens", "completion_tokens", "cached_tokens", "skip_special_tokens",
        "spaces_between_special_tokens", "token_logprobs", "top_logprobs_ids",
        "top_logprobs_vals", "prompt_logprobs", "prompt_ids", "embeddings",
    )  # fmt: skip

    worker_id: str
    step: int
    rids: list[str]
    router_ids: list[str]
    starts: list[int]
    new_ids: list[list[int]]
    window_ids: list[list[int]]
    finish_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    token_logprobs: list[list[float] | None]
    top_logprobs_ids: list[list[list[int]] | None]
    top_logprobs_vals: list[list[list[float]] | None]
    prompt_logprobs: list[PromptLogprobs | None]
    prompt_ids: list[list[int] | None]
    embeddings: list[bytes | None]

    def _check(self) -> None:
        self._check_columns()
        window_lens = list(map(len, self.window_ids))
        if not all(map(operator.le, window_lens, self.starts)):  # C speed on the happy path
            pairs = zip(window_lens, self.starts, strict=True)
            i, (window_len, start) = next((i, p) for i, p in enumerate(pairs) if p[0] > p[1])
            raise MessageError(
                f"StepOutputMsg.rows[{i}]: start {start} with a window of {window_len} "
                "(the window holds output tokens before start only)"
            )
        lengths = [len(ids) for ids in self.new_ids]
        for name in ("token_logprobs", "top_logprobs_ids", "top_logprobs_vals"):
            check_optional_lengths("StepOutputMsg", name, getattr(self, name), lengths)
