"""The model runner's side of speculative decoding: one forward over every request's last
token and drafts, a token sampled at each position, the drafts accepted.

Position j of request i (0 <= j <= k_i) is sampled as the request's token number
len(output) + j would be if drafts 1..j were its tokens: the same sampling parameters, its
penalties and bad words counted over output + drafts[:j], its seeded noise at step
len(output) + j, min_new_tokens at that step. Draft j + 1 is accepted iff it equals the token
sampled at position j; the first token that differs from its draft (or the one after the last
draft) ends the step's tokens.

That is exact, not an approximation: the n-gram draft is one token with probability 1, and
for such a draft speculative sampling's rule (accept with probability p(d), else draw from p
with d removed) gives each token x probability p(x), as drawing x ~ p and accepting iff
x == d does. So outputs are distributed as without drafts; greedy and seeded requests give
the same tokens as without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.sampling.sampler import TopLogprobs
from engine.sampling.sampling_batch_info import SamplingBatchInfo

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner
    from engine.scheduler.schedule_batch import ModelWorkerBatch


@dataclass
class VerifyResult:
    """Per request: the tokens the step appends (the accepted drafts and the token after
    them), how many drafts it had and how many were accepted, and with return_logprob each
    token's logprob (and top logprobs)."""

    tokens: list[list[int]]
    num_drafts: list[int]
    accepted: list[int]
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[TopLogprobs]] | None = None


@torch.inference_mode()
def verify(runner: ModelRunner, mwb: ModelWorkerBatch) -> VerifyResult:
    lens = mwb.spec_draft_lens
    assert lens is not None
    fb = runner.build_forward_batch(mwb)
    fb.return_all_logits = True
    logits = runner.forward(fb)  # [sum(1 + k), V]
    info = position_sampling_info(runner, mwb)
    nums = [n for n, k in zip(mwb.top_logprobs_nums, lens, strict=True) for _ in range(k + 1)]
    out = runner.sampler(logits, info, mwb.return_logprob, nums if mwb.return_logprob else None)
    sampled = out.next_token_ids.tolist()
    chosen = out.logprobs.tolist() if out.logprobs is not None else None
    tokens, accepted = [], []
    logprobs: list[list[float]] | None = [] if chosen is not None else None
    top: list[list[TopLogprobs]] | None = [] if out.top_logprobs is not None else None
    start = 0
    for k in lens:
        t = sampled[start : start + k + 1]
        drafts = mwb.input_ids[start + 1 : start + 1 + k]
        a = 0
        while a < k and drafts[a] == t[a]:
            a += 1
        tokens.append(t[: a + 1])
        accepted.append(a)
        if logprobs is not None:
            logprobs.append(chosen[start : start + a + 1])
        if top is not None:
            top.append(out.top_logprobs[start : start + a + 1])
        start += k + 1
    return VerifyResult(tokens, list(lens), accepted, logprobs, top)


def position_sampling_info(runner: ModelRunner, mwb: ModelWorkerBatch) -> SamplingBatchInfo:
    """The sampling info of every position of a verify batch (see the module's docstring)."""
    lens = mwb.spec_draft_lens
    assert lens is not None
    params, prompts, steps, starts = [], [], [], []
    history = any(p.has_device_history for p in mwb.sampling_params)
    outputs: list[list[int]] | None = [] if history else None
    start = 0
    for p, k, prompt, output in zip(
        mwb.sampling_params, lens, mwb.prompt_ids, mwb.output_ids, strict=True
    ):
        starts.append(start)
        for j in range(k + 1):
            params.append(p)
            prompts.append(prompt)
            steps.append(len(output) + j)
            if outputs is not None:
                outputs.append(output + mwb.input_ids[start + 1 : start + 1 + j])
        start += k + 1
    info = SamplingBatchInfo.from_params(
        params,
        runner.model_config.vocab_size,
        runner.device,
        output_ids=outputs,
        input_ids=prompts if history else None,
        step_positions=steps,
        eos_token_ids=runner.model_config.eos_token_ids,
    )
    mask = mwb.vocab_mask
    if mask is not None:  # grammar rows have no drafts: a request's row is its first position
        rows = torch.tensor(starts, dtype=torch.int64)[mask[0].cpu().long()]
        mask = (rows, mask[1])
    return info.with_vocab_mask(mask, runner.device)
