"""Token-history penalties of one batch: repetition, frequency and presence.

Semantics (the same as SGLang, transformers and the OpenAI API):

* repetition (HF / CTRL): for every token that appeared in the prompt OR the output so far,
  a positive logit is divided by the penalty and a negative one multiplied by it.
* frequency (OpenAI): `logit -= frequency_penalty * count`, count over OUTPUT tokens only.
* presence (OpenAI): `logit -= presence_penalty * (count > 0)`, output tokens only.

They are applied in that order, to the raw logits, before temperature. The tensors are
built only when some request of the batch has a penalty; rows without one are left out of
the counts (their penalty values are neutral, so they are unchanged either way).

The counts come either from the history, counted on the host for the batch (`build` with
`output_ids` and `input_ids`: the plain scheduler, and the reference), or from the counts the
device keeps across steps (`build` with `on_device`: the overlap scheduler; see
engine/sampling/penalty_slots.py), which the `Sampler` gathers (the batch's
`SamplingBatchInfo.history_rows`) when it samples the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling.penalty_slots import PenaltyCounts, PenaltyRows
from engine.sampling.sampling_params import SamplingParams


@dataclass
class BatchPenalties:
    repetition: torch.Tensor | None  # [B, 1] float32, 1.0 where unused
    frequency: torch.Tensor | None  # [B, 1] float32, 0.0 where unused
    presence: torch.Tensor | None  # [B, 1] float32, 0.0 where unused
    output_counts: torch.Tensor | None  # [B, V] float32, each token's count in the output
    seen: torch.Tensor | None  # [B, V] bool, token in prompt or output (repetition only)
    on_device: bool = False  # instead of the two above: the device's counts

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device | str,
        output_ids: Sequence[Sequence[int]] | None,
        input_ids: Sequence[Sequence[int]] | None,
        on_device: bool = False,
    ) -> BatchPenalties | None:
        """The batch's penalty tensors, or None when no request has a penalty. `on_device`:
        the counts are the device's (`output_ids` and `input_ids` are not read)."""
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        use_rep = any(r != 1.0 for r in rep)
        use_freq = any(f != 0.0 for f in freq)
        use_pres = any(x != 0.0 for x in pres)
        if not (use_rep or use_freq or use_pres):
            return None
        values = {
            "repetition": _column(rep, device) if use_rep else None,
            "frequency": _column(freq, device) if use_freq else None,
            "presence": _column(pres, device) if use_pres else None,
        }
        if on_device:
            return cls(**values, output_counts=None, seen=None, on_device=True)
        batch_size = len(params)
        active = [p.has_penalty for p in params]
        counts = count_tokens(output_ids, active, batch_size, vocab_size, device)
        seen = None
        if use_rep:
            rep_rows = [r != 1.0 for r in rep]
            prompt_counts = count_tokens(input_ids, rep_rows, batch_size, vocab_size, device)
            seen = (prompt_counts > 0) | (counts > 0)
        return cls(**values, output_counts=counts, seen=seen)

    def apply(
        self,
        logits: torch.Tensor,
        device_counts: PenaltyCounts | None = None,
        rows: PenaltyRows | None = None,
    ) -> torch.Tensor:
        """Return penalised logits [B, V] (a new tensor; `logits` is not modified).
        `device_counts` and the batch's `rows` of them: read (after the plan's resets) when
        the counts are on the device."""
        counts, seen = self.output_counts, self.seen
        if self.on_device:
            if device_counts is None or rows is None:
                raise ValueError("penalties planned on the device's counts need them")
            counts, seen = device_counts.gather(rows, self.repetition is not None)
        assert counts is not None
        if self.repetition is not None and seen is not None:
            penalty = torch.where(seen, self.repetition, 1.0)
            logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        if self.frequency is not None:
            logits = logits - self.frequency * counts
        if self.presence is not None:
            logits = logits - self.presence * (counts > 0).to(logits.dtype)
        return logits


def count_tokens(
    token_lists: Sequence[Sequence[int]] | None,
    rows: Sequence[bool],
    batch_size: int,
    vocab_size: int,
    device: torch.device | str,
) -> torch.Tensor:
    """[B, V] float32 counts of each token id in `token_lists[i]` for the rows marked True.

    One scatter_add over the flattened [B * V] buffer: row i's token t lands at i * V + t.
    """
    counts = torch.zeros(batch_size * vocab_size, dtype=torch.float32, device=device)
    if token_lists is None:
        return counts.view(batch_size, vocab_size)
    flat: list[int] = []
    lens: list[int] = []
    for ids, on in zip(token_lists, rows, strict=True):
        n = len(ids) if on else 0
        if n:
            flat.extend(ids)
        lens.append(n)
    if flat:
        cols = torch.tensor(flat, dtype=torch.int64, device=device)
        row_of = torch.repeat_interleave(
            torch.arange(batch_size, device=device), torch.tensor(lens, device=device)
        )
        ones = torch.ones(cols.shape, dtype=torch.float32, device=device)
        counts.scatter_add_(0, row_of * vocab_size + cols, ones)
    return counts.view(batch_size, vocab_size)


def _column(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
