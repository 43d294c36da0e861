"""Penalty counts, and the last output tokens, kept on the device across steps (the overlap
scheduler's penalties and bad words).

`BatchPenalties.build` counts each row's history on the host every step: its cost grows with
the output, and the overlap loop cannot use it before the token sampled the step before is
processed. SGLang keeps the counts on the device instead (its penalizer orchestrator adds
each step's sampled tokens there); so does the overlap scheduler, in three parts:

* `PenaltySlots` (host, the scheduler): gives each request with a penalty, or a bad word of
  several tokens, a row of the device's counts for its lifetime, and plans each batch's use
  of them (`PenaltyPlan`): which row each batch row reads, whether its sampled token is
  added, and which rows start over from the request's history (a new request; one
  re-prefilled after a retraction, whose tokens sampled in flight were dropped).
* `PenaltyRows`: that plan as tensors (the batch's `SamplingBatchInfo.history_rows`).
* `PenaltyCounts` (device, the `Sampler`): the counts, [R, V] float32, once a request with a
  penalty comes (and the prompt's tokens, [R, V] bool, once one with a repetition penalty
  comes); and the last L output tokens of each row, [R, L] int64 (-1 where there are fewer),
  L the longest bad-word prefix so far, which the bad words' bans match on the device
  (engine/sampling/logit_bans.py). Before sampling a batch it resets the planned rows
  (`prepare`); penalties gather the batch's counts; after sampling, it adds the sampled
  tokens of the counted rows (`add`).

Order makes it exact: sampling runs on the device in launch order, so batch N+1 reads the
counts after batch N's tokens were added, placeholders or not. A row freed by a finished
request is only handed out by a later plan, whose reset runs after every earlier batch's
addition. Row 0 is scratch: rows without a penalty, and a partial prompt's (whose token is
dropped), read it and add nothing to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PenaltyPlan:
    """One batch's use of the counts, as host lists (what the info cache keys on)."""

    slots: list[int]  # the counts row of each batch row (0: none)
    counted: list[bool]  # the row's sampled token is added to its counts
    capacity: int  # rows the device's counts must have
    resets: list[tuple[int, list[int], list[int] | None]]  # (row, output so far, prompt)
    width: int = 0  # last output tokens kept per row (the longest bad-word prefix)
    counts: bool = True  # the batch reads the counts (one of its requests has a penalty)

    @property
    def key(self) -> tuple:
        """Equal keys: the same rows, read and added the same way, and no reset (an info
        with resets must not be reused: it would reset the rows again)."""
        return (tuple(self.slots), tuple(self.counted), len(self.resets), self.width)


@dataclass
class PenaltyRows:
    """A `PenaltyPlan` on the device; the reset tokens as (row, token id) pairs."""

    slots: torch.Tensor  # [B] int64
    counted: torch.Tensor  # [B] float32, 1.0 where the sampled token is added
    capacity: int
    width: int = 0
    counts: bool = True
    reset_rows: torch.Tensor | None = None  # [I] int64
    output_rows: torch.Tensor | None = None  # [N] int64
    output_ids: torch.Tensor | None = None  # [N] int64
    prompt_rows: torch.Tensor | None = None  # [M] int64
    prompt_ids: torch.Tensor | None = None  # [M] int64
    # the last `width` output tokens of the reset rows, right-aligned: (row, column, id)
    recent_rows: torch.Tensor | None = None  # [K] int64
    recent_cols: torch.Tensor | None = None  # [K] int64, in [0, width)
    recent_ids: torch.Tensor | None = None  # [K] int64

    @classmethod
    def from_plan(cls, plan: PenaltyPlan, device: torch.device | str) -> PenaltyRows:
        longs = lambda xs: torch.tensor(xs, dtype=torch.int64).to(device)  # noqa: E731
        rows = cls(
            longs(plan.slots),
            torch.tensor(plan.counted, dtype=torch.float32).to(device),
            plan.capacity,
            plan.width,
            plan.counts,
        )
        if plan.resets:
            rows.reset_rows = longs([row for row, _, _ in plan.resets])
            out = [(row, t) for row, ids, _ in plan.resets for t in ids]
            prompt = [(row, t) for row, _, ids in plan.resets for t in ids or ()]
            tails = []  # (row, column, id) of each reset row's last `width` tokens
            for row, ids, _ in plan.resets:
                tail = ids[max(0, len(ids) - plan.width) :] if plan.width else []
                tails += [(row, plan.width - len(tail) + j, t) for j, t in enumerate(tail)]
            if out:
                rows.output_rows, rows.output_ids = (longs(xs) for xs in zip(*out, strict=True))
            if prompt:
                rows.prompt_rows, rows.prompt_ids = (longs(xs) for xs in zip(*prompt, strict=True))
            if tails:
                rows.recent_rows, rows.recent_cols, rows.recent_ids = (
                    longs(xs) for xs in zip(*tails, strict=True)
                )
        return rows


