"""Tokens a row must not sample this step, and its logit_bias, as (row, token, value)
triples that `SamplingBatchInfo.apply_logit_bias` adds to the logits (a ban adds -inf).

* min_new_tokens: a row short of it may not end (its EOS and stop tokens are banned).
* bad words (vLLM's `bad_words`, as token sequences in `bad_words_ids`): a word's last token
  is banned where the output so far ends with the tokens before it; a one-token word is
  banned always. As in vLLM, only the output is matched, not the prompt. Words of several
  tokens are matched either against the output so far on the host (`output_ids`: the plain
  scheduler) or on the device (`BadWordPrefixes`: the overlap scheduler, whose last token
  may still be in flight), against the last tokens `PenaltyCounts` keeps of each request
  (engine/sampling/penalty_slots.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling.sampling_params import SamplingParams

Bans = list[tuple[int, list[int]]]  # (row, token ids it must not sample)


def bad_word_bans(
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]] | None,
    prefixes_on_device: bool = False,
) -> Bans:
    """(row, token ids) that would complete one of the row's bad words now (of the words of
    one token only, when those of several are matched on the device)."""
    bans = []
    for i, p in enumerate(params):
        if not p.bad_words_ids:
            continue
        if p.has_bad_word_prefixes and output_ids is None and not prefixes_on_device:
            raise ValueError("bad words of several tokens need output_ids")
        banned = set()
        for word in p.bad_words_ids:
            prefix = word[:-1]
            if not prefix or (
                not prefixes_on_device and _ends_with(output_ids[i], prefix)  # type: ignore[index]
            ):
                banned.add(word[-1])
        if banned:
            bans.append((i, sorted(banned)))
    return bans


def _ends_with(ids: Sequence[int], suffix: list[int]) -> bool:
    n = len(suffix)
    return len(ids) >= n and list(ids[len(ids) - n :]) == suffix


@dataclass
class BadWordPrefixes:
    """The batch's bad words of several tokens, matched on the device against the last output
    tokens of each row's `PenaltyCounts.recent` row (-1 where it has fewer tokens)."""

    rows: torch.Tensor  # [W] int64, the batch row of each word
    slots: torch.Tensor  # [W] int64, that row's row of the recent tokens
    prefixes: torch.Tensor  # [W, L] int64, the word but its last token, right-aligned (-1 before)
    tokens: torch.Tensor  # [W] int64, the word's last token: banned where the prefix matches

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        slots: Sequence[int],
        width: int,
        device: torch.device | str,
    ) -> BadWordPrefixes | None:
        """None when no row of a request with a row (`slots[i] > 0`) has such a word (a
        partial prompt's row, whose token is dropped, has none)."""
        words = [(i, slots[i], word) for i, p in enumerate(params) if slots[i]
                 for word in p.bad_words_ids or () if len(word) > 1]  # fmt: skip
        if not words:
            return None
        prefixes = [[-1] * (width + 1 - len(w)) + w[:-1] for _, _, w in words]
        longs = lambda xs: torch.tensor(xs, dtype=torch.int64).to(device)  # noqa: E731
        rows, row_slots, last = zip(*((i, s, w[-1]) for i, s, w in words), strict=True)
        return cls(longs(rows), longs(row_slots), longs(prefixes), longs(last))

    def apply(self, logits: torch.Tensor, recent: torch.Tensor | None) -> torch.Tensor:
        """`logits` [B, V] with each matched word's last token at -inf (a new tensor)."""
        if recent is None:
            raise ValueError("bad words matched on the device need its recent tokens")
        width = self.prefixes.shape[1]
        tails = recent.index_select(0, self.slots)[:, recent.shape[1] - width :]
        matched = ((tails == self.prefixes) | (self.prefixes < 0)).all(dim=1)
        bans = torch.zeros(matched.shape, device=logits.device).masked_fill_(matched, -torch.inf)
        return logits.index_put((self.rows, self.tokens), bans, accumulate=True)


def min_new_token_bans(
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]] | None,
    step_positions: Sequence[int] | None,
    eos_token_ids: Sequence[int],
) -> Bans:
    """(row, token ids) that must not be sampled yet: the EOS (unless ignored) and stop tokens
    of rows short of their min_new_tokens (grammar rows excepted: the grammar ends them)."""
    bans = []
    for i, p in enumerate(params):
        if p.min_new_tokens > 0 and not p.has_grammar:
            if step_positions is not None:
                position = step_positions[i]
            elif output_ids is not None:
                position = len(output_ids[i])
            else:
                raise ValueError("min_new_tokens needs step_positions or output_ids")
            if position < p.min_new_tokens:
                stops = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    stops.update(eos_token_ids)
                if stops:
                    bans.append((i, sorted(stops)))
    return bans


def logit_bias_triples(
    params: Sequence[SamplingParams],
    device: torch.device | str,
    bans: Sequence[tuple[int, list[int]]] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            ids += p.logit_bias_ids()
            values += p.logit_bias.values()
    for i, banned in bans:  # -inf added to a logit bans it
        rows += [i] * len(banned)
        ids += banned
        values += [float("-inf")] * len(banned)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)
    return as_tensor(rows), as_tensor(ids), torch.tensor(values, dtype=torch.float32, device=device)
