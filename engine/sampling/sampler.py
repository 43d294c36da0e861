"""The vectorised sampler: penalties, greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Order, all on [B, V] tensors with no per-request Python loop:

    penalties -> logit_bias -> grammar mask -> (all greedy: argmax, done) -> / temperature
      -> softmax -> top-k -> top-p (on the top-k-renormalised mass) -> min-p -> draw

Drawing uses the exponential race (the Gumbel-max trick in probability space): with
E_v ~ Exp(1) independent, argmax_v p_v / E_v is distributed as p / sum(p). The race is
invariant to scaling a row, so the truncated probabilities never need renormalising, and
the draw is a pure function of (p, E): a seeded request gets E from a counter-based hash
of (seed, step position, token id), which makes it reproducible whatever the rest of the
batch is and wherever the request sits in it. Unseeded rows take E from the sampler's
own torch.Generator. Greedy rows (top_k == 1 or temperature ~ 0) return the exact argmax.

Prompt logprobs (`sample_batch`, for requests with `logprob_start_len`) follow the same rule
without penalties and logit_bias (which shape what is generated): the logits of the prompt
position before each scored token, divided by the request's temperature.

Logprobs follow SGLang's default (SGLANG_RETURN_ORIGINAL_LOGPROB unset): log_softmax of the
penalised, biased and grammar-masked logits divided by the request's temperature, taken
before top-k / top-p / min-p, clamped to float32's lowest finite value. For greedy requests
the temperature is 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.sampling.penalty_slots import PenaltyCounts
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from kernels.argmax import argmax_rows
from kernels.jit import compiled_on

if TYPE_CHECKING:
    from engine.scheduler.schedule_batch import ModelWorkerBatch

_M32 = 0xFFFFFFFF
PROMPT_LOGPROB_SLICE = 1024  # prompt logprob rows per pass (see `prompt_logprobs`)

TopLogprobs = tuple[list[int], list[float]]  # (token ids, logprobs), best first
# One request's prompt logprobs from one batch: the scored tokens' logprobs, in prompt order,
# their top candidates when the request asked for top logprobs, and their ranks (vLLM's: how
# many tokens have a logprob at least as high; 1 is the best).
PromptLogprobs = tuple[list[float], list[TopLogprobs] | None, list[int] | None]


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, logprob of each chosen token
    top_logprobs: list[TopLogprobs] | None  # per request
    prompt_logprobs: list[PromptLogprobs | None] | None = None  # per request (sample_batch)


class Sampler:
    """Picks the next token of every request in a batch.

    Owns the RNG of unseeded requests: one torch.Generator per device, seeded from `seed`
    (the server's random_seed; None seeds it from the OS); and the penalty counts and last
    tokens the overlap scheduler keeps on the device (`penalty_counts`,
    engine/sampling/penalty_slots.py), to which each batch planned on them adds its sampled
    tokens.
    """

    def __init__(self, seed: int | None = None, device: torch.device | str | None = None) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self.penalty_counts = PenaltyCounts()
        if device is not None:
            self._generator(torch.device(device))

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: Sequence[int] | None = None,
    ) -> SampleOutput:
        """Sample from `logits` [B, V]; `logits` itself is left unchanged. 16-bit logits (a
        CUDA graph's, engine/cuda_graph_runner.py) are converted to float32 only where the
        logits are changed before they are read (see `_changes_logits`): greedy rows take the
        argmax of the 16-bit values (the same index: the conversion is exact), a temperature's
        division and log_softmax convert as they read."""
        if logits.element_size() != 2 or _changes_logits(info):
            logits = logits.float()
        rows = info.history_rows  # the overlap scheduler's history on the device
        if rows is not None:
            self.penalty_counts.prepare(rows, logits.shape[1], logits.device)
        if info.penalties is not None:
            logits = info.penalties.apply(logits, self.penalty_counts, rows)
        logits = info.apply_logit_bias(logits)
        if info.bad_words is not None:
            logits = info.bad_words.apply(logits, self.penalty_counts.recent)
        logits = info.apply_vocab_mask(logits)
        if info.is_all_greedy:
            scaled = logits
            next_ids = greedy(logits)
        else:
            scaled = logits / info.temperatures
            next_ids = self._sample(torch.softmax(scaled, dim=-1), info)
            if info.has_greedy:
                next_ids = torch.where(info.greedy_rows, greedy(logits), next_ids)
        if rows is not None:
            self.penalty_counts.add(rows, next_ids)
        if not return_logprob:
            return SampleOutput(next_ids, None, None)
        logprobs = F.log_softmax(scaled, dim=-1, dtype=torch.float32)
        logprobs.clamp_(min=torch.finfo(torch.float32).min)
        chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
        return SampleOutput(next_ids, chosen, _top_logprobs(logprobs, top_logprobs_nums))

    def _sample(self, probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        token_ids = None  # column j holds token j unless the rows were sorted
        if info.need_top_k or info.need_top_p:
            probs, token_ids = probs.sort(dim=-1, descending=True)
            probs = _top_k_top_p_sorted(probs, info)
        if info.need_min_p:
            max_probs = probs[:, :1] if token_ids is not None else probs.amax(-1, keepdim=True)
            probs = probs.masked_fill(probs < max_probs * info.min_ps.unsqueeze(1), 0.0)
        choice = torch.argmax(probs / self._exponential_noise(probs, info, token_ids), dim=-1)
        if token_ids is None:
            return choice
        return token_ids.gather(1, choice.unsqueeze(1)).squeeze(1)

    def _exponential_noise(
        self, probs: torch.Tensor, info: SamplingBatchInfo, token_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """Exp(1) noise [B, V]; seeded rows from the hash, others from the generator."""
        noise = torch.empty_like(probs)
        gen = self._generator(probs.device)
        if info.seeded_rows is None:
            noise.exponential_(generator=gen)
        else:
            if info.unseeded_rows is not None:
                rest = probs.new_empty(len(info.unseeded_rows), probs.shape[1])
                noise[info.unseeded_rows] = rest.exponential_(generator=gen)
            if token_ids is None:
                ids = torch.arange(probs.shape[1], device=probs.device).expand(
                    len(info.seeded_rows), -1
                )
            else:
                ids = token_ids[info.seeded_rows]
            assert info.seeds is not None and info.seed_steps is not None
            noise[info.seeded_rows] = seeded_exponential(info.seeds, info.seed_steps, ids)
        # An exact 0 would turn p / E into inf or nan; no real draw is that small.
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self.seed is None:
                gen.seed()
            else:
                gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen


def _changes_logits(info: SamplingBatchInfo) -> bool:
    """Whether the batch's penalties, logit biases, bad words or masks change its logits
    (in float32) before they are read."""
    return (
        info.penalties is not None
        or info.bias_rows is not None
        or info.bad_words is not None
        or info.vocab_rows is not None
        or info.allowed_rows is not None
    )


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (torch's: the first maximal index, NaN above all): in two stages on
    CUDA (kernels/argmax.py; torch's one block per row took 27 us of a batch-1 decode step
    over a 128k vocabulary on the H100), torch's elsewhere."""
    if compiled_on(logits) and logits.dim() == 2 and logits.stride(1) == 1:
        return argmax_rows(logits)
    return torch.argmax(logits, dim=-1)


def sample_batch(
    sampler: Sampler, logits: torch.Tensor, info: SamplingBatchInfo, mwb: ModelWorkerBatch
) -> SampleOutput:
    """Sample a batch's next tokens from the first `batch_size` rows of `logits`; the rows
    after them (`mwb.prompt_logprob_rows`, if any) give the prompt logprobs."""
    counts = mwb.prompt_logprob_counts
    if counts is None:
        return sampler(logits, info, mwb.return_logprob, mwb.top_logprobs_nums)
    b = mwb.batch_size
    out = sampler(logits[:b], info, mwb.return_logprob, mwb.top_logprobs_nums)
    out.prompt_logprobs = prompt_logprobs(logits[b:], info, mwb)
    return out


def prompt_logprobs(
    logits: torch.Tensor, info: SamplingBatchInfo, mwb: ModelWorkerBatch
) -> list[PromptLogprobs | None]:
    """Each request's share of the prompt logprob rows `logits` [K, V]: the logprob of the
    target token of each row, its rank if a request of the batch wants ranks (a full pass
    over the row: it costs about as much as the log_softmax), and the row's top logprobs if
    the request wants them.

    Rows go through in slices, so the temporaries stay [PROMPT_LOGPROB_SLICE, V] however
    many rows the batch has (log_softmax, one fused pass, beat logsumexp and a gather by
    1.7x on CPU).
    """
    counts, targets = mwb.prompt_logprob_counts, mwb.prompt_logprob_targets
    nums = mwb.top_logprobs_nums
    assert counts is not None and targets is not None
    dev, num_rows = logits.device, logits.shape[0]
    temps = None
    if not info.is_all_greedy:  # (greedy rows have temperature 1)
        repeats = torch.tensor(counts, device=dev)
        temps = info.temperatures.view(-1).repeat_interleave(repeats, output_size=num_rows)
    target = torch.tensor(targets, dtype=torch.int64, device=dev).unsqueeze(1)
    k_max = max((k for k, c in zip(nums, counts, strict=True) if c), default=0)
    chosen_parts, rank_parts, top_values, top_ids = [], [], [], []
    for lo in range(0, num_rows, PROMPT_LOGPROB_SLICE):
        hi = lo + PROMPT_LOGPROB_SLICE
        rows = logits[lo:hi].float()
        if temps is not None:
            rows = rows / temps[lo:hi].unsqueeze(1)
        rows = F.log_softmax(rows, dim=-1)
        chosen = rows.gather(1, target[lo:hi])
        chosen_parts.append(chosen)
        if mwb.prompt_ranks:
            rank_parts.append((rows >= chosen).sum(dim=1))
        if k_max:
            values, ids = rows.topk(min(k_max, rows.shape[1]), dim=-1)
            top_values.append(values)
            top_ids.append(ids)
    floor = torch.finfo(torch.float32).min
    chosen = torch.cat(chosen_parts).squeeze(1).clamp_(min=floor).tolist()
    ranks = torch.cat(rank_parts).tolist() if rank_parts else None
    if k_max:
        values_rows = torch.cat(top_values).clamp_(min=floor).tolist()
        ids_rows = torch.cat(top_ids).tolist()
    out: list[PromptLogprobs | None] = []
    offset = 0
    for k, c in zip(nums, counts, strict=True):
        top = None
        if c and k > 0:
            top = [(ids_rows[r][:k], values_rows[r][:k]) for r in range(offset, offset + c)]
        rank = None if ranks is None else ranks[offset : offset + c]
        out.append((chosen[offset : offset + c], top, rank) if c else None)
        offset += c
    return out


def _top_k_top_p_sorted(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the tokens outside top-k, then outside top-p; rows sorted descending."""
    if info.need_top_k:
        ranks = torch.arange(probs.shape[1], device=probs.device)
        probs = probs.masked_fill(ranks.unsqueeze(0) >= info.top_ks.unsqueeze(1), 0.0)
    if info.need_top_p:
        cum = probs.cumsum(dim=-1)
        mass_before = F.pad(cum[:, :-1], (1, 0))
        top_ps = info.top_ps.unsqueeze(1)
        # Keep the smallest prefix whose mass reaches top_p (of what top-k kept). top_p = 1
        # keeps everything, even tokens the float32 cumsum has already rounded to 1.
        drop = (mass_before >= top_ps * cum[:, -1:]) & (top_ps < 1.0)
        probs = probs.masked_fill(drop, 0.0)
    return probs


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32, without overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the "lowbias32" shift-multiply finaliser), on int64 tensors."""
    x = x & _M32
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


def seeded_exponential(
    seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """Exp(1) draws [S, V] that depend only on (seeds[s], steps[s], token_ids[s, v]).

    `seeds`, `steps`: [S] int64; `token_ids`: [S, V] int64. Every operation is elementwise
    integer arithmetic kept below 2**48, so results are identical on every device and for
    every batch layout.
    """
    key = _mix32((seeds & _M32) ^ 0x9E3779B9)
    key = _mix32(key ^ ((seeds >> 32) & _M32))
    key = _mix32(key ^ (steps & _M32) ^ ((steps >> 32) & _M32))
    key2 = _mix32(key ^ 0x85EBCA6B)
    bits = _mix32(_mix32(token_ids ^ key.unsqueeze(1)) ^ key2.unsqueeze(1))
    # 24 bits, as float32 holds them exactly; u lies strictly inside (0, 1).
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (2.0**-24)
    return -torch.log(uniform)


def _top_logprobs(logprobs: torch.Tensor, nums: Sequence[int] | None) -> list[TopLogprobs] | None:
    """The k highest (token id, logprob) of each row, best first; None if no k > 0."""
    k_max = max(nums, default=0) if nums else 0
    if k_max <= 0:
        return None
    assert nums is not None
    values, ids = logprobs.topk(min(k_max, logprobs.shape[1]), dim=-1)
    values_rows, ids_rows = values.tolist(), ids.tolist()
    return [(ids_rows[i][:k], values_rows[i][:k]) for i, k in enumerate(nums)]
