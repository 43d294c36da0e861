"""The scheduler's side of speculative decoding: drafts, and the verify step's memory.

A decode step with drafts (a verify step) runs each request's last token and its k drafts
as one extend of 1 + k tokens on top of its KV ([last, d1..dk] at positions kv..kv+k), with
logits at every position. The model runner samples a token at each position
(engine/speculative/verify.py); the drafts up to the first one that differs from the token
sampled before it are accepted, and that token follows them. So a step yields 1..k+1 tokens
per request, and the KV of the rejected drafts is given back (`trim_kv`).

With draft trees (tree.py) the drafts are a tree's nodes, each at its depth's position and
masked to its ancestors; the accepted path's K/V is moved into place before the trim.

Requests get no drafts when they have a grammar (its mask is known one token at a time), or
no room for more than one token (max_new_tokens, the context). Without the memory for every
request's drafts, the step decodes one token each, as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.speculative import EAGLE_ALGORITHMS
from engine.speculative.ngram import propose_ngram, propose_ngram_tree

if TYPE_CHECKING:
    from engine.config import EngineArgs
    from engine.scheduler.pools import MemoryPools
    from engine.scheduler.req import Req
    from engine.scheduler.schedule_batch import ScheduleBatch


@dataclass
class SpecStats:
    """Counts over the server's life: requests of verify steps that had drafts (vLLM's
    num_drafts), drafts proposed and accepted; see `accept_length`."""

    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    memory_skips: int = 0  # steps whose drafts did not fit in the KV pool
    # drafts accepted at each position j (the (j + 1)-th draft of a step; vLLM's
    # num_accepted_tokens_per_pos), as long as the longest draft run seen
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def accept_length(self) -> float:
        """Tokens per request and verify step (1 + accepted drafts, on average)."""
        return 1.0 + self.accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Drafter:
    """What the scheduler asks of a drafter: `prepare` a decode batch as a verify step (or
    not), `count` what a verify step accepted, `forget` a request that finished. Subclasses
    `propose` each request's drafts."""

    def __init__(self, args: EngineArgs, context_len: int) -> None:
        self.k = args.speculative_num_draft_tokens
        self.context_len = context_len
        self.stats = SpecStats()
        # drafts as trees: each request's parent of every draft, set by `propose` (None:
        # chains; engine/speculative/tree.py)
        self.last_parents: list[list[int]] | None = None

    def room(self, r: Req) -> int:
        """How many drafts request `r` may get this step (0: none)."""
        if r.grammar is not None or r.to_abort is not None:
            return 0
        return max(0, min(self.k, r.remaining_new_tokens() - 1, self.context_len - r.seqlen - 1))

    def tree_nodes(self, r: Req) -> int:
        """The nodes a draft tree of `r` may have: its verify step's positions must fit in
        the context."""
        return max(0, min(self.k, self.context_len - r.seqlen - 1))

    def propose(self, reqs: list[Req]) -> list[list[int]]:
        """Each request's drafts (maybe none)."""
        raise NotImplementedError

    def prepare(self, batch: ScheduleBatch) -> bool:
        """Set `batch` up as a verify step if some request has drafts and the memory for all
        of them can be had; whether it did (else it is for a plain decode step)."""
        self.last_parents = None
        drafts = self.propose(batch.reqs)
        if not any(drafts):
            return False
        if not batch.pools.make_room(verify_tokens_needed(batch, drafts)):
            self.stats.memory_skips += 1
            return False
        batch.prepare_for_decode(drafts=drafts, parents=self.last_parents)
        return True

    def count(self, num_drafts: list[int], accepted: list[int]) -> None:
        s = self.stats
        for n, a in zip(num_drafts, accepted, strict=True):
            if n:
                s.num_drafts += 1
                s.draft_tokens += n
                s.accepted_tokens += a
                if len(s.accepted_per_pos) < n:
                    s.accepted_per_pos.extend([0] * (n - len(s.accepted_per_pos)))
                for j in range(a):
                    s.accepted_per_pos[j] += 1

    def forget(self, req: Req) -> None:
        """`req` finished: drop what the drafter keeps for it."""

    def close(self) -> None:
        """The engine shuts down."""

    def release_memory_occupation(self, tags: tuple[str, ...], backup_weights: bool) -> int:
        """The scheduler gives back the memory of `tags` (no request holds K/V); the bytes
        this drafter frees with it."""
        return 0

    def resume_memory_occupation(self, tags: tuple[str, ...]) -> int:
        return 0


