"""The worker's table of requests, and the translation between messages and the engine.

`RequestTable` remembers, per running request, the router to answer, the detokenizer
flags (copied into every step row, since detokenizers keep no state) and the prompt
length: its `ReqInfo`, which the I/O process also keeps. It also remembers
recently ended request ids — finished, failed, or aborted before they arrived (an abort
goes straight from the router to the worker and can overtake its request, which takes
the longer way through a tokenizer) — so that a request redelivered by a tokenizer
taking over a dead one's entries is not run twice, and an overtaken request is dropped.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from engine.pooling import embedding_bytes
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.output_processor import StepEvent
from shared.messages import (
    DETOK_WINDOW_LEN,
    FinishReason,
    GenerateReqMsg,
    PromptLogprobs,
    StepOutputMsg,
    StepRow,
)

logger = logging.getLogger(__name__)

Admission = Literal["new", "duplicate", "aborted"]


class ReqInfo(NamedTuple):
    """What every step row of a request repeats (sent once to the I/O process)."""

    router_id: str
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    prompt_tokens: int
    prompt_ids: list[int] | None = None  # when the client wants them back

    @classmethod
    def of(cls, msg: GenerateReqMsg) -> ReqInfo:
        return cls(
            msg.router_id,
            msg.skip_special_tokens,
            msg.spaces_between_special_tokens,
            len(msg.input_ids),
            list(msg.input_ids) if msg.return_prompt_ids else None,
        )


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

    def by_router(self) -> dict[str, int]:
        """The active requests, counted by the router that sent them."""
        return dict(Counter(info.router_id for info in self.active.values()))

    def start(self, msg: GenerateReqMsg) -> ReqInfo:
        info = self.active[msg.rid] = ReqInfo.of(msg)
        return info

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


def check_kind(msg: GenerateReqMsg, is_embedding: bool) -> None:
    """ValueError unless the request is of the kind the worker serves (embedding or not)."""
    if msg.embed and not is_embedding:
        raise ValueError("this worker serves a generative model, not embeddings")
    if is_embedding and not msg.embed:
        raise ValueError("this worker serves an embedding model: use /v1/embeddings")


def sampling_params(msg: GenerateReqMsg, vocab_size: int) -> SamplingParams:
    """The engine's params for a request; ValueError if they are invalid."""
    d: dict[str, Any] = dict(msg.sampling_params)
    d.update(
        stop=list(msg.stop) or None,
        skip_special_tokens=msg.skip_special_tokens,
        spaces_between_special_tokens=msg.spaces_between_special_tokens,
        return_logprob=msg.return_logprob,
        top_logprobs_num=msg.top_logprobs_num,
        logprob_start_len=msg.logprob_start_len,
        return_prompt_ranks=msg.return_prompt_ranks,
    )
    params = SamplingParams.from_dict(d)
    params.verify(vocab_size)
    if params.n != 1:
        raise ValueError("n must be 1 per request (the router fans out n > 1)")
    if min(msg.input_ids) < 0 or max(msg.input_ids) >= vocab_size:
        raise ValueError(f"input_ids: token ids must be in [0, {vocab_size})")
    return params.normalize()


def _finish_fields(reason: Any) -> tuple[str, Any, str | None]:
    """The engine's finish reason as `FinishReason`'s fields (`matched` only for "stop")."""
    matched = reason.matched if reason.type == "stop" else None
    return (reason.type, matched, reason.message)


# A row record: what the I/O process needs of one step event besides the request's
# `ReqInfo`: (rid, start, new_ids, window_ids, finish, cached_tokens, logprobs, prompt,
# embedding), with finish None or (type, matched, message), logprobs None or
# (token_logprobs, top_ids, top_vals), prompt None or `PromptLogprobs`' fields (the request's
# first row only) and embedding None or an embedding request's float32 bytes (its last row).
RowRecord = tuple[Any, ...]


