"""How the torch_native backend (engine/attention/torch_native.py) plans a batch: once per
batch, `plan_batch` turns the paged layout into padded index tensors.

* `kv_index` [B, max_seq_len]: the KV slot of key j of request i
  (`req_to_token[req_pool_indices[i], j]`), 0 past `seq_lens[i]` (slot 0 is the padding slot);
* `mask` [B, 1, Q, max_seq_len] bool: key j is visible to the query at position p of request i
  iff `j < seq_lens[i]` and `j <= p`. Decode has Q = 1 and p = seq_lens[i] - 1. For EXTEND,
  query t of request i sits at p = prefix_lens[i] + t; padded query rows (t >= extend_lens[i])
  get p >= seq_lens[i], so they see all of request i's keys: no row is ever fully masked and
  softmax never yields NaN (their outputs are dropped anyway);
* EXTEND only: `q_index` [B, Q] packed token of (request i, query t) (0 for padding) and
  `out_index` [num_tokens] the flat padded row of each packed token.

A sliding-window layer (`layer.sliding_window` W, shorter than the batch's longest sequence)
gathers only the keys some query of its request can see: request i's keys from
max(0, first query position - W + 1) on, so a decode step reads at most W keys per request
however long the context, and an extend at most its new tokens + W - 1. The mask adds
`key > p - W` (`Plan.window_view`: made at the first such layer of the batch, shared by
the others with the same window). Where the window would not shorten the gather (an extend
whose chunk is as long as the longest sequence), the full gather is masked instead.

Mixed batches (`--enable-mixed-chunk`: running requests' decode steps as one-token extends
beside prompts) are planned in two parts, attended apart: the one-token requests as a decode
batch, the others as an extend batch. Padded together, every decode row would be padded to the
longest prompt's query length (a 256-token chunk beside 64 decode rows: 64x the work).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.attention.torch_ops import subset_batch
from engine.forward_batch import ForwardBatch
from engine.speculative.tree import ancestor_mask, depths


@dataclass
class Keys:
    """The keys one layer gathers: `index` [B * length] their KV slots (0 for padding), and
    `mask` [B, 1, Q, length] bool (None: every key is visible to every query)."""

    index: torch.Tensor
    length: int
    mask: torch.Tensor | None


@dataclass
class Plan:
    kv_index: torch.Tensor  # [B * max_seq_len] int64, flattened for index_select
    max_seq_len: int
    mask: torch.Tensor | None  # [B, 1, Q, max_seq_len] bool; None when nothing is masked
    max_q_len: int
    q_index: torch.Tensor | None = None  # [B * Q] int64 (EXTEND)
    causal: bool = False  # EXTEND with no cached prefix: SDPA's own causal mask, no `mask`
    out_index: torch.Tensor | None = None  # [num_tokens] int64 (EXTEND)
    decode: bool = True  # one query per request at its last position (the decode layout)
    batch_size: int = 0
    # what a sliding-window layer's keys are made of, at the first layer that needs them
    q_pos: torch.Tensor | None = None  # [B, Q] int64: each query's position (padded rows too)
    key_valid: torch.Tensor | None = None  # [B, L] bool
    rows: torch.Tensor | None = None  # [B, max_seq_len] int64: the requests' page-table rows
    first_q_pos: list[int] = field(default_factory=list)  # host: each request's first query
    # draft trees: [B, L] int64 each key's position (a node's: the prefix length plus its
    # depth; `q_pos` likewise), which a window compares; `mask` then holds the trees
    key_pos: torch.Tensor | None = None
    seq_lens: list[int] = field(default_factory=list)  # host
    windows: dict[int, Keys] = field(default_factory=dict)

    def window_view(self, window: int, narrow: bool = True) -> Keys:
        """The keys of a layer that attends over the last `window` keys (key j hidden from
        the query at position p when j <= p - window), made once per batch and window.

        Request i's keys start at max(0, first query position - window + 1), the first any
        of its queries sees; the gather is as wide as the widest request's span (at most
        `window` for decode). Padded query rows (whose outputs are dropped) see every key
        gathered for their request, so that no row is fully masked. `narrow=False`: the whole
        context gathered and masked (what this backend did before; benchmarks compare)."""
        if window not in self.windows and self.key_pos is not None:
            self.windows[window] = self._tree_window(window)
        if window not in self.windows:
            assert self.q_pos is not None and self.key_valid is not None
            assert self.rows is not None
            starts = [max(0, p - window + 1) for p in self.first_q_pos]
            length = max(n - s for n, s in zip(self.seq_lens, starts, strict=True))
            device = self.q_pos.device
            if narrow and length < self.max_seq_len:
                start = torch.tensor(starts, dtype=torch.int64, device=device)
                key_pos = start[:, None] + torch.arange(length, device=device)  # [B, length]
                valid = key_pos < torch.tensor(self.seq_lens, device=device)[:, None]
                index = self.rows.gather(1, key_pos.clamp(max=self.max_seq_len - 1))
                index = index.masked_fill(~valid, 0).reshape(-1)
            else:
                key_pos = torch.arange(self.max_seq_len, device=device)[None, :]
                valid, index = self.key_valid, self.kv_index
            q_pos = self.q_pos[:, :, None]
            key_pos = key_pos[:, None, :]
            visible = (key_pos > q_pos - window) & (key_pos <= q_pos)
            q_real = q_pos < self.key_valid.sum(1)[:, None, None]  # [B, Q, 1]
            visible = (visible | ~q_real) & valid[:, None, :]
            mask = None if bool(visible.all()) else visible.unsqueeze(1)
            self.windows[window] = Keys(index, int(valid.shape[1]), mask)
        return self.windows[window]


    def _tree_window(self, window: int) -> Keys:
        """A verify step of draft trees in a sliding-window layer: every key gathered, the
        trees' mask narrowed to the keys within `window` positions (by depth) of the query.
        Padded query rows see every key, as in the trees' mask."""
        assert self.q_pos is not None and self.key_valid is not None and self.mask is not None
        q_pos = self.q_pos[:, :, None]
        inside = self.key_pos[:, None, :] > q_pos - window  # type: ignore[index]
        q_real = q_pos < self.key_valid.sum(1)[:, None, None]
        visible = self.mask & (inside | ~q_real).unsqueeze(1)
        return Keys(self.kv_index, self.max_seq_len, visible)