class PenaltyCounts:
    """The device's counts and last tokens of the tracked requests (see the module docstring)."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None  # [R, V] float32, output tokens
        self.prompt_seen: torch.Tensor | None = None  # [R, V] bool, prompt tokens
        self.recent: torch.Tensor | None = None  # [R, L] int64, last output tokens (-1: none)

    def prepare(self, rows: PenaltyRows, vocab_size: int, device: torch.device) -> None:
        """Before a planned batch is sampled: grow what it needs, then apply its resets."""
        self._grow(rows, vocab_size, device)
        if rows.reset_rows is None:
            return
        if self.counts is not None:
            self.counts.index_fill_(0, rows.reset_rows, 0.0)
            if rows.output_rows is not None:
                ones = torch.ones(rows.output_rows.shape, device=device)
                self.counts.index_put_((rows.output_rows, rows.output_ids), ones, accumulate=True)
        if self.prompt_seen is not None:
            self.prompt_seen.index_fill_(0, rows.reset_rows, False)
        if rows.prompt_rows is not None:
            if self.prompt_seen is None:
                self.prompt_seen = _grown(None, self._rows(self.counts), vocab_size,
                                          torch.bool, device)  # fmt: skip
            trues = torch.ones(rows.prompt_rows.shape, dtype=torch.bool, device=device)
            self.prompt_seen.index_put_((rows.prompt_rows, rows.prompt_ids), trues)
        if self.recent is not None:
            self.recent.index_fill_(0, rows.reset_rows, -1)
            if rows.recent_rows is not None:
                # (plans' widths never shrink: the buffer is as wide as this plan's)
                assert self.recent.shape[1] == rows.width, "a plan narrower than an earlier one"
                self.recent.index_put_((rows.recent_rows, rows.recent_cols), rows.recent_ids)

    def gather(
        self, rows: PenaltyRows, with_seen: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's rows (after `prepare`): output counts [B, V], and seen [B, V] (prompt
        or output) only `with_seen` (a repetition penalty in the batch)."""
        if self.counts is None:
            raise ValueError("the plan read no counts: none of its requests has a penalty")
        counts = self.counts.index_select(0, rows.slots)
        if not with_seen:
            return counts, None
        seen = counts > 0
        if self.prompt_seen is not None:
            seen |= self.prompt_seen.index_select(0, rows.slots)
        return counts, seen

    def add(self, rows: PenaltyRows, next_token_ids: torch.Tensor) -> None:
        """Count the batch's sampled tokens (weight 0 for rows not counted: no host sync) and
        shift them into the rows' last tokens (rows not counted all write the scratch row 0,
        which no bad word reads)."""
        if self.counts is not None:
            self.counts.index_put_((rows.slots, next_token_ids), rows.counted, accumulate=True)
        if self.recent is not None:
            old = self.recent.index_select(0, rows.slots)
            shifted = torch.cat([old[:, 1:], next_token_ids.view(-1, 1)], dim=1)
            self.recent.index_copy_(0, rows.slots, shifted)

    def _grow(self, rows: PenaltyRows, vocab_size: int, device: torch.device) -> None:
        if self.counts is not None and self.counts.shape[1] != vocab_size:
            raise ValueError(f"penalty counts of {self.counts.shape[1]} tokens, logits of "
                             f"{vocab_size}")  # fmt: skip
        have = self._rows(self.counts)  # (every add writes to them once they exist)
        if (rows.counts and self.counts is None) or (have and rows.capacity > have):
            size = _size(rows.capacity, have)
            self.counts = _grown(self.counts, size, vocab_size, torch.float32, device)
            if self.prompt_seen is not None:
                self.prompt_seen = _grown(self.prompt_seen, size, vocab_size, torch.bool, device)
        have = self._rows(self.recent)
        width = 0 if self.recent is None else self.recent.shape[1]
        if rows.width > width or (self.recent is not None and rows.capacity > have):
            size = _size(rows.capacity, have) if rows.capacity > have else have
            new = torch.full((size, max(width, rows.width)), -1, dtype=torch.int64, device=device)
            if self.recent is not None:  # kept right-aligned: the newest token last
                new[:have, new.shape[1] - width :] = self.recent
            self.recent = new

    @staticmethod
    def _rows(buffer: torch.Tensor | None) -> int:
        return 0 if buffer is None else buffer.shape[0]


