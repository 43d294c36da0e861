"""The torch operations of the torch_native attention backend (engine/attention/
torch_native.py) that are not about planning: attention over padded batches, soft-capped or
not, and the split of a mixed batch into its parts."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionLayer, logit_cap
from engine.forward_batch import ForwardBatch


def sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    layer: AttentionLayer,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    kv_group: int = 1,
) -> torch.Tensor:
    """`scaled_dot_product_attention` at `scale` (default: the layer's), its scores soft-capped
    if the layer says so. q [..., Q, D], keys/values [..., L, D]; `mask` bool, broadcast to
    [..., Q, L]; `causal`: the top-left causal mask instead (Q == L). `sinks` (the layer's,
    shaped to broadcast to the scores' [..., Q, 1]): one more logit in each softmax, whose
    weight goes to no value (gpt-oss's attention sinks). `kv_group` > 1: q [B, H, Q, D] over
    keys/values [B, H / kv_group, L, D], query head h reading KV head h // kv_group (read in
    place by SDPA's GQA: on the CPU 9x faster than repeating them for an MLA layer's 16
    heads over one latent)."""
    cap = logit_cap(layer)
    scale = layer.scaling if scale is None else scale
    if not cap and sinks is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=kv_group > 1,
        )  # fmt: skip
    if kv_group > 1:
        keys = keys.repeat_interleave(kv_group, dim=1)
        values = values.repeat_interleave(kv_group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if cap:
        scores = torch.tanh(scores / cap) * cap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    dtype = torch.promote_types(q.dtype, torch.float32)
    if sinks is not None:
        column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.cat((scores, column), dim=-1).softmax(-1, dtype=dtype)[..., :-1]
    else:
        probs = scores.softmax(-1, dtype=dtype)
    return torch.matmul(probs.to(q.dtype), values)


def subset_batch(fb: ForwardBatch, rows: list[int]) -> tuple[SimpleNamespace, torch.Tensor]:
    """The requests `rows` of an EXTEND batch as a batch of their own (what planning reads),
    and their rows of the batch's packed tokens."""
    assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
    assert fb.extend_start_loc is not None
    device = fb.seq_lens.device
    idx = torch.tensor(rows, dtype=torch.int64, device=device)
    lens = [fb.extend_seq_lens_cpu[i] for i in rows]
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    start_loc = torch.cumsum(lens_t, 0) - lens_t  # in the part's own packing
    offset = fb.extend_start_loc.index_select(0, idx) - start_loc
    token_index = torch.repeat_interleave(offset, lens_t) + torch.arange(sum(lens), device=device)
    sub = SimpleNamespace(
        batch_size=len(rows),
        num_tokens=sum(lens),
        seq_lens=fb.seq_lens.index_select(0, idx),
        seq_lens_cpu=[fb.seq_lens_cpu[i] for i in rows],
        req_to_token=fb.req_to_token,
        req_pool_indices=fb.req_pool_indices.index_select(0, idx),
        extend_seq_lens_cpu=lens,
        extend_prefix_lens_cpu=[fb.extend_prefix_lens_cpu[i] for i in rows],
        extend_start_loc=start_loc,
        spec_parents=None if fb.spec_parents is None else [fb.spec_parents[i] for i in rows],
    )
    return sub, token_index
