"""Pure-torch references of the Triton kernels, written for clarity, not speed.

Shared conventions (see engine/mem_cache/kv_pool.py and engine/forward_batch.py):

* `k_buffer`, `v_buffer` [num_slots, num_kv_heads, head_dim]: the paged pool of one layer;
* `req_to_token` [rows, max_context_len] int32: `req_to_token[req_pool_indices[i], j]` is the
  slot of token j of request i (page size only changes which slots those are);
* GQA: query head h reads KV head `h // (num_heads // num_kv_heads)`;
* softmax is computed in float32; outputs are in q's dtype.
"""

from __future__ import annotations

import torch


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal_from: int,
    window_left: int = -1,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    own_mask: torch.Tensor | None = None,
):
    """q [M, Hq, D], k/v [L, Hk, D] -> [M, Hq, D]; query m (at position causal_from + m) sees
    keys j <= causal_from + m, and (window_left >= 0) j >= causal_from + m - window_left;
    `own_mask` [M, M] bool (a draft tree's ancestor mask): query m sees key causal_from + n
    only where own_mask[m, n], and new tokens sit at causal_from + their depth (their
    ancestors' count), which the window compares.
    logit_cap > 0: scores s are soft-capped to logit_cap * tanh(s / logit_cap) first.
    sinks [Hq]: one more logit per head in the softmax, whose weight goes to no value."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q.float(), k) * scale
    if logit_cap > 0:
        scores = torch.tanh(scores / logit_cap) * logit_cap
    m = torch.arange(q.shape[0], device=q.device)[:, None]
    j = torch.arange(k.shape[0], device=q.device)[None, :]
    hidden = j > causal_from + m
    q_pos, k_pos = causal_from + m, j
    if own_mask is not None:  # (positions by depth: row n of an ancestor mask has n's path)
        depth = own_mask.to(q.device).sum(1) - 1
        q_pos = causal_from + depth[:, None]
        k_pos = torch.where(j >= causal_from, causal_from + depth[(j - causal_from).clamp(
            0, q.shape[0] - 1)], j)
    if window_left >= 0:
        hidden |= k_pos < q_pos - window_left
    if own_mask is not None:
        own = j >= causal_from
        seen = own_mask.to(q.device)[m, (j - causal_from).clamp(0, q.shape[0] - 1)]
        hidden |= own & ~seen
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        return torch.einsum("hml,lhd->mhd", scores.softmax(-1), v).to(q.dtype)
    column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
    probs = torch.cat((scores, column), -1).softmax(-1)[..., :-1]
    return torch.einsum("hml,lhd->mhd", probs, v).to(q.dtype)


def decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window_left: int = -1,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (the last token of each request) -> [B, Hq, D] over all seq_lens[i] keys
    (the last window_left + 1 of them when window_left >= 0; scores soft-capped when
    logit_cap > 0; `sinks` as `_attend`'s)."""
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        n = int(seq_lens[i])
        slots = req_to_token[req_pool_indices[i], :n].long()
        keys, values = k_buffer[slots], v_buffer[slots]
        out[i] = _attend(q[i : i + 1], keys, values, scale, n - 1, window_left, logit_cap,
                         sinks)[0]  # fmt: skip
    return out


def extend_attention_ref(
    q: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    scale: float,
    window_left: int = -1,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    tree_masks: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Packed new tokens: request i owns rows extend_start_loc[i] .. + extend_lens[i] of
    q [N, Hq, D] and k_extend/v_extend [N, Hk, D]. Each new token sees the request's
    prefix_lens[i] cached tokens (slots from req_to_token) and the new tokens up to itself;
    with window_left >= 0, only the last window_left + 1 of those (scores soft-capped when
    logit_cap > 0); with `tree_masks` (a draft tree's, per request [n, n] bool), only the
    new tokens its row of the request's mask names."""
    out = torch.zeros_like(q)
    for i in range(len(extend_lens)):
        start, n, p = int(extend_start_loc[i]), int(extend_lens[i]), int(prefix_lens[i])
        slots = req_to_token[req_pool_indices[i], :p].long()
        keys = torch.cat([k_buffer[slots], k_extend[start : start + n].to(k_buffer.dtype)])
        values = torch.cat([v_buffer[slots], v_extend[start : start + n].to(v_buffer.dtype)])
        own = None if tree_masks is None else tree_masks[i]
        out[start : start + n] = _attend(
            q[start : start + n], keys, values, scale, p, window_left, logit_cap, sinks, own
        )
    return out


def store_kv_ref(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """`k_buffer[loc] = k`, `v_buffer[loc] = v` (k/v [N, H, D] or [N, H * D])."""
    _, num_heads, head_dim = k_buffer.shape
    k_buffer[loc] = as_heads(k, num_heads, head_dim).to(k_buffer.dtype)
    v_buffer[loc] = as_heads(v, num_heads, head_dim).to(v_buffer.dtype)


def as_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """[N, H * D] or [N, H, D] -> a [N, H, D] view (copied only if the last axis is strided)."""
    x = x.reshape(-1, num_heads, head_dim) if x.dim() == 2 else x
    return x if x.stride(-1) == 1 else x.contiguous()