def _size(capacity: int, have: int) -> int:
    """Rows to allocate for `capacity`: doubling, so that few copies are made as requests come."""
    return max(capacity, 2 * have)


def _grown(
    old: torch.Tensor | None, rows: int, cols: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    new = torch.zeros((rows, cols), dtype=dtype, device=device)
    if old is not None:
        new[: old.shape[0]] = old
    return new


class PenaltySlots:
    """The scheduler's side: which requests hold which row (row 0 is scratch)."""

    def __init__(self) -> None:
        self._slot: dict[Any, int] = {}  # request -> its row
        self._reset_at: dict[Any, int] = {}  # request -> num_retractions when last reset
        self._free: list[int] = []
        self.capacity = 1
        self.width = 0  # the longest bad-word prefix of a request tracked so far

    def add(self, req: Any) -> None:
        """Track `req` (a request with a penalty, or a bad word of several tokens)."""
        self._slot[req] = 0  # a row is given when its first token is sampled
        words = req.sampling_params.bad_words_ids or ()
        self.width = max([self.width] + [len(word) - 1 for word in words])

    def __bool__(self) -> bool:
        return bool(self._slot)

    def plan(self, reqs: list[Any], chunked_req: Any | None) -> PenaltyPlan | None:
        """The batch's plan, or None when none of its requests is tracked. Frees the rows
        of requests that finished; the plan's resets must run before its rows are read."""
        for req in [r for r in self._slot if r.finished]:
            self._reset_at.pop(req, None)
            if slot := self._slot.pop(req):
                self._free.append(slot)
        if not any(r in self._slot for r in reqs):
            return None
        slots, counted, resets = [], [], []
        penalized = False  # the batch reads the counts (a request of it has a penalty)
        for req in reqs:
            penalized = penalized or req.sampling_params.has_penalty
            if req not in self._slot or req is chunked_req:
                slots.append(0)
                counted.append(False)
                continue
            if self._reset_at.get(req) != req.num_retractions:  # new, or re-prefilled
                if not self._slot[req]:
                    self._slot[req] = self._take()
                self._reset_at[req] = req.num_retractions
                repetition = req.sampling_params.repetition_penalty != 1.0
                prompt = list(req.origin_input_ids) if repetition else None
                resets.append((self._slot[req], list(req.output_ids), prompt))
            slots.append(self._slot[req])
            counted.append(True)
        return PenaltyPlan(slots, counted, self.capacity, resets, self.width, penalized)

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        self.capacity += 1
        return self.capacity - 1
