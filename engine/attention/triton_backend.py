"""Paged attention with the Triton kernels in `kernels/` (`attention_backend="triton"`).

Per batch, `init_forward_metadata` prepares what every layer shares:

* DECODE: the split count of the split-K decode kernel (`--triton-attention-num-kv-splits`,
  else by batch size: `kernels.decode_attention.kv_splits_for`, 8-32 on CUDA, so that a few
  requests over long contexts still fill the GPU) and its stage-1 scratch, `mid_o`
  [B, Hq, splits, D] and `mid_lse` [B, Hq, splits] (float32), allocated once and reused by
  all layers; the splits are merged inside the kernel's last split program of each
  (request, KV head), whose int32 counts one buffer of the backend holds
  (`--triton-decode-merge kernel`: a second launch merges instead);
* EXTEND: `prefix_lens` / `extend_lens` [B] int64 on the device and `max_extend_len` (which
  sizes the kernel grid), besides the batch's own `extend_start_loc`. The lengths come from
  the batch's device tensors, not from host lists: the CUDA overlap executor runs this on its
  forward stream, where a copy from pageable host memory may wait for the batch in flight.

Per layer, `forward` runs the decode kernel (every key read from the pool through
`req_to_token`; over a 16-bit pool it also writes the new K/V at `out_cache_loc`, before the
program that holds them reads them) or stores the new K/V with the store kernel and runs the
extend kernel (prefix from the pool, the new tokens from k/v directly). Where the rotary
kernel has written them (`kv_store_target`), neither stores. A sliding-window layer passes its
window to both kernels (`window_left`), which skip the key blocks before it; a soft-capped
layer (Gemma 2) its cap (`logit_cap`). Without CUDA
the kernels run only under `TRITON_INTERPRET=1`, which is how this backend is tested on CPU.

CUDA graphs (decode): the kernels' launch shapes depend on the batch size only (so does the
split count), and everything they read per batch is a tensor the graph runner keeps static
(`req_pool_indices`, `seq_lens`, `out_cache_loc`, `req_to_token`) besides the scratch. So the
graph state is one scratch that the largest captured size needs (a view per captured size and
its split count) and replay has nothing to refresh on the device.

CUDA graphs of speculative verify steps (engine/speculative/verify_graphs.py): the extend
kernel over requests of one width, whose grid depends on the batch size and that width only;
its per-request lengths are the runner's static buffers, and the prefix lengths are computed
in the graph (`cuda_graph_prologue`) into a buffer of each captured size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import (
    AttentionBackend,
    AttentionLayer,
    logit_cap,
    softmax_scale,
    triton_store_target,
    window_left,
)
from engine.forward_batch import ForwardBatch
from engine.speculative.tree import packed_masks
from kernels.decode_attention import (
    decode_attention,
    decode_scratch,
    kv_splits_for,
    merge_counters,
)
from kernels.extend_attention import extend_attention
from kernels.jit import num_sms, triton_runs_on
from kernels.kv_store import store_kv

MIN_KV_SPLITS, MAX_KV_SPLITS = 8, 32  # the decode kernel's split counts on CUDA


@dataclass
class _DecodeMetadata:
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # made by the first layer
    num_splits: int | None = None  # chosen by the first layer (graphs: at capture)
    merge_counts: torch.Tensor | None = None  # the fused merge's, taken by the first layer


@dataclass
class _ExtendMetadata:
    prefix_lens: torch.Tensor  # [B] int64
    extend_lens: torch.Tensor  # [B] int64
    extend_start_loc: torch.Tensor  # [B] int64
    max_extend_len: int
    # a verify step's draft trees: (uint8 masks, [B] int64 starts), `packed_masks`'
    tree_mask: tuple[torch.Tensor, torch.Tensor] | None = None


class TritonAttnBackend(AttentionBackend):
    def __init__(
        self,
        device: str | torch.device = "cuda",
        num_kv_splits: int | None = None,
        fused_merge: bool = True,
        **kwargs: object,
    ) -> None:
        self.device = torch.device(device)
        if not triton_runs_on(self.device):
            raise RuntimeError(
                "attention_backend='triton' runs on CUDA, or on CPU under TRITON_INTERPRET=1"
            )
        check_float8_loads(kwargs.get("kv_pool"), self.device)
        # None: by batch size (`kv_splits`). More splits keep the GPU busy on small batches
        # with long contexts; on CPU (the interpreter, tests only) every program is Python, so
        # few: 1-4, from a pretend GPU of 4 SMs (so tests see the count change with the size).
        self.num_kv_splits = num_kv_splits
        if self.device.type == "cuda":
            self._split_rule = (num_sms(self.device), MIN_KV_SPLITS, MAX_KV_SPLITS)
        else:
            self._split_rule = (4, 1, 4)
        self.metadata: _DecodeMetadata | _ExtendMetadata | None = None
        self.model_config = kwargs.get("model_config")  # query heads and head_dim, for graphs
        self._graph_scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._graph_metadata: dict[int, _DecodeMetadata] = {}  # captured batch size -> its own
        self._verify_metadata: dict[int, _ExtendMetadata] = {}  # the same, of verify graphs
        # the decode kernel's merge inside its last split program: the per-(request, KV head)
        # counts, zero between launches, one buffer for every layer, batch and graph (grown
        # outside capture only: `init_cuda_graph_state` sizes it for the largest graph)
        self.fused_merge = fused_merge
        self._merge_counts: torch.Tensor | None = None
        self._retired_counts: list[torch.Tensor] = []  # captured graphs may still point there

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if fb.batch_size == 0:
            self.metadata = None
        elif fb.forward_mode.is_decode():
            self.metadata = _DecodeMetadata()
        else:
            assert fb.extend_prefix_lens_cpu is not None and fb.extend_seq_lens_cpu is not None
            assert fb.extend_start_loc is not None
            extend_lens = fb.extend_seq_lens
            if extend_lens is None:  # (a batch built by hand) the lengths come from the host
                extend_lens = torch.tensor(fb.extend_seq_lens_cpu, device=fb.seq_lens.device)
            self.metadata = _ExtendMetadata(
                prefix_lens=fb.seq_lens - extend_lens,
                extend_lens=extend_lens,
                extend_start_loc=fb.extend_start_loc,
                max_extend_len=max(fb.extend_seq_lens_cpu),
                tree_mask=None if fb.spec_parents is None
                else tree_mask_tensors(fb.spec_parents, extend_lens),
            )

    # -- CUDA graphs ----------------------------------------------------------------------------
    supports_cuda_graph = True
    supports_tree_mask = True

    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        mc = self.model_config
        if mc is None:
            raise RuntimeError("TritonAttnBackend: CUDA graphs need model_config (query heads)")
        heads, head_dim = mc.num_heads, mc.head_dim  # type: ignore[attr-defined]
        # one flat buffer that holds the largest captured size's [bs, Hq, splits(bs), D]
        # (fewer splits at larger sizes: at most max_bs x MIN_KV_SPLITS rows on CUDA, what
        # the fixed count of 8 needed)
        kv_heads = mc.num_kv_heads  # type: ignore[attr-defined]
        rows = max(bs * self.kv_splits(bs, kv_heads) for bs in range(1, max_bs + 1))
        self._graph_scratch = decode_scratch(rows, heads, head_dim, 1, self.device)
        self._graph_metadata = {}
        self.merge_counts(max_bs * kv_heads)

    supports_verify_cuda_graph = True

    def init_verify_cuda_graph_state(self, max_bs: int, width: int, max_context_len: int) -> None:
        # each captured size's metadata holds its own prefix lengths (made at its capture)
        self._verify_metadata: dict[int, _ExtendMetadata] = {}

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if fb.forward_mode.is_extend():  # a verify graph: the extend kernel over static rows
            assert fb.extend_seq_lens is not None and fb.extend_start_loc is not None
            assert fb.extend_seq_lens_cpu is not None
            self.metadata = self._verify_metadata[fb.batch_size] = _ExtendMetadata(
                prefix_lens=torch.zeros_like(fb.seq_lens),  # (written by the prologue)
                extend_lens=fb.extend_seq_lens,
                extend_start_loc=fb.extend_start_loc,
                max_extend_len=max(fb.extend_seq_lens_cpu),  # the width: fixed per graph
                tree_mask=fb.spec_tree_mask,  # (a graph of trees: its static masks)
            )
            return
        assert self._graph_scratch is not None, "init_cuda_graph_state was not called"
        bs = forward_batch.batch_size
        kv_heads = self.model_config.num_kv_heads  # type: ignore[attr-defined]
        splits = self.kv_splits(bs, kv_heads)
        mid_o, mid_lse = self._graph_scratch
        _, heads, _, head_dim = mid_o.shape
        n = bs * heads * splits
        scratch = (
            mid_o.view(-1)[: n * head_dim].view(bs, heads, splits, head_dim),
            mid_lse.view(-1)[:n].view(bs, heads, splits),
        )
        counts = self.merge_counts(bs * kv_heads) if self.fused_merge else None
        self._graph_metadata[bs] = _DecodeMetadata(
            scratch=scratch, num_splits=splits, merge_counts=counts
        )
        self.metadata = self._graph_metadata[bs]

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        # Nothing on the device to refresh (see the module docstring); what a replay computes
        # is what the capture recorded with this size's metadata, which `metadata` names again
        # for anything that runs the forward's Python after the replay (an eager test double).
        fb = forward_batch
        graphs = self._verify_metadata if fb.forward_mode.is_extend() else self._graph_metadata
        self.metadata = graphs[fb.batch_size]

    def cuda_graph_prologue(self, forward_batch: ForwardBatch) -> None:
        """In a verify graph: the prefix lengths, from the static lengths."""
        fb = forward_batch
        if fb.forward_mode.is_extend():
            md = self._verify_metadata[fb.batch_size]
            torch.sub(fb.seq_lens, md.extend_lens, out=md.prefix_lens)

    def _attend_storing(  # fmt: skip
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
        forward_batch: ForwardBatch, md: object,
    ) -> torch.Tensor | None:
        """Decode: the decode kernel writes the new K/V (the program that holds each
        request's last key, before reading it), so the store needs no launch of its own."""
        if not isinstance(md, _DecodeMetadata):
            return None
        return self._attend(q, k, v, layer, forward_batch, md, store_new_kv=True)

    def _store_kv(
        self, layer: AttentionLayer, forward_batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        k_buf, v_buf = forward_batch.kv_pool.get_kv_buffer(layer.layer_id)
        store_kv(k_buf, v_buf, forward_batch.out_cache_loc, k, v)  # the Triton kernel

    def kv_store_target(
        self, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        return triton_store_target(layer, forward_batch)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        md: _DecodeMetadata | _ExtendMetadata,
        store_new_kv: bool = False,
    ) -> torch.Tensor:
        """`store_new_kv` (decode only): the decode kernel writes k/v at `out_cache_loc`."""
        fb = forward_batch
        k_buf, v_buf = fb.kv_pool.get_kv_buffer(layer.layer_id)
        q = q.reshape(-1, layer.num_heads, layer.head_dim)
        if isinstance(md, _DecodeMetadata):
            new_kv = (k, v, fb.out_cache_loc) if store_new_kv else None
            out = self._decode(q, k_buf, v_buf, layer, fb, md, new_kv)
        else:
            out = extend_attention(
                q, k, v, k_buf, v_buf,
                fb.req_to_token, fb.req_pool_indices,
                md.prefix_lens, md.extend_lens, md.extend_start_loc, md.max_extend_len,
                softmax_scale(layer, fb), window_left=window_left(layer),
                logit_cap=logit_cap(layer), sinks=getattr(layer, "sinks", None),
                tree_mask=md.tree_mask,
                positions=fb.positions if md.tree_mask is not None else None,  # (windows)
            )  # fmt: skip
        return out.view(-1, layer.num_heads * layer.head_dim)

    def _decode(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        layer: AttentionLayer,
        fb: ForwardBatch,
        md: _DecodeMetadata,
        new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if md.num_splits is None:
            md.num_splits = self.kv_splits(fb.batch_size, k_buf.shape[1])
        if md.scratch is None:
            md.scratch = decode_scratch(
                fb.batch_size, layer.num_heads, layer.head_dim, md.num_splits, q.device
            )
        if self.fused_merge and md.merge_counts is None:
            md.merge_counts = self.merge_counts(fb.batch_size * k_buf.shape[1])
        return decode_attention(
            q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
            softmax_scale(layer, fb),
            num_splits=md.num_splits, scratch=md.scratch, window_left=window_left(layer),
            logit_cap=logit_cap(layer), merge_counter=md.merge_counts, new_kv=new_kv,
            sinks=getattr(layer, "sinks", None),
        )  # fmt: skip

    def merge_counts(self, n: int) -> torch.Tensor:
        """The fused merge's counts for `n` (request, KV head) pairs: a prefix of one zeroed
        buffer, replaced by a longer one when a batch needs more (never during a capture:
        the graph state sizes it for the largest captured batch). A replaced buffer is kept,
        as graphs captured over it replay into it."""
        if self._merge_counts is None or self._merge_counts.numel() < n:
            if self._merge_counts is not None:
                self._retired_counts.append(self._merge_counts)
            self._merge_counts = merge_counters(n, 1, self.device)
        return self._merge_counts[:n]

    def kv_splits(self, batch_size: int, num_kv_heads: int) -> int:
        """The decode kernel's split count for a batch: the flag's, else by batch size."""
        if self.num_kv_splits:
            return self.num_kv_splits
        return kv_splits_for(batch_size, num_kv_heads, *self._split_rule)


def float8_loads(kv_dtype: object, device: torch.device) -> bool:
    """Whether Triton's kernels can read a cache of `kv_dtype` on `device`: float8 e4m3 is
    converted on sm_89 and later only (e5m2 everywhere)."""
    if kv_dtype == torch.float8_e4m3fn and device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return True


def check_float8_loads(kv_pool: object, device: torch.device) -> None:
    """Triton converts float8 e4m3 on sm_89 and later only (e5m2 everywhere)."""
    if not float8_loads(getattr(kv_pool, "dtype", None), device):
        raise ValueError(
            "kv_cache_dtype fp8_e4m3 with attention_backend='triton' needs compute "
            "capability 8.9 or later (Ada, Hopper); use fp8_e5m2 on this GPU"
        )


def tree_mask_tensors(
    parents: list[list[int]], extend_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The extend kernel's tree mask of a verify step with draft trees, on the device of
    `extend_lens` (each request's 1 + drafts): one copy of the uint8 masks; where each starts
    (the sum of the squared lengths before it) from the lengths already there."""
    masks, _ = packed_masks(parents)
    sizes = extend_lens * extend_lens
    return torch.from_numpy(masks).to(extend_lens.device), torch.cumsum(sizes, 0) - sizes
