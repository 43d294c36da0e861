"""The worker's table of requests, and the translation between messages and the engine.

`RequestTable` remembers, per running request, the router to answer and the detokenizer
flags (copied into every step row, since detokenizers keep no state). It also remembers
recently ended request ids — finished, failed, or aborted before they arrived (an abort
goes straight from the router to the worker and can overtake its request, which takes
the longer way through a tokenizer) — so that a request redelivered by a tokenizer
taking over a dead one's entries is not run twice, and an overtaken request is dropped.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.output_processor import StepEvent
from shared.messages import DETOK_WINDOW_LEN, FinishReason, GenerateReqMsg, StepOutputMsg, StepRow

Admission = Literal["new", "duplicate", "aborted"]


@dataclass(frozen=True, slots=True)
class ReqInfo:
    router_id: str
    skip_special_tokens: bool
    spaces_between_special_tokens: bool


class RequestTable:
    def __init__(self, max_remembered: int = 100_000, remember_s: float = 600.0) -> None:
        self.active: dict[str, ReqInfo] = {}
        self._ended: OrderedDict[str, float] = OrderedDict()  # rid → when
        self._aborted_early: set[str] = set()
        self.max_remembered = max_remembered
        self.remember_s = remember_s

    def admit(self, msg: GenerateReqMsg) -> Admission:
        """Classify an arriving request; a "new" one is not active until `start`."""
        if msg.rid in self.active:
            return "duplicate"
        if msg.rid in self._aborted_early:
            self._aborted_early.discard(msg.rid)  # a redelivered copy is a duplicate
            return "aborted"
        return "duplicate" if msg.rid in self._ended else "new"

    def start(self, msg: GenerateReqMsg) -> None:
        self.active[msg.rid] = ReqInfo(
            msg.router_id, msg.skip_special_tokens, msg.spaces_between_special_tokens
        )

    def abort(self, rid: str) -> bool:
        """True if `rid` runs here (abort it in the scheduler); else remember it."""
        if rid in self.active:
            return True
        if rid not in self._ended:
            self._aborted_early.add(rid)
            self._remember(rid)
        return False

    def end(self, rid: str) -> None:
        if self.active.pop(rid, None) is not None:
            self._remember(rid)

    def _remember(self, rid: str) -> None:
        now = time.monotonic()
        self._ended[rid] = now
        self._ended.move_to_end(rid)
        while self._ended:
            oldest, at = next(iter(self._ended.items()))
            if len(self._ended) <= self.max_remembered and now - at < self.remember_s:
                break
            del self._ended[oldest]
            self._aborted_early.discard(oldest)


def sampling_params(msg: GenerateReqMsg, vocab_size: int) -> SamplingParams:
    """The engine's params for a request; ValueError if they are invalid."""
    d: dict[str, Any] = dict(msg.sampling_params)
    d.update(
        stop=list(msg.stop) or None,
        skip_special_tokens=msg.skip_special_tokens,
        spaces_between_special_tokens=msg.spaces_between_special_tokens,
        return_logprob=msg.return_logprob,
        top_logprobs_num=msg.top_logprobs_num,
    )
    params = SamplingParams.from_dict(d)
    params.verify(vocab_size)
    if params.n != 1:
        raise ValueError("n must be 1 per request (the router fans out n > 1)")
    if min(msg.input_ids) < 0 or max(msg.input_ids) >= vocab_size:
        raise ValueError(f"input_ids: token ids must be in [0, {vocab_size})")
    return params.normalize()


def wire_finish(reason: Any) -> FinishReason | None:
    """The engine's finish reason as the message type (`matched` only for "stop")."""
    if reason is None:
        return None
    matched = reason.matched if reason.type == "stop" else None
    return FinishReason(reason.type, matched, reason.message)


def step_message(
    events: list[tuple[StepEvent, ReqInfo, int]], worker_id: str, step: int
) -> StepOutputMsg:
    """The step message of (event, request info, cached tokens at the event) triples. Safe
    off the scheduler's thread, one step late: a row reads its request's tokens and logprobs
    by absolute index (later steps only append), and the cached-token count, which a
    re-admission changes, is taken at the event."""
    rows = [step_row(ev, info, cached) for ev, info, cached in events]
    return StepOutputMsg.from_rows(rows, worker_id=worker_id, step=step)


def step_row(event: StepEvent, info: ReqInfo, cached_tokens: int | None = None) -> StepRow:
    """One request's row of a step message."""
    req = event.req
    start, new_ids = event.start, list(event.new_token_ids)
    end = start + len(new_ids)
    params = req.sampling_params
    logprobs = top_ids = top_vals = None
    if params.return_logprob and len(req.logprobs) >= end:
        logprobs = list(req.logprobs[start:end])
        if params.top_logprobs_num > 0 and len(req.top_logprobs) >= end:
            top = req.top_logprobs[start:end]
            top_ids = [list(ids) for ids, _ in top]
            top_vals = [list(vals) for _, vals in top]
    return StepRow(
        rid=req.rid,
        router_id=info.router_id,
        start=start,
        new_ids=new_ids,
        window_ids=req.output_ids[max(0, start - DETOK_WINDOW_LEN) : start],
        finish_reason=wire_finish(event.finished_reason),
        prompt_tokens=len(req.origin_input_ids),
        completion_tokens=end,
        cached_tokens=req.cached_tokens if cached_tokens is None else cached_tokens,
        skip_special_tokens=info.skip_special_tokens,
        spaces_between_special_tokens=info.spaces_between_special_tokens,
        token_logprobs=logprobs,
        top_logprobs_ids=top_ids,
        top_logprobs_vals=top_vals,
    )


def aborted_row(msg: GenerateReqMsg) -> StepRow:
    """The final row of a request whose abort arrived before it did."""
    reason = FinishReason("abort", message="aborted before it reached the worker")
    return StepRow(
        msg.rid, msg.router_id, 0, [], [], reason, len(msg.input_ids), 0, 0,
        msg.skip_special_tokens, msg.spaces_between_special_tokens,
    )  # fmt: skip
