"""Reference paged attention in plain torch (the CPU backend), batched over requests.

Once per batch, `init_forward_metadata` turns the paged layout into padded index tensors:

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
adds `key > p - W` to the mask (`_Metadata.window_mask`, made at the first such layer of the
batch and shared by the others). It still gathers every key: the window only masks.

A soft-capped layer (`layer.logit_cap` c, Gemma 2) cannot use SDPA, which has no hook between
the scores and the softmax: it computes the scores, caps them to c * tanh(s / c), masks, and
takes the softmax in float32 (as transformers' eager attention does; float64 models in
float64).

Each layer then does one scatter of the new K/V into the pool, one gather of K and of V, and
one `scaled_dot_product_attention`. GQA decode folds the query heads of a group into the
query-length axis ([B, kv_heads, group, D]) instead of repeating K/V, which is much faster on
CPU; extend repeats K/V per group.

Mixed batches (`--enable-mixed-chunk`: running requests' decode steps as one-token extends
beside prompts) are planned in two parts, attended apart: the one-token requests as a decode
batch, the others as an extend batch. Padded together, every decode row would be padded to the
longest prompt's query length (a 256-token chunk beside 64 decode rows: 64x the work).

No CUDA graphs (`supports_cuda_graph` stays False): the gather width and the mask are sized by
the batch's longest sequence, a host value, so every decode step has new shapes. A capturable
variant would have to gather every request's whole context (`max_context_len` keys per row and
layer), far slower than the eager one it replaces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.attention.base import AttentionBackend, AttentionLayer
from engine.attention.torch_ops import sdpa, subset_batch
from engine.forward_batch import ForwardBatch


@dataclass
class _Metadata:
    kv_index: torch.Tensor  # [B * max_seq_len] int64, flattened for index_select
    max_seq_len: int
    mask: torch.Tensor | None  # [B, 1, Q, max_seq_len] bool; None when nothing is masked
    max_q_len: int
    q_index: torch.Tensor | None = None  # [B * Q] int64 (EXTEND)
    causal: bool = False  # EXTEND with no cached prefix: SDPA's own causal mask, no `mask`
    out_index: torch.Tensor | None = None  # [num_tokens] int64 (EXTEND)
    decode: bool = True  # one query per request at its last position (the decode layout)
    batch_size: int = 0
    # what a sliding-window mask is made of, at the first layer that needs it (`window_mask`)
    q_pos: torch.Tensor | None = None  # [B, Q] int64: each query's position (padded rows too)
    key_valid: torch.Tensor | None = None  # [B, L] bool
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: int) -> torch.Tensor:
        """[B, 1, Q, L]: the causal mask of a layer that attends over the last `window` keys
        (key j hidden from the query at position p when j <= p - window), made once per batch
        and window. Padded query rows (whose outputs are dropped) see every key, so that no
        row is fully masked."""
        if window not in self.window_masks:
            assert self.q_pos is not None and self.key_valid is not None
            key_pos = torch.arange(self.max_seq_len, device=self.q_pos.device)
            q_pos = self.q_pos[:, :, None]
            visible = (key_pos > q_pos - window) & (key_pos <= q_pos)
            q_real = q_pos < self.key_valid.sum(1)[:, None, None]  # [B, Q, 1]
            visible = (visible | ~q_real) & self.key_valid[:, None, :]
            self.window_masks[window] = visible.unsqueeze(1)
        return self.window_masks[window]


@dataclass
class _Part:
    """Requests of a mixed batch attended together: their plan, and their rows of the batch's
    packed tokens."""

    md: _Metadata
    token_index: torch.Tensor  # [part tokens] int64


@dataclass
class _Mixed:
    parts: list[_Part]


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, device: str | torch.device = "cpu", **kwargs: object) -> None:
        self.device = torch.device(device)
        self.metadata: _Metadata | None = None
        self._workspace: list[torch.Tensor | None] = [None, None]  # gathered K, gathered V

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if fb.batch_size == 0:
            self.metadata = None
            return
        if fb.forward_mode.is_decode():
            self.metadata = self._plan(fb, decode=True)
            return
        assert fb.extend_seq_lens_cpu is not None
        ones = [i for i, n in enumerate(fb.extend_seq_lens_cpu) if n == 1]
        if len(ones) == fb.batch_size:  # one new token each: the decode layout
            self.metadata = self._plan(fb, decode=True)
        elif ones:
            rest = [i for i, n in enumerate(fb.extend_seq_lens_cpu) if n != 1]
            (one, one_index), (many, many_index) = subset_batch(fb, ones), subset_batch(fb, rest)
            self.metadata = _Mixed(
                [
                    _Part(self._plan(one, decode=True), one_index),
                    _Part(self._plan(many, decode=False), many_index),
                ]
            )
        else:
            self.metadata = self._plan(fb, decode=False)

    def _plan(self, fb: Any, decode: bool) -> _Metadata:
        """`fb`: the batch, or the part of a mixed batch (`subset_batch`)."""
        device = fb.seq_lens.device
        max_seq_len = max(fb.seq_lens_cpu)
        key_pos = torch.arange(max_seq_len, device=device)
        key_valid = key_pos[None, :] < fb.seq_lens[:, None]  # [B, L]
        kv_index = fb.req_to_token[fb.req_pool_indices, :max_seq_len].to(torch.int64)
        kv_index = kv_index.masked_fill(~key_valid, 0).reshape(-1)
        if decode:
            all_full = min(fb.seq_lens_cpu) == max_seq_len
            mask = None if all_full else key_valid[:, None, None, :]
            return _Metadata(
                kv_index,
                max_seq_len,
                mask,
                1,
                batch_size=fb.batch_size,
                q_pos=(fb.seq_lens - 1).to(torch.int64)[:, None],
                key_valid=key_valid,
            )
        return self._extend_metadata(fb, kv_index, key_pos, key_valid)

    @staticmethod
    def _extend_metadata(
        fb: Any, kv_index: torch.Tensor, key_pos: torch.Tensor, key_valid: torch.Tensor
    ) -> _Metadata:
        assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
        assert fb.extend_start_loc is not None
        device = key_pos.device
        ext_lens = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64, device=device)
        prefix_lens = torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64, device=device)
        max_q_len = max(fb.extend_seq_lens_cpu)
        t = torch.arange(max_q_len, device=device)
        q_pos = prefix_lens[:, None] + t[None, :]  # [B, Q]
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & key_valid[:, None, :]
        q_valid = t[None, :] < ext_lens[:, None]
        q_index = (fb.extend_start_loc[:, None] + t[None, :]).masked_fill(~q_valid, 0)
        flat_rows = torch.arange(q_valid.numel(), device=device).view_as(q_valid)
        out_index = torch.empty(fb.num_tokens, dtype=torch.int64, device=device)
        out_index[q_index[q_valid]] = flat_rows[q_valid]
        if max(fb.extend_prefix_lens_cpu) == 0:
            # Queries and keys are the same right-padded tokens: the top-left causal mask hides
            # every padded key from every real query (padded query rows are dropped), and SDPA
            # can then use its fused kernel instead of materialising a [B, 1, Q, L] mask.
            return _Metadata(
                kv_index=kv_index,
                max_seq_len=int(key_pos.shape[0]),
                mask=None,
                max_q_len=max_q_len,
                q_index=q_index.reshape(-1),
                out_index=out_index,
                causal=True,
                decode=False,
                batch_size=fb.batch_size,
                q_pos=q_pos,
                key_valid=key_valid,
            )
        return _Metadata(
            kv_index=kv_index,
            max_seq_len=int(key_pos.shape[0]),
            mask=mask.unsqueeze(1),
            max_q_len=max_q_len,
            q_index=q_index.reshape(-1),
            out_index=out_index,
            decode=False,
            batch_size=fb.batch_size,
            q_pos=q_pos,
            key_valid=key_valid,
        )

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        md: _Metadata | _Mixed,
    ) -> torch.Tensor:
        if isinstance(md, _Metadata):
            return self._attend_planned(q, layer, forward_batch, md)
        out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)
        for part in md.parts:
            part_q = q.index_select(0, part.token_index)
            out[part.token_index] = self._attend_planned(part_q, layer, forward_batch, part.md)
        return out

    def _attend_planned(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch, md: _Metadata
    ) -> torch.Tensor:
        k_buf, v_buf = forward_batch.kv_pool.get_kv_buffer(layer.layer_id)
        batch_size = md.batch_size
        kv_shape = (batch_size, md.max_seq_len, layer.num_kv_heads, layer.head_dim)
        keys = self._gather(k_buf, md.kv_index, 0).view(kv_shape).transpose(1, 2)
        values = self._gather(v_buf, md.kv_index, 1).view(kv_shape).transpose(1, 2)
        mask, causal = md.mask, md.causal
        window = getattr(layer, "sliding_window", None)
        if window is not None and md.max_seq_len > window:
            mask, causal = md.window_mask(window), False
        if md.decode:
            return self._decode(q, keys, values, layer, batch_size, mask)
        return self._extend(q, keys, values, layer, md, mask, causal)

    def _gather(self, buf: torch.Tensor, index: torch.Tensor, slot: int) -> torch.Tensor:
        """`buf[index]` into a workspace kept across layers and batches.

        A fresh multi-megabyte tensor per layer would be freshly mapped memory each time
        (page faults cost several times the copy on CPU); every layer of a batch has the same
        gathered size, and each layer is done with it before the next one gathers.
        """
        shape = (index.shape[0], *buf.shape[1:])
        numel = shape[0] * buf[0].numel()
        ws = self._workspace[slot]
        if ws is None or ws.numel() < numel or ws.dtype != buf.dtype or ws.device != buf.device:
            ws = torch.empty(numel, dtype=buf.dtype, device=buf.device)
            self._workspace[slot] = ws
        return torch.index_select(buf, 0, index, out=ws[:numel].view(shape))

    @staticmethod
    def _decode(
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        layer: AttentionLayer,
        batch_size: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """keys/values [B, kv_heads, L, D]; query heads of one KV group become query rows."""
        group = layer.num_heads // layer.num_kv_heads
        q = q.reshape(batch_size, layer.num_kv_heads, group, layer.head_dim)
        out = sdpa(q, keys, values, mask, False, layer)
        return out.reshape(batch_size, layer.num_heads * layer.head_dim)

    @staticmethod
    def _extend(
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        layer: AttentionLayer,
        md: _Metadata,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        batch_size = md.batch_size
        assert md.q_index is not None and md.out_index is not None
        q = q.reshape(-1, layer.num_heads, layer.head_dim).index_select(0, md.q_index)
        q = q.view(batch_size, md.max_q_len, layer.num_heads, layer.head_dim).transpose(1, 2)
        group = layer.num_heads // layer.num_kv_heads
        if group > 1:
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        out = sdpa(q, keys, values, mask, causal, layer)
        out = out.transpose(1, 2).reshape(batch_size * md.max_q_len, -1)
        return out.index_select(0, md.out_index)
