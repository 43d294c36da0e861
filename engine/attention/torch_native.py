"""Reference paged attention in plain torch (the CPU backend), batched over requests.

The batch is planned once (`engine.attention.torch_native_plan`: padded index tensors and
masks, a sliding window's narrower gather, mixed batches in two parts).

Each layer then does one scatter of the new K/V into the pool, one gather of K and of V, and
one `scaled_dot_product_attention`. GQA decode folds the query heads of a group into the
query-length axis ([B, kv_heads, group, D]) instead of repeating K/V, which is much faster on
CPU; extend repeats K/V per group.

A soft-capped layer (`layer.logit_cap` c, Gemma 2) cannot use SDPA, which has no hook between
the scores and the softmax: it computes the scores, caps them to c * tanh(s / c), masks, and
takes the softmax in float32 (as transformers' eager attention does; float64 models in
float64).

No CUDA graphs (`supports_cuda_graph` stays False): the gather width and the mask are sized by
the batch's longest sequence, a host value, so every decode step has new shapes. A capturable
variant would have to gather every request's whole context (`max_context_len` keys per row and
layer), far slower than the eager one it replaces.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionLayer, softmax_scale
from engine.attention.torch_native_plan import MixedPlan, Plan, plan_batch
from engine.attention.torch_ops import sdpa
from engine.forward_batch import ForwardBatch


class TorchNativeAttnBackend(AttentionBackend):
    supports_tree_mask = True

    def __init__(self, device: str | torch.device = "cpu", **kwargs: object) -> None:
        self.device = torch.device(device)
        self.metadata: Plan | MixedPlan | None = None
        # gathered K, gathered V; then (a float8 cache) the same converted to q's dtype
        self._workspace: list[torch.Tensor | None] = [None] * 4

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.metadata = plan_batch(forward_batch)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        md: Plan | MixedPlan,
    ) -> torch.Tensor:
        if isinstance(md, Plan):
            return self._attend_planned(q, layer, forward_batch, md)
        out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)
        for part in md.parts:
            part_q = q.index_select(0, part.token_index)
            out[part.token_index] = self._attend_planned(part_q, layer, forward_batch, part.md)
        return out

    def _attend_planned(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch, md: Plan
    ) -> torch.Tensor:
        k_buf, v_buf = forward_batch.kv_pool.get_kv_buffer(layer.layer_id)
        batch_size = md.batch_size
        index, length, mask, causal = md.kv_index, md.max_seq_len, md.mask, md.causal
        window = getattr(layer, "sliding_window", None)
        if window is not None and md.max_seq_len > window:
            view = md.window_view(window)
            index, length, mask, causal = view.index, view.length, view.mask, False
        kv_shape = (batch_size, length, layer.num_kv_heads, layer.head_dim)
        keys = self._gather(k_buf, index, 0, q.dtype).view(kv_shape).transpose(1, 2)
        values = self._gather(v_buf, index, 1, q.dtype).view(kv_shape).transpose(1, 2)
        scale = softmax_scale(layer, forward_batch)
        if md.decode:
            return self._decode(q, keys, values, layer, batch_size, mask, scale)
        return self._extend(q, keys, values, layer, md, mask, causal, scale)

    def _gather(
        self, buf: torch.Tensor, index: torch.Tensor, slot: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """`buf[index]` in `dtype` (a float8 cache's values converted as they are), into
        workspaces kept across layers and batches.

        A fresh multi-megabyte tensor per layer would be freshly mapped memory each time
        (page faults cost several times the copy on CPU); every layer of a batch has the same
        gathered size, and each layer is done with it before the next one gathers.
        """
        shape = (index.shape[0], *buf.shape[1:])
        out = torch.index_select(buf, 0, index, out=self._space(slot, shape, buf))
        if buf.dtype == dtype:
            return out
        return self._space(slot + 2, shape, buf, dtype).copy_(out)

    def _space(
        self,
        slot: int,
        shape: tuple[int, ...],
        like: torch.Tensor,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        dtype = dtype or like.dtype
        numel = shape[0] * like[0].numel()
        ws = self._workspace[slot]
        if ws is None or ws.numel() < numel or ws.dtype != dtype or ws.device != like.device:
            ws = torch.empty(numel, dtype=dtype, device=like.device)
            self._workspace[slot] = ws
        return ws[:numel].view(shape)

    @staticmethod
    def _decode(
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        layer: AttentionLayer,
        batch_size: int,
        mask: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """keys/values [B, kv_heads, L, D]; query heads of one KV group become query rows."""
        group = layer.num_heads // layer.num_kv_heads
        q = q.reshape(batch_size, layer.num_kv_heads, group, layer.head_dim)
        sinks = getattr(layer, "sinks", None)
        if sinks is not None:  # (query heads as [kv head, group] rows, as q)
            sinks = sinks.view(layer.num_kv_heads, group, 1)
        out = sdpa(q, keys, values, mask, False, layer, scale, sinks)
        return out.reshape(batch_size, layer.num_heads * layer.head_dim)

    @staticmethod
    def _extend(
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        layer: AttentionLayer,
        md: Plan,
        mask: torch.Tensor | None,
        causal: bool,
        scale: float,
    ) -> torch.Tensor:
        batch_size = md.batch_size
        assert md.q_index is not None and md.out_index is not None
        q = q.reshape(-1, layer.num_heads, layer.head_dim).index_select(0, md.q_index)
        q = q.view(batch_size, md.max_q_len, layer.num_heads, layer.head_dim).transpose(1, 2)
        group = layer.num_heads // layer.num_kv_heads
        sinks = getattr(layer, "sinks", None)
        if sinks is not None:  # (one per query head: [heads, Q, L] scores)
            sinks = sinks.view(layer.num_heads, 1, 1)
        out = sdpa(q, keys, values, mask, causal, layer, scale, sinks, kv_group=group)
        out = out.transpose(1, 2).reshape(batch_size * md.max_q_len, -1)
        return out.index_select(0, md.out_index)