def row_record(event: StepEvent) -> RowRecord:
    """One event's row record, taken at the event on the scheduler thread (later steps
    append tokens and a re-admission changes the cached-token count)."""
    req = event.req
    start, new_ids = event.start, list(event.new_token_ids)
    reason = event.finished_reason
    logprobs = None
    params = req.sampling_params
    end = start + len(new_ids)
    if params.return_logprob and len(req.logprobs) >= end:
        tops = params.top_logprobs_num > 0 and len(req.top_logprobs) >= end
        top = req.top_logprobs[start:end] if tops else None
        logprobs = (
            list(req.logprobs[start:end]),
            [list(ids) for ids, _ in top] if top else None,
            [list(vals) for _, vals in top] if top else None,
        )
    prompt = None
    if start == 0 and req.prompt_logprob_start is not None:
        prompt = _prompt_fields(req)
    return (
        req.rid,
        start,
        new_ids,
        req.output_ids[max(0, start - DETOK_WINDOW_LEN) : start],
        None if reason is None else _finish_fields(reason),
        req.cached_tokens,
        logprobs,
        prompt,
        _embedding(req, reason),
    )


def _embedding(req: Any, reason: Any) -> bytes | None:
    """An embedding request's embedding, with its final row (none if it was aborted)."""
    if reason is None or req.embedding is None or reason.type == "abort":
        return None
    return embedding_bytes(req.embedding.embedding())


def _prompt_fields(req: Any) -> tuple | None:
    """`PromptLogprobs`' fields for `req`; None until all of them are computed (an abort)."""
    start = req.prompt_logprob_start
    ids = req.origin_input_ids[start:]
    lps = req.prompt_token_logprobs
    if len(lps) != len(ids) - (start == 0):
        return None
    top = req.prompt_top_logprobs if req.sampling_params.top_logprobs_num > 0 else None
    if top is not None and len(top) != len(lps):
        return None
    top_ids = None if top is None else [list(i) for i, _ in top]
    top_vals = None if top is None else [list(v) for _, v in top]
    ranks = None
    if req.sampling_params.return_prompt_ranks:
        if len(req.prompt_token_ranks) != len(lps):
            return None
        ranks = list(req.prompt_token_ranks)
    return (start, list(ids), list(lps), top_ids, top_vals, ranks)


# The plain rows of a step, as columns [rids, starts, tokens, cached_tokens]: one new token
# each, the request goes on, no logprobs (most rows of most steps). Their windows are the I/O
# process's (`step_message`): packing a window per row was most of a record's cost.
PlainRows = list[list[Any]]


def step_records(
    events: list[StepEvent], active: Mapping[str, Any]
) -> tuple[list[RowRecord], PlainRows, list[str]]:
    """A step's events of the requests in `active`, for the I/O process (on the scheduler
    thread, every step): the row records of the rows that are not plain, the plain rows,
    and the ids of the requests that ended."""
    rows: list[RowRecord] = []
    ended: list[str] = []
    rids: list[str] = []
    starts: list[int] = []
    tokens: list[int] = []
    cached: list[int] = []
    for event in events:
        req = event.req
        rid = req.rid
        if rid not in active:  # not ours (cannot happen: all come through the worker)
            continue
        new = event.new_token_ids
        if event.finished_reason is None:
            if len(new) == 1 and not req.sampling_params.return_logprob:
                rids.append(rid)
                starts.append(event.start)
                tokens.append(new[0])
                cached.append(req.cached_tokens)
                continue
        else:
            ended.append(rid)
        rows.append(row_record(event))
    return rows, [rids, starts, tokens, cached], ended


def expand_row(record: RowRecord, info: ReqInfo) -> StepRow:
    """The step row of a row record (in the I/O process, from msgpack's lists)."""
    rid, start, new_ids, window_ids, finish, cached_tokens, logprobs, prompt, emb = record
    lps, top_ids, top_vals = logprobs or (None, None, None)
    return StepRow(
        rid=rid,
        router_id=info.router_id,
        start=start,
        new_ids=new_ids,
        window_ids=window_ids,
        finish_reason=None if finish is None else FinishReason(*finish),
        prompt_tokens=info.prompt_tokens,
        completion_tokens=start + len(new_ids),
        cached_tokens=cached_tokens,
        skip_special_tokens=info.skip_special_tokens,
        spaces_between_special_tokens=info.spaces_between_special_tokens,
        token_logprobs=lps,
        top_logprobs_ids=top_ids,
        top_logprobs_vals=top_vals,
        prompt_logprobs=None if prompt is None else PromptLogprobs(*prompt),
        prompt_ids=info.prompt_ids if start == 0 else None,
        embedding=emb,
    )


