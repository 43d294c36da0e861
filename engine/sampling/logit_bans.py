"""Tokens a row must not sample this step, and its logit_bias, as (row, token, value)
triples that `SamplingBatchInfo.apply_logit_bias` adds to the logits (a ban adds -inf).

* min_new_tokens: a row short of it may not end (its EOS and stop tokens are banned).
* bad words (vLLM's `bad_words`, as token sequences in `bad_words_ids`): a word's last token
  is banned where the output so far ends with the tokens before it; a one-token word is
  banned always. As in vLLM, only the output is matched, not the prompt. Words of several
  tokens need the output so far (`output_ids`): the overlap scheduler samples such rows
  deferred, once the batch before is processed (`SamplingParams.needs_history`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling.sampling_params import SamplingParams

Bans = list[tuple[int, list[int]]]  # (row, token ids it must not sample)


def bad_word_bans(
    params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]] | None
) -> Bans:
    """(row, token ids) that would complete one of the row's bad words now."""
    bans = []
    for i, p in enumerate(params):
        if not p.bad_words_ids:
            continue
        if p.has_bad_word_prefixes and output_ids is None:
            raise ValueError("bad words of several tokens need output_ids")
        banned = set()
        for word in p.bad_words_ids:
            prefix = word[:-1]
            if not prefix or _ends_with(output_ids[i], prefix):  # type: ignore[index]
                banned.add(word[-1])
        if banned:
            bans.append((i, sorted(banned)))
    return bans


def _ends_with(ids: Sequence[int], suffix: list[int]) -> bool:
    n = len(suffix)
    return len(ids) >= n and list(ids[len(ids) - n :]) == suffix


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
