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

With draft trees (engine/speculative/tree.py) a node is sampled as the request's token after
the node's path, and the step follows the child whose draft equals the token sampled at the
current node; children have distinct drafts, so the same argument holds. The accepted nodes'
K/V is then moved to the positions of their path (`move_kv`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.sampling.sampler import TopLogprobs
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.speculative.tree import accept_path, node_paths, path_moves

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
    trees = mwb.spec_parents
    moves: list[tuple[int, int]] = []  # (from, to) packed rows of accepted tree nodes' K/V
    start = 0
    for i, k in enumerate(lens):
        drafts = mwb.input_ids[start + 1 : start + 1 + k]
        if trees is None:
            t = sampled[start : start + k + 1]
            a = 0
            while a < k and drafts[a] == t[a]:
                a += 1
            rows = list(range(start, start + a + 1))
        else:
            path = accept_path(sampled[start : start + k + 1], drafts, trees[i])
            a = len(path)
            rows = [start + j for j in (0, *path)]
            moves.extend((start + src, start + dst) for src, dst in path_moves(path))
        tokens.append([sampled[r] for r in rows])
        accepted.append(a)
        if logprobs is not None:
            logprobs.append([chosen[r] for r in rows])
        if top is not None:
            top.append([out.top_logprobs[r] for r in rows])
        start += k + 1
    if moves:
        move_kv(runner, fb.out_cache_loc, moves)
    return VerifyResult(tokens, list(lens), accepted, logprobs, top)


def move_kv(runner: ModelRunner, slots: torch.Tensor, moves: list[tuple[int, int]]) -> None:
    """Copy the K/V (and the hidden states kept for an EAGLE head) of the packed verify rows
    `from` to the slots of rows `to`: accepted tree nodes to their path's positions. Every
    source is read before any destination is written, so a slot may be both. With tensor
    parallelism the followers copy theirs before the next forward."""
    index = torch.tensor(moves, dtype=torch.int64).to(slots.device)
    src, dst = slots[index[:, 0]], slots[index[:, 1]]
    runner.kv_pool.copy_slots(src, dst, getattr(runner.allocator, "full_to_swa", None))
    capture = getattr(runner, "hidden_capture", None)  # (rank 0's alone, with TP)
    if capture is not None:
        capture.buffer[dst] = capture.buffer[src]
    if runner.tp_link is not None:  # the other ranks' pools: before their next forward
        runner.tp_link.queue_kv_moves(src.tolist(), dst.tolist())


def position_sampling_info(runner: ModelRunner, mwb: ModelWorkerBatch) -> SamplingBatchInfo:
    """The sampling info of every position of a verify batch (see the module's docstring;
    a tree's node is sampled as the request's token after the node's path)."""
    lens = mwb.spec_draft_lens
    assert lens is not None
    trees = mwb.spec_parents
    params, prompts, steps, starts = [], [], [], []
    history = any(p.has_device_history for p in mwb.sampling_params)
    outputs: list[list[int]] | None = [] if history else None
    start = 0
    for i, (p, k, prompt, output) in enumerate(
        zip(mwb.sampling_params, lens, mwb.prompt_ids, mwb.output_ids, strict=True)
    ):
        starts.append(start)
        drafts = mwb.input_ids[start + 1 : start + 1 + k]
        paths = node_paths(trees[i]) if trees is not None else [range(1, j + 1)
                                                                  for j in range(k + 1)]
        for path in paths:
            params.append(p)
            prompts.append(prompt)
            steps.append(len(output) + len(path))
            if outputs is not None:
                outputs.append(output + [drafts[j - 1] for j in path])
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
