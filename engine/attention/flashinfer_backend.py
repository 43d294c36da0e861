"""Paged attention with FlashInfer (`attention_backend="flashinfer"`, the default on CUDA).

flashinfer reads the KV pool in place, in NHD pages; per batch, `init_forward_metadata` builds
the page tables (engine/attention/page_table.py) and plans the wrappers, for all layers. On
CUDA the plan runs on the overlap executor's forward stream, behind the batch in flight: its
host arrays are numpy arithmetic staged in pinned memory (`PinnedRing`) and its page ids one
Triton launch that reads the batch's lengths on the device, so that planning never makes the
host wait for that batch and costs it a single launch besides flashinfer's own plan.

* DECODE: BatchDecodeWithPagedKVCacheWrapper over each request's whole context (the new token's
  K/V is stored first). GQA groups of 4 or more query heads use the tensor-core (prefill)
  kernel, where the CUDA-core decode kernel would reload K/V once per query head.
* EXTEND: the new tokens attend to each other through BatchPrefillWithRaggedKVCacheWrapper
  (causal, K/V read straight from the projections, no page indirection) and to their cached
  prefix through BatchPrefillWithPagedKVCacheWrapper (not causal: every new token sees the
  whole prefix). The two partial softmaxes merge exactly through their log-sum-exps
  (`merge_state_in_place`). A batch where no request has a cached prefix (most first
  prefills) runs the ragged kernel alone, without log-sum-exps.

Sliding-window layers (Mistral, Qwen2, Gemma; one window per model) have wrappers of their
own, planned with `window_left` = window - 1: a paged prefill wrapper over each request's whole
context, causal (the new tokens' K/V are stored first; one pass applies the window to prefix
and new keys alike), and a decode wrapper. Full layers keep the ragged + prefix path above.
A soft-capped model (Gemma 2: scores s -> c * tanh(s / c)) plans every wrapper with its
`logits_soft_cap`. flashinfer picks both kernel variants at plan time and each `forward`
resets them to its own arguments, so every call passes the planned values again.

FP8 KV cache (`kv_cache_dtype`): the paged and decode wrappers are planned with float8 K/V and
q in the model's dtype; the ragged one gets the new tokens' stored values converted to the
model's dtype, so that every key is read as the cache holds it, as in the other backends. The
layer's k_scale is folded into the softmax scale and v_scale applied to the output
(engine/attention/base.py) rather than passed as flashinfer's k_scale/v_scale, which would
scale the paged part of a merged extend and not the ragged one.

Each layer passes its own softmax scale (GPT-2 can scale per layer) to `forward(..., sm_scale=)`,
as SGLang does. All wrappers use the FA2 kernels: one JIT-compiled module per dtype and head_dim
serves them all (FA3 on Hopper would be a second, slow compile).

CUDA graphs: each captured batch size has its own decode wrapper with
`use_cuda_graph=True` over slices of static page-table buffers (`init_cuda_graph_state`);
replay re-plans it, which rewrites those buffers and the wrapper's scheduling workspace, all
that the captured kernels read. Where the page-table kernel runs compiled (a GPU), the graph
itself writes the page ids, first thing (`cuda_graph_prologue`: the kernel reads the static
rows and lengths): a replay's plan is then numpy and flashinfer's planner, with no launch.
Speculative verify graphs (engine/speculative/verify_graphs.py: `width` queries a request)
capture paged prefill wrappers the same way, causal over each request's whole context (the
new tokens' K/V stored first, as the windowed path does), over the same page-id buffer and
buffers of their own for the query offsets, key offsets and last page lengths. The graph
hooks are `FlashInferGraphs` (engine/attention/flashinfer_graphs.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.attention.base import (
    AttentionBackend,
    AttentionLayer,
    logit_cap,
    softmax_scale,
    triton_store_target,
    window_left,
)
from engine.attention.flashinfer_graphs import FlashInferGraphs, GraphBuffers
from engine.attention.flashinfer_plan import DecodePlanner, PrefillPlanner
from engine.attention.flashinfer_support import (
    KERNEL_BACKEND,
    check_supported,
    load_flashinfer,
    model_logit_cap,
    model_windows,
)  # fmt: skip
from engine.attention.page_table import (
    build_page_table,
    build_qo_indptr,
    host_page_table,
    merge_kernel_fits,
    merge_states_torch,
)
from engine.forward_batch import ForwardBatch

try:
    from kernels.kv_store import store_kv
except ImportError:  # no Triton: the base class's indexed copies
    store_kv = None

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.mem_cache.kv_pool import KVPool

DEFAULT_WORKSPACE_BYTES = 384 << 20  # flashinfer's split-KV scratch, shared by all wrappers
TENSOR_CORE_MIN_GROUP = 4  # query heads per KV head from which decode uses tensor cores


class PinnedRing:
    """Pinned staging buffers for flashinfer's plans, used in turn.

    A wrapper's `plan` writes its scheduling data into a pinned host buffer and queues an
    asynchronous copy of it to the device, on the forward stream, behind the batch in flight.
    flashinfer keeps one such buffer per wrapper: planning the same wrapper again before the
    device has run that copy (the overlap scheduler plans batch N+1 while batch N waits
    behind N-1) would overwrite data the pending copy has yet to read, and batch N would run
    with N+1's plan (an illegal memory access when the shapes differ). So each plan stages in
    the next of `size` buffers instead, after waiting for the event recorded when that buffer
    was last used. A batch plans at most three wrappers and batch N-1 is done (its results
    processed) when N+1 is planned, so with 8 buffers the wait is already over. The host
    tables passed to `plan` (indptr, last page lengths), which flashinfer also copies
    asynchronously, stage the same way in a second ring, held over all of a batch's plans.
    """

    def __init__(self, device: torch.device, size: int = 8, nbytes: int = 8 << 20) -> None:
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                        for _ in range(size)]  # fmt: skip
        self.events: list[torch.cuda.Event | None] = [None] * size
        index = torch.device(device).index  # (an int: torch.cuda's fast path, every stage)
        self.index = torch.cuda.current_device() if index is None else index
        self.nbytes = nbytes
        self.next = 0

    def synchronize(self) -> None:
        """Waits until no copy staged from these buffers is pending."""
        for event in self.events:
            if event is not None:
                event.synchronize()

    @contextlib.contextmanager
    def stage(self) -> Iterator[torch.Tensor]:
        i, self.next = self.next, (self.next + 1) % len(self.buffers)
        event = self.events[i]
        if event is not None:
            event.synchronize()
        yield self.buffers[i]
        self.events[i] = event = event or torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.index))


@dataclass
class _DecodeMetadata:
    wrapper: Any  # a BatchDecodeWithPagedKVCacheWrapper planned for this batch (full layers)
    window_wrapper: Any = None  # the same, planned with the window (sliding-window layers)


@dataclass
class _ExtendMetadata:
    has_prefix: bool  # some request has cached keys: the paged wrapper is planned too


@dataclass
class _VerifyMetadata:
    """A verify graph's: paged prefill wrappers over each request's whole context, causal (the
    new tokens' K/V stored first), planned for this batch."""

    wrapper: Any  # full layers
    window_wrapper: Any = None  # sliding-window layers


class FlashInferAttnBackend(FlashInferGraphs, AttentionBackend):

    def __init__(
        self,
        device: str | torch.device = "cuda",
        model_config: ModelConfig | None = None,
        kv_pool: KVPool | None = None,
        page_size: int | None = None,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        decode_tensor_cores: str = "auto",
        **kwargs: object,
    ) -> None:
        if model_config is None or kv_pool is None:
            raise ValueError("FlashInferAttnBackend needs model_config and kv_pool")
        self.device = torch.device(device)
        self.fi = load_flashinfer(self.device)
        self.num_heads = model_config.num_heads
        self.num_kv_heads = model_config.num_kv_heads
        self.head_dim = model_config.head_dim
        self.page_size = page_size or kv_pool.page_size
        self.dtype = kv_pool.compute_dtype  # q's (and the ragged K/V's)
        self.kv_dtype = kv_pool.dtype  # the pages' (float8 with an FP8 cache)
        check_supported(self.dtype, self.head_dim, self.page_size, kv_pool)
        self.use_tensor_cores = decode_tensor_cores == "on" or (
            decode_tensor_cores == "auto"
            and self.num_heads // self.num_kv_heads >= TENSOR_CORE_MIN_GROUP
        )
        self.window_left, self.full_layers = model_windows(model_config)
        self.logit_cap = model_logit_cap(model_config)
        self.merge_on_device = merge_kernel_fits(self.num_heads, self.head_dim, self.dtype)
        # Long-lived tensors are made outside inference mode (plans update them in place, in or
        # out of it); wrappers only for the attention the model has (full and/or windowed).
        with torch.inference_mode(False):
            self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
            prefill = functools.partial(
                self.fi.BatchPrefillWithPagedKVCacheWrapper, self.workspace, "NHD",
                backend=KERNEL_BACKEND,
            )  # fmt: skip
            if self.full_layers:
                self.ragged = self.fi.BatchPrefillWithRaggedKVCacheWrapper(
                    self.workspace, "NHD", backend=KERNEL_BACKEND
                )
                self.paged = prefill()
            self.paged_window = prefill() if self.window_left >= 0 else None
        self.decode = self._decode_wrappers()
        self.decode_planner = DecodePlanner(self.fi)
        self.prefill_planner = PrefillPlanner(self.fi)
        self.pinned_ring = PinnedRing(self.device) if self.device.type == "cuda" else None
        self.table_ring: PinnedRing | None = None  # (made at the first plan: `_host_ints`)
        self.metadata: _DecodeMetadata | _ExtendMetadata | None = None
        self.graph_buffers: GraphBuffers | None = None
        # whether captured graphs write their page ids themselves (`cuda_graph_prologue`)
        self.graph_page_ids = False
        # captured batch size -> its decode wrappers (full, windowed)
        self.graph_wrappers: dict[int, tuple[Any, Any]] = {}
        # verify graphs: qo_indptr, kv indptr and last page lengths (the page ids are the
        # decode graphs' buffer), and each captured size's prefill wrappers (full, windowed)
        self.verify_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.verify_wrappers: dict[int, tuple[Any, Any]] = {}

    # -- planning ---------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if fb.batch_size == 0:
            self.metadata = None
        elif fb.forward_mode.is_decode():
            self.metadata = self._plan_decode(self.decode, fb)
        else:
            self.metadata = self._plan_extend(fb)

    def _plan_decode(
        self,
        wrappers: tuple[Any, Any],
        fb: ForwardBatch,
        indices_out: torch.Tensor | None = None,
        ids_in_graph: bool = False,
    ) -> _DecodeMetadata:
        """Plans the full-attention and the windowed wrapper (those the model has) over the
        same page table (its page ids written into `indices_out` when given; with
        `ids_in_graph`, left for the graph to write there)."""
        full, windowed = wrappers
        with self._host_ints(fb, 2 * fb.batch_size + 1) as host:
            if ids_in_graph:
                assert indices_out is not None
                table = host_page_table(fb.seq_lens_cpu, self.page_size, indices_out, host)
            else:
                table = self._context_table(fb, host, indices_out)
            for wrapper, left in ((full, -1), (windowed, self.window_left)):
                if wrapper is not None:
                    with self._staged(wrapper):
                        self.decode_planner.plan(
                            wrapper, table, fb.seq_lens_cpu, self.num_heads, self.num_kv_heads,
                            self.head_dim, self.page_size, window_left=left,
                            **self._plan_scalars(),
                        )  # fmt: skip
        return _DecodeMetadata(full, windowed)

    def _plan_verify(
        self,
        wrappers: tuple[Any, Any],
        fb: ForwardBatch,
        indices_out: torch.Tensor | None = None,
        ids_in_graph: bool = False,
    ) -> _VerifyMetadata:
        """Plans a verify graph's prefill wrappers (full, windowed: those the model has) for
        `width` queries a request, causal, over each request's whole context (its page ids
        written into `indices_out` when given; with `ids_in_graph`, left to the graph)."""
        assert fb.extend_seq_lens_cpu is not None
        bs = fb.batch_size
        with self._host_ints(fb, 3 * bs + 2) as host:
            qo_host, table_host = (None, None) if host is None else (host[: bs + 1], host[bs + 1 :])
            qo_indptr = build_qo_indptr(fb.extend_seq_lens_cpu, qo_host)
            if ids_in_graph:
                assert indices_out is not None
                table = host_page_table(fb.seq_lens_cpu, self.page_size, indices_out, table_host)
            else:
                table = self._context_table(fb, table_host, indices_out)
            full, windowed = wrappers
            for wrapper, left in ((full, -1), (windowed, self.window_left)):
                if wrapper is not None:
                    with self._staged(wrapper):
                        self.prefill_planner.plan(
                            wrapper, qo_indptr, table, fb.extend_seq_lens_cpu, self.num_heads,
                            self.num_kv_heads, self.head_dim, self.page_size, causal=True,
                            window_left=left, **self._plan_scalars(),
                        )  # fmt: skip
        return _VerifyMetadata(full, windowed)

    def _context_table(
        self, fb: ForwardBatch, host: torch.Tensor | None, indices_out: torch.Tensor | None = None
    ) -> Any:
        """The page table of each request's whole context (new tokens included)."""
        return build_page_table(
            fb.req_to_token, fb.req_pool_indices, fb.seq_lens_cpu, self.page_size, fb.seq_lens,
            host=host, indices_out=indices_out,
        )  # fmt: skip

    def _plan_extend(self, fb: ForwardBatch) -> _ExtendMetadata:
        bs = fb.batch_size
        # host tables, in one staged buffer: qo_indptr, then up to two page tables
        with self._host_ints(fb, 5 * bs + 3) as host:
            parts = (None, None, None) if host is None else (
                host[: bs + 1], host[bs + 1 : 3 * bs + 2], host[3 * bs + 2 :]
            )  # fmt: skip
            return self._plan_extend_tables(fb, *parts)

    def _plan_extend_tables(
        self,
        fb: ForwardBatch,
        qo_host: torch.Tensor | None,
        context_host: torch.Tensor | None,
        prefix_host: torch.Tensor | None,
    ) -> _ExtendMetadata:
        assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
        qo_indptr = build_qo_indptr(fb.extend_seq_lens_cpu, qo_host)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        qo_lens = fb.extend_seq_lens_cpu
        if self.paged_window is not None:
            table = self._context_table(fb, context_host)
            with self._staged(self.paged_window):
                self.prefill_planner.plan(
                    self.paged_window, qo_indptr, table, qo_lens, *heads, self.page_size,
                    causal=True, window_left=self.window_left, **self._plan_scalars(),
                )  # fmt: skip
        has_prefix = any(fb.extend_prefix_lens_cpu)
        if not self.full_layers:
            return _ExtendMetadata(has_prefix)
        self._plan(
            self.ragged, qo_indptr, qo_indptr, *heads, causal=True, **self._plan_scalars(self.dtype)
        )
        if has_prefix:
            # the prefix lengths on the device: context minus new tokens
            table = build_page_table(
                fb.req_to_token, fb.req_pool_indices, fb.extend_prefix_lens_cpu, self.page_size,
                None if fb.extend_seq_lens is None else fb.seq_lens, fb.extend_seq_lens,
                host=prefix_host,
            )  # fmt: skip
            with self._staged(self.paged):
                self.prefill_planner.plan(
                    self.paged, qo_indptr, table, qo_lens, *heads, self.page_size,
                    causal=False, **self._plan_scalars(),
                )  # fmt: skip
        return _ExtendMetadata(has_prefix)

    @contextlib.contextmanager
    def _host_ints(self, fb: ForwardBatch, n: int) -> Iterator[torch.Tensor | None]:
        """n int32 of host memory for a batch's tables (flashinfer copies them to the device
        asynchronously inside `plan`), valid until the plans made inside this block have been
        copied: pinned staging memory from a ring of its own on CUDA (see `PinnedRing`), None
        elsewhere (the tables are then new tensors). The ring is sized for the largest batch,
        one per row of `req_to_token`, and grows when a batch needs more (the hybrid window
        backend's batches have a row per request)."""
        if self.pinned_ring is None:
            yield None
            return
        ring = self.table_ring
        if ring is None or ring.nbytes < 4 * n:
            rows = int(fb.req_to_token.shape[0])
            nbytes = max(4 * n, 4 * (5 * rows + 3), 2 * ring.nbytes if ring else 0)
            if ring is not None:
                ring.synchronize()  # (its buffers may still be read by pending copies)
            self.table_ring = ring = PinnedRing(self.device, size=16, nbytes=nbytes)
        with ring.stage() as buffer:
            yield buffer.view(torch.int32)[:n]

    def _plan(self, wrapper: Any, *args: Any, **kwargs: Any) -> None:
        """`wrapper.plan(...)`, its host-side scheduling data staged in the next buffer of
        the pinned ring (see `PinnedRing`)."""
        with self._staged(wrapper):
            wrapper.plan(*args, **kwargs)

    @contextlib.contextmanager
    def _staged(self, wrapper: Any) -> Iterator[None]:
        """A plan of `wrapper` made inside stages its scheduling data in the next buffer of the
        pinned ring (on CUDA)."""
        if self.pinned_ring is None:
            yield
            return
        with self.pinned_ring.stage() as buffer:
            wrapper._pin_memory_int_workspace_buffer = buffer
            yield

    def _plan_scalars(self, kv_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """Plan arguments; K/V in the pages' dtype unless `kv_dtype` (the ragged wrapper's
        K/V come from the projections). sm_scale is only planned here: each layer passes its
        own to forward()."""
        return dict(
            q_data_type=self.dtype, kv_data_type=kv_dtype or self.kv_dtype,
            sm_scale=self.head_dim**-0.5, logits_soft_cap=self.logit_cap,
        )  # fmt: skip

    # -- attention --------------------------------------------------------------------------------
    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        md: _DecodeMetadata | _ExtendMetadata | _VerifyMetadata,
    ) -> torch.Tensor:
        pool = forward_batch.kv_pool
        q = q.reshape(-1, layer.num_heads, layer.head_dim).contiguous()
        left, cap = window_left(layer), logit_cap(layer)
        assert cap == self.logit_cap, f"layer logit cap {cap} was not planned"
        scalars = dict(sm_scale=softmax_scale(layer, forward_batch), logits_soft_cap=cap)
        if isinstance(md, _VerifyMetadata):  # (the new tokens' K/V are in the pool)
            assert left < 0 or left == self.window_left, f"layer window {left + 1} not planned"
            wrapper = md.wrapper if left < 0 else md.window_wrapper
            out = wrapper.forward(q, self._paged_kv(pool, layer.layer_id), causal=True,
                                  window_left=left, **scalars)  # fmt: skip
        elif left >= 0:
            # the windowed wrappers read the new tokens' K/V from the pool, stored first
            assert left == self.window_left, f"layer window {left + 1} was not planned"
            paged_kv = self._paged_kv(pool, layer.layer_id)
            wrapper = md.window_wrapper if isinstance(md, _DecodeMetadata) else self.paged_window
            kwargs = {} if isinstance(md, _DecodeMetadata) else {"causal": True}
            out = wrapper.forward(q, paged_kv, window_left=left, **scalars, **kwargs)
        elif isinstance(md, _DecodeMetadata):
            paged_kv = self._paged_kv(pool, layer.layer_id)
            out = md.wrapper.forward(q, paged_kv, **scalars)
        else:
            out = self._extend(q, k, v, layer, pool, md, scalars)
        return out.view(-1, layer.num_heads * layer.head_dim)

    def _extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        pool: KVPool,
        md: _ExtendMetadata,
        scalars: dict[str, float],
    ) -> torch.Tensor:
        # (a float8 cache's new K/V as stored, read like the pages: the scales are applied
        # outside, engine/attention/base.py)
        k = k.reshape(-1, layer.num_kv_heads, layer.head_dim).to(self.dtype)
        v = v.reshape(-1, layer.num_kv_heads, layer.head_dim).to(self.dtype)
        if not md.has_prefix:
            return self.ragged.forward(q, k, v, causal=True, **scalars)
        out, lse = self.ragged.forward_return_lse(q, k, v, causal=True, **scalars)
        paged_kv = self._paged_kv(pool, layer.layer_id)
        out_prefix, lse_prefix = self.paged.forward_return_lse(
            q, paged_kv, causal=False, **scalars
        )
        merge = self.fi.merge_state_in_place if self.merge_on_device else merge_states_torch
        merge(out, lse, out_prefix, lse_prefix)
        return out

    def _store_kv(
        self, layer: AttentionLayer, forward_batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """The Triton store (one launch writes K and V), as the triton backend does; two
        indexed copies where Triton is missing."""
        if store_kv is None:
            return super()._store_kv(layer, forward_batch, k, v)
        k_buf, v_buf = forward_batch.kv_pool.get_kv_buffer(layer.layer_id)
        store_kv(k_buf, v_buf, forward_batch.out_cache_loc, k, v)

    def kv_store_target(
        self, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        return None if store_kv is None else triton_store_target(layer, forward_batch)

    def _paged_kv(self, pool: KVPool, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        k_buf, v_buf = pool.get_kv_buffer(layer_id)
        shape = (-1, self.page_size, self.num_kv_heads, self.head_dim)
        return k_buf.view(shape), v_buf.view(shape)

    def _decode_wrappers(self, graph_bs: int | None = None) -> tuple[Any, Any]:
        """(full, windowed) decode wrappers, None for the attention the model lacks: eager ones,
        or (graph_bs) those a graph of that size captures."""
        graph_kwargs: dict[str, Any] = {}
        if graph_bs is not None:
            buffers = self.graph_buffers
            assert buffers is not None, "init_cuda_graph_state was not called"
            graph_kwargs = dict(
                use_cuda_graph=True,
                paged_kv_indptr_buffer=buffers.indptr[: graph_bs + 1],
                paged_kv_indices_buffer=buffers.indices,
                paged_kv_last_page_len_buffer=buffers.last_page_len[:graph_bs],
            )
        with torch.inference_mode(False):
            make = functools.partial(
                self.fi.BatchDecodeWithPagedKVCacheWrapper, self.workspace, "NHD",
                use_tensor_cores=self.use_tensor_cores, backend=KERNEL_BACKEND, **graph_kwargs,
            )  # fmt: skip
            return (make() if self.full_layers else None), (
                make() if self.window_left >= 0 else None
            )