@dataclass
class PlanPart:
    """Requests of a mixed batch attended together: their plan, and their rows of the batch's
    packed tokens."""

    md: Plan
    token_index: torch.Tensor  # [part tokens] int64


@dataclass
class MixedPlan:
    parts: list[PlanPart]


def plan_batch(fb: ForwardBatch) -> Plan | MixedPlan | None:
    """The plan of a batch: decode layout, extend layout, or a mixed batch's two parts."""
    if fb.batch_size == 0:
        return None
    if fb.forward_mode.is_decode():
        return _plan(fb, decode=True)
    assert fb.extend_seq_lens_cpu is not None
    ones = [i for i, n in enumerate(fb.extend_seq_lens_cpu) if n == 1]
    if len(ones) == fb.batch_size:  # one new token each: the decode layout
        return _plan(fb, decode=True)
    if not ones:
        return _plan(fb, decode=False)
    rest = [i for i, n in enumerate(fb.extend_seq_lens_cpu) if n != 1]
    (one, one_index), (many, many_index) = subset_batch(fb, ones), subset_batch(fb, rest)
    return MixedPlan(
        [
            PlanPart(_plan(one, decode=True), one_index),
            PlanPart(_plan(many, decode=False), many_index),
        ]
    )


def _plan(fb: Any, decode: bool) -> Plan:
    """`fb`: the batch, or the part of a mixed batch (`subset_batch`)."""
    device = fb.seq_lens.device
    max_seq_len = max(fb.seq_lens_cpu)
    key_pos = torch.arange(max_seq_len, device=device)
    key_valid = key_pos[None, :] < fb.seq_lens[:, None]  # [B, L]
    rows = fb.req_to_token[fb.req_pool_indices, :max_seq_len].to(torch.int64)
    plan = Plan(
        kv_index=rows.masked_fill(~key_valid, 0).reshape(-1),
        max_seq_len=max_seq_len,
        mask=None if min(fb.seq_lens_cpu) == max_seq_len else key_valid[:, None, None, :],
        max_q_len=1,
        batch_size=fb.batch_size,
        q_pos=(fb.seq_lens - 1).to(torch.int64)[:, None],
        key_valid=key_valid,
        rows=rows,
        first_q_pos=[n - 1 for n in fb.seq_lens_cpu],
        seq_lens=list(fb.seq_lens_cpu),
    )
    if not decode:
        _plan_extend(plan, fb, key_pos)
    return plan