class NgramDrafter(Drafter):
    def __init__(self, args: EngineArgs, context_len: int) -> None:
        super().__init__(args, context_len)
        self.min_n = args.speculative_ngram_min_match_window_size
        self.max_n = args.speculative_ngram_max_match_window_size
        self.topk = args.speculative_eagle_topk  # (> 1: trees of that many matches)
        self.steps = args.speculative_num_steps or self.k

    def propose(self, reqs: list[Req]) -> list[list[int]]:
        drafts = []
        trees: list[list[int]] = []
        for r in reqs:
            room = self.room(r)
            if not room:
                drafts.append([])
                trees.append([])
            elif self.topk > 1:  # (room: the depth; the context bounds the nodes)
                d, p = propose_ngram_tree(token_array(r), self.tree_nodes(r),
                                          min(room, self.steps), self.topk, self.min_n,
                                          self.max_n)  # fmt: skip
                drafts.append(d)
                trees.append(p)
            else:
                drafts.append(propose_ngram(token_array(r), room, self.min_n, self.max_n))
        if self.topk > 1:
            self.last_parents = trees
        return drafts


def make_drafter(args: EngineArgs, runner: Any, context_len: int) -> Drafter | None:
    """The drafter `args.speculative_algorithm` names (None without speculation)."""
    if args.speculative_algorithm is None:
        return None
    if args.speculative_eagle_topk > 1:
        check_tree_support(runner)
    if args.speculative_algorithm in EAGLE_ALGORITHMS:
        from engine.speculative.eagle import EagleDrafter

        return EagleDrafter(args, runner, context_len)
    if args.speculative_algorithm == "standalone":
        from engine.speculative.draft_model import DraftModelDrafter

        return DraftModelDrafter(args, runner, context_len)
    return NgramDrafter(args, context_len)


def check_tree_support(runner: Any) -> None:
    """ValueError where a verify step cannot mask draft trees: an attention backend without
    tree masks (flashinfer here). (In sliding-window layers the backends with tree masks
    compare the nodes' positions, the prefix length plus their depth.)"""
    backend = runner.attn_backend
    if not getattr(backend, "supports_tree_mask", False):
        raise ValueError(
            f"draft trees (speculative_eagle_topk > 1): the {type(backend).__name__} attention "
            "backend has no tree masks; use attention_backend 'triton' or 'torch_native', or "
            "topk 1"
        )


def token_array(req: Req) -> np.ndarray:
    """The request's tokens (prompt + output) as an int64 array, kept on the request and
    extended by the new output tokens only (a long prompt is not converted every step)."""
    buf, n = req.spec_tokens
    total = req.seqlen
    if buf is None or len(buf) < total:
        grown = np.empty(max(2 * total, 64), dtype=np.int64)
        if buf is not None:
            grown[:n] = buf[:n]
        buf = grown
    if n == 0:
        buf[: req.prompt_len] = req.origin_input_ids
        n = req.prompt_len
    if total > n:
        buf[n:total] = req.output_ids[n - req.prompt_len :]
    req.spec_tokens = (buf, total)
    return buf[:total]


def verify_tokens_needed(batch: ScheduleBatch, drafts: list[list[int]]) -> int:
    """KV slots (whole pages) the verify step must allocate."""
    a = batch.pools.allocator
    pages = sum(
        a.num_pages_needed(r.kv_allocated_len, r.kv_allocated_len + 1 + len(d))
        for r, d in zip(batch.reqs, drafts, strict=True)
    )
    return pages * batch.pools.page_size


def trim_kv(pools: MemoryPools, req: Req, length: int) -> tuple[torch.Tensor, int] | None:
    """Keep the request's KV for its first `length` positions; returns the slots of the
    whole pages after the page of position length - 1, for the caller to free (the rest of
    that page stays the request's, and its next tokens fill it), with the offset in that run
    from which its pages hold window KV (hybrid sliding-window memory: the request's
    `swa_released` account, as `free_own` reads it; 0, all of them, as drafts are recent)."""
    held = req.kv_allocated_len
    if length >= held:
        return None
    req.kv_allocated_len = length
    ps = pools.page_size
    first_free = -(-length // ps) * ps
    if first_free >= held:
        return None
    live_from = min(held, max(first_free, getattr(req, "swa_released", 0))) - first_free
    return pools.req_to_token_pool.req_to_token[req.req_pool_idx, first_free:held], live_from