class Windows:
    """The I/O process's copy of each running request's last DETOK_WINDOW_LEN output tokens
    (the window of its next row), kept from the rows that pass: every output token of a
    request is in exactly one of its rows, in order. Rows that carry their window (row
    records) reset it; plain rows read and extend it."""

    def __init__(self) -> None:
        self._tails: dict[str, tuple[int, list[int]]] = {}  # rid -> (next start, window)

    def __len__(self) -> int:
        return len(self._tails)

    def after(self, rid: str, start: int, window: list[int], new_ids: list[int]) -> None:
        self._tails[rid] = (start + len(new_ids), (window + new_ids)[-DETOK_WINDOW_LEN:])

    def plain(self, rid: str, start: int, token: int) -> list[int]:
        """The window of a plain row (and the row's token appended to it)."""
        end, window = self._tails.get(rid, (0, []))
        if end != start:  # (a row lost on the way: cannot happen on a pipe)
            logger.error("%s: a row at output %d after output %d: its window is off", rid,
                         start, end)  # fmt: skip
        self._tails[rid] = (start + 1, (window + [token])[-DETOK_WINDOW_LEN:])
        return window

    def drop(self, rid: str) -> None:
        self._tails.pop(rid, None)


def step_message(
    records: list[RowRecord],
    infos: dict[str, ReqInfo],
    worker_id: str,
    step: int,
    plain: PlainRows | None = None,
    windows: Windows | None = None,
) -> StepOutputMsg | None:
    """The step message of one step's row records and plain rows (None if none is usable).
    A request's info (and window) is dropped with its final row; a row of a request that
    never started is logged and skipped."""
    windows = windows if windows is not None else Windows()
    columns = _plain_columns(plain, infos, windows) if plain and plain[0] else None
    rows = []
    for record in records:
        info = infos.get(record[0])
        if info is None:
            logger.error("a step row of %s, which never started: dropped", record[0])
            continue
        row = expand_row(record, info)
        rows.append(row)
        if row.finish_reason is not None:
            del infos[row.rid]
            windows.drop(row.rid)
        else:
            windows.after(row.rid, row.start, row.window_ids, row.new_ids)
    if columns is None:
        return StepOutputMsg.from_rows(rows, worker_id=worker_id, step=step) if rows else None
    for row in rows:  # after the plain rows
        for column, value in zip(columns, row, strict=True):
            column.append(value)
    return StepOutputMsg(worker_id=worker_id, step=step,
                         **dict(zip(StepOutputMsg.COLUMNS, columns, strict=True)))  # fmt: skip


def _plain_columns(
    plain: PlainRows, infos: dict[str, ReqInfo], windows: Windows
) -> list[list[Any]] | None:
    """The plain rows as `StepOutputMsg`'s columns (in `COLUMNS` order; built column by
    column: a `StepRow` each cost 2 us a row), None if none is usable."""
    rids, starts, tokens, cached = plain
    got = list(map(infos.get, rids))
    if None in got:
        for rid, info in zip(rids, got):
            if info is None:
                logger.error("a step row of %s, which never started: dropped", rid)
        keep = [i for i, info in enumerate(got) if info is not None]
        rids, starts, tokens, cached, got = ([c[i] for i in keep]
                                             for c in (rids, starts, tokens, cached, got))
        if not rids:
            return None
    n = len(rids)
    by_name = {
        "rids": rids,
        "router_ids": [info.router_id for info in got],
        "starts": starts,
        "new_ids": [[token] for token in tokens],
        "window_ids": list(map(windows.plain, rids, starts, tokens)),
        "prompt_tokens": [info.prompt_tokens for info in got],
        "completion_tokens": [start + 1 for start in starts],
        "cached_tokens": cached,
        "skip_special_tokens": [info.skip_special_tokens for info in got],
        "spaces_between_special_tokens": [info.spaces_between_special_tokens for info in got],
        "prompt_ids": [info.prompt_ids if start == 0 else None
                       for info, start in zip(got, starts)],
    }  # fmt: skip
    # the rest are None in a plain row (a list each: full rows are appended to them)
    return [by_name[name] if name in by_name else [None] * n for name in StepOutputMsg.COLUMNS]


def aborted_row(msg: GenerateReqMsg) -> StepRow:
    """The final row of a request whose abort arrived before it did."""
    reason = FinishReason("abort", message="aborted before it reached the worker")
    return StepRow(
        msg.rid, msg.router_id, 0, [], [], reason, len(msg.input_ids), 0, 0,
        msg.skip_special_tokens, msg.spaces_between_special_tokens,
    )  # fmt: skip