def _plan_extend(plan: Plan, fb: Any, key_pos: torch.Tensor) -> None:
    """Turn a decode-layout plan into the extend layout: each request's queries are its new
    tokens, at positions prefix_len .. seq_len - 1."""
    assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
    assert fb.extend_start_loc is not None and plan.key_valid is not None
    device = key_pos.device
    ext_lens = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64, device=device)
    prefix_lens = torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64, device=device)
    max_q_len = max(fb.extend_seq_lens_cpu)
    t = torch.arange(max_q_len, device=device)
    q_pos = prefix_lens[:, None] + t[None, :]  # [B, Q]
    q_valid = t[None, :] < ext_lens[:, None]
    q_index = (fb.extend_start_loc[:, None] + t[None, :]).masked_fill(~q_valid, 0)
    flat_rows = torch.arange(q_valid.numel(), device=device).view_as(q_valid)
    out_index = torch.empty(fb.num_tokens, dtype=torch.int64, device=device)
    out_index[q_index[q_valid]] = flat_rows[q_valid]
    plan.decode, plan.max_q_len, plan.q_pos = False, max_q_len, q_pos
    plan.q_index, plan.out_index = q_index.reshape(-1), out_index
    plan.first_q_pos = list(fb.extend_prefix_lens_cpu)
    if max(fb.extend_prefix_lens_cpu) == 0:
        # Queries and keys are the same right-padded tokens: the top-left causal mask hides
        # every padded key from every real query (padded query rows are dropped), and SDPA
        # can then use its fused kernel instead of materialising a [B, 1, Q, L] mask.
        plan.mask, plan.causal = None, True
    elif getattr(fb, "spec_parents", None) is not None:
        plan.mask = _tree_mask(fb.spec_parents, prefix_lens, plan.key_valid, max_q_len)
        plan.q_pos, plan.key_pos = _tree_positions(fb.spec_parents, prefix_lens, plan.key_valid,
                                                   max_q_len)  # fmt: skip
    else:
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & plan.key_valid[:, None, :]
        plan.mask = mask.unsqueeze(1)


def _tree_mask(
    parents: list[list[int]], prefix_lens: torch.Tensor, key_valid: torch.Tensor, q_len: int
) -> torch.Tensor:
    """[B, 1, Q, L] bool of a verify step whose drafts are trees: a node sees the request's
    cached keys and its ancestors among the new ones (padded query rows see every key)."""
    device = key_valid.device
    own = np.ones((len(parents), q_len, q_len), dtype=bool)
    for i, ps in enumerate(parents):
        n = len(ps) + 1
        own[i, :n, :n] = ancestor_mask(ps)
    own_t = torch.from_numpy(own).to(device)
    rel = torch.arange(key_valid.shape[1], device=device)[None, :] - prefix_lens[:, None]
    new = (rel >= 0) & key_valid  # [B, L]
    index = rel.clamp(0, q_len - 1)[:, None, :].expand(-1, q_len, -1)
    seen = own_t.gather(2, index)  # [B, Q, L]: column rel of row t of the request's mask
    mask = ((rel < 0) & key_valid)[:, None, :] | (new[:, None, :] & seen)
    return mask.unsqueeze(1)


def _tree_positions(
    parents: list[list[int]], prefix_lens: torch.Tensor, key_valid: torch.Tensor, q_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, Q], [B, L]) int64: each query's and each key's position in a verify step of draft
    trees. Cached key j is at j; node t at the prefix length plus its depth; padded query
    rows at the prefix length plus their row (past the request's keys)."""
    device = key_valid.device
    depth = np.tile(np.arange(q_len, dtype=np.int64), (len(parents), 1))
    for i, ps in enumerate(parents):
        depth[i, : len(ps) + 1] = depths(ps)
    depth_t = torch.from_numpy(depth).to(device)
    q_pos = prefix_lens[:, None] + depth_t
    j = torch.arange(key_valid.shape[1], device=device)[None, :]
    rel = j - prefix_lens[:, None]
    own = prefix_lens[:, None] + depth_t.gather(1, rel.clamp(0, q_len - 1))
    return q_pos, torch.where(rel >= 0, own, j)
