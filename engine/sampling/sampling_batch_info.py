"""The sampling parameters of one batch, as device tensors the sampler reads.

Built once per batch (it is rebuilt, not merged or filtered, when the batch changes) from the
requests' `SamplingParams`, raw or normalized. The per-request Python work happens here, so
that `Sampler` itself never loops over requests.

Row i of every tensor belongs to request i. Greedy requests (temperature < 1e-6 or
top_k == 1) get temperature 1.0 and top_k 1, as in SGLang, and are marked in `greedy_rows`
so that the sampler returns their exact argmax even inside a sampled batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.sampling.grammar import allow_only, apply_vocab_mask
from engine.sampling.logit_bans import (
    BadWordPrefixes,
    bad_word_bans,
    logit_bias_triples,
    min_new_token_bans,
)
from engine.sampling.penalties import BatchPenalties
from engine.sampling.penalty_slots import PenaltyPlan, PenaltyRows
from engine.sampling.sampling_params import SamplingParams


@dataclass
class SamplingBatchInfo:
    vocab_size: int
    temperatures: torch.Tensor  # [B, 1] float32 (1.0 for greedy rows)
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, in [1, vocab_size]
    min_ps: torch.Tensor  # [B] float32
    greedy_rows: torch.Tensor  # [B] bool
    is_all_greedy: bool
    has_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    # Seeded sampling: rows with a sampling_seed, their seeds and the index of the token
    # being sampled; None when no row is seeded. `unseeded_rows` is None when no row is.
    seeded_rows: torch.Tensor | None  # [S] int64
    seeds: torch.Tensor | None  # [S] int64
    seed_steps: torch.Tensor | None  # [S] int64
    unseeded_rows: torch.Tensor | None  # [B - S] int64
    penalties: BatchPenalties | None
    # logit_bias of every row as (row, token id, bias) triples; None when no row has one
    bias_rows: torch.Tensor | None = None  # [N] int64
    bias_ids: torch.Tensor | None = None  # [N] int64
    bias_values: torch.Tensor | None = None  # [N] float32
    # structured output: the rows with a grammar and their token bitmasks (see
    # engine/sampling/grammar.py); None when no row has one. Set per step (`with_vocab_mask`).
    vocab_rows: torch.Tensor | None = None  # [G] int64
    vocab_mask: torch.Tensor | None = None  # [G, ceil(V / 32)] int32
    # allowed_token_ids: the rows that have them, and which tokens each may take
    allowed_rows: torch.Tensor | None = None  # [A] int64
    allowed: torch.Tensor | None = None  # [A, V] bool
    # the overlap scheduler's: the batch's rows of the history the device keeps (penalty
    # counts, last tokens; engine/sampling/penalty_slots.py), and the bad words of several
    # tokens matched there
    history_rows: PenaltyRows | None = None
    bad_words: BadWordPrefixes | None = None

    @property
    def batch_size(self) -> int:
        return self.top_ps.shape[0]

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device | str,
        *,
        output_ids: Sequence[Sequence[int]] | None = None,
        input_ids: Sequence[Sequence[int]] | None = None,
        step_positions: Sequence[int] | None = None,
        eos_token_ids: Sequence[int] = (),
        penalty_plan: PenaltyPlan | None = None,
    ) -> SamplingBatchInfo:
        """Vectorise the batch's parameters.

        `output_ids[i]` / `input_ids[i]`: request i's generated tokens so far and its prompt,
        read only when some request has a penalty (output_ids: or a bad word of several
        tokens, which then needs them), and not with a `penalty_plan`. `step_positions[i]`:
        index of the token being sampled for request i (its output length so far); defaults to
        `len(output_ids[i])` and is required for seeded requests and ones with
        min_new_tokens when output_ids is None. `eos_token_ids`: the model's, banned (with
        the request's stop tokens) from rows below their min_new_tokens. `penalty_plan`: the
        penalties and the bad words read the history the device keeps
        (engine/sampling/penalty_slots.py), not `output_ids` and `input_ids`.
        """
        batch_size = len(params)
        _check_lengths(
            batch_size, output_ids=output_ids, input_ids=input_ids, step_positions=step_positions
        )
        greedy = [p.is_greedy for p in params]
        # Greedy rows: temperature 1, top_k 1, and no filter of theirs needs any work.
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_ks = [
            1 if g else _clamp_top_k(p.top_k, vocab_size)
            for p, g in zip(params, greedy, strict=True)
        ]
        seeded = _seeded(params, device, output_ids, step_positions)
        bans = min_new_token_bans(params, output_ids, step_positions, eos_token_ids)
        on_device = penalty_plan is not None
        bans += bad_word_bans(params, output_ids, prefixes_on_device=on_device)
        if bans or any(p.logit_bias for p in params):
            bias = logit_bias_triples(params, device, bans)
        else:
            bias = (None,) * 3
        return cls(
            vocab_size=vocab_size,
            temperatures=_floats(temps, device).unsqueeze(1),
            top_ps=_floats([p.top_p for p in params], device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=_floats([p.min_p for p in params], device),
            greedy_rows=torch.tensor(greedy, dtype=torch.bool, device=device),
            is_all_greedy=not sampled,
            has_greedy=len(sampled) < batch_size,
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            need_top_k=any(_clamp_top_k(p.top_k, vocab_size) < vocab_size for p in sampled),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            seeded_rows=seeded[0],
            seeds=seeded[1],
            seed_steps=seeded[2],
            unseeded_rows=seeded[3],
            penalties=BatchPenalties.build(
                params, vocab_size, device, output_ids, input_ids, on_device
            ),
            bias_rows=bias[0],
            bias_ids=bias[1],
            bias_values=bias[2],
            **_allowed(params, vocab_size, device),
            **_device_history(params, penalty_plan, device),
        )

    def apply_logit_bias(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [B, V] plus each row's logit_bias (a new tensor; `logits` is kept)."""
        if self.bias_rows is None:
            return logits
        assert self.bias_ids is not None and self.bias_values is not None
        index = (self.bias_rows, self.bias_ids)
        return logits.index_put(index, self.bias_values, accumulate=True)

    def apply_vocab_mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [B, V] with what the grammar rows' masks, and the rows' allowed tokens,
        forbid at -inf (a new tensor, unless there is nothing to forbid)."""
        if self.vocab_rows is not None:
            assert self.vocab_mask is not None
            logits = apply_vocab_mask(logits, self.vocab_rows, self.vocab_mask)
        if self.allowed_rows is not None:
            assert self.allowed is not None
            logits = allow_only(logits, self.allowed_rows, self.allowed)
        return logits

    def with_vocab_mask(
        self, mask: tuple[torch.Tensor, torch.Tensor] | None, device: torch.device | str
    ) -> SamplingBatchInfo:
        """This info with the step's grammar masks (`grammar.vocab_mask`'s rows and bitmask),
        as a copy: the info itself may be cached and reused by later steps."""
        if mask is None:
            return self
        rows, bits = (t.to(device, non_blocking=True) for t in mask)
        return dataclasses.replace(self, vocab_rows=rows, vocab_mask=bits)


class SamplingInfoCache:
    """The last batch's `SamplingBatchInfo`, reused while a batch holds the same requests'
    parameters, as consecutive decode steps mostly do.

    Building an info is per-request Python plus five host-to-device copies: on the null model
    runner (benchmarks/host_overhead.py) it was about a sixth of a decode step's host time.
    Only infos that do not depend on the step are kept: none with penalties counted from the
    history (penalties on the device's counts are kept while the plan has no resets), seeded
    rows (their noise depends on the token index) or min_new_tokens. The key is the params
    objects' identities (and the penalty plan's rows); the cache holds the objects, so an
    identity cannot be reused by a new request while its entry lives. `SamplingParams` are not
    changed once a request is queued.
    """

    def __init__(self) -> None:
        self._key: tuple[int, ...] | None = None
        self._params: list[SamplingParams] = []
        self._info: SamplingBatchInfo | None = None
        self.hits = 0

    def get(
        self,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device | str,
        penalty_plan: PenaltyPlan | None = None,
        **kwargs: Sequence | None,
    ) -> SamplingBatchInfo:
        """`SamplingBatchInfo.from_params(params, vocab_size, device, penalty_plan=...,
        **kwargs)`, or the previous call's result when it is reusable and `params` are the same
        objects (and the plan's rows the same)."""
        key = tuple(map(id, params)) + (penalty_plan.key if penalty_plan is not None else ())
        if key == self._key and self._info is not None:
            self.hits += 1
            return self._info
        info = SamplingBatchInfo.from_params(
            params, vocab_size, device, penalty_plan=penalty_plan, **kwargs
        )
        # (min_new_tokens bans end with the steps; a bad word's, matched on the host, depends
        # on the output)
        on_host = penalty_plan is None
        step_free = not any(p.min_new_tokens or (p.has_bad_word_prefixes and on_host)
                            for p in params)  # fmt: skip
        # the device's history (counts, last tokens) is steady once the plan resets no row
        steady = info.penalties is None if on_host else not penalty_plan.resets
        if steady and info.seeded_rows is None and step_free:
            self._key, self._params, self._info = key, list(params), info
        else:
            self._key, self._params, self._info = None, [], None
        return info


def _allowed(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """`allowed_rows` and `allowed` of the rows with allowed_token_ids ({} if none)."""
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return {}
    allowed = torch.zeros((len(rows), vocab_size), dtype=torch.bool)
    for j, i in enumerate(rows):
        allowed[j, params[i].allowed_token_ids] = True
    return {
        "allowed_rows": torch.tensor(rows, dtype=torch.int64).to(device),
        "allowed": allowed.to(device),
    }


def _device_history(
    params: Sequence[SamplingParams], plan: PenaltyPlan | None, device: torch.device | str
) -> dict[str, Any]:
    """`history_rows` and `bad_words` of a batch planned on the device's history ({} if not)."""
    if plan is None:
        return {}
    return {
        "history_rows": PenaltyRows.from_plan(plan, device),
        "bad_words": BadWordPrefixes.build(params, plan.slots, plan.width, device),
    }


def _floats(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _clamp_top_k(top_k: int, vocab_size: int) -> int:
    return vocab_size if top_k < 1 or top_k > vocab_size else top_k


def _check_lengths(batch_size: int, **lists: Sequence | None) -> None:
    for name, values in lists.items():
        if values is not None and len(values) != batch_size:
            raise ValueError(f"{name} has {len(values)} entries for a batch of {batch_size}")


_SeededTensors = tuple[
    torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None
]


def _seeded(
    params: Sequence[SamplingParams],
    device: torch.device | str,
    output_ids: Sequence[Sequence[int]] | None,
    step_positions: Sequence[int] | None,
) -> _SeededTensors:
    """(seeded_rows, seeds, seed_steps, unseeded_rows); each None when empty."""
    rows = [i for i, p in enumerate(params) if p.sampling_seed is not None]
    if not rows:
        return None, None, None, None
    if step_positions is None:
        if output_ids is None:
            raise ValueError("seeded sampling needs step_positions or output_ids")
        step_positions = [len(ids) for ids in output_ids]
    others = [i for i in range(len(params)) if params[i].sampling_seed is None]
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)
    return (
        as_tensor(rows),
        as_tensor([params[i].sampling_seed for i in rows]),
        as_tensor([step_positions[i] for i in rows]),
        as_tensor(others) if others else None,
    )
