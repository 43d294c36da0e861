"""The flashinfer backend's CUDA graphs (engine/attention/flashinfer_backend.py's module
docstring says how they are captured and replayed): the hooks of `AttentionBackend` for decode
graphs (engine/cuda_graph_runner.py) and speculative verify graphs
(engine/speculative/verify_graphs.py), as a mixin of `FlashInferAttnBackend`, whose planning
(`_plan_decode`, `_plan_verify`) and wrappers (`_decode_wrappers`) they use."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.attention.flashinfer_support import KERNEL_BACKEND
from engine.attention.page_table import page_ids
from kernels.jit import compiled_on

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch


@dataclass
class GraphBuffers:
    """What captured decode graphs read, sliced per captured batch size (the page ids also
    verify graphs')."""

    indptr: torch.Tensor  # [max_bs + 1] int32
    indices: torch.Tensor  # [max_bs * max pages per request] int32
    last_page_len: torch.Tensor  # [max_bs] int32


class FlashInferGraphs:
    """The CUDA-graph hooks of the flashinfer backend (a mixin: `self` is the backend)."""

    supports_cuda_graph = True
    supports_verify_cuda_graph = True
    cuda_graph_seq_len_fill_value = 1
    graph_buffers: GraphBuffers | None
    graph_wrappers: dict[int, tuple[Any, Any]]
    graph_page_ids: bool
    verify_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    verify_wrappers: dict[int, tuple[Any, Any]]

    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        max_pages = -(-max_context_len // self.page_size)
        with torch.inference_mode(False):
            self.graph_buffers = GraphBuffers(
                indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
                indices=torch.zeros(max_bs * max_pages, dtype=torch.int32, device=self.device),
                last_page_len=torch.ones(max_bs, dtype=torch.int32, device=self.device),
            )
        self.graph_wrappers = {}
        self.graph_page_ids = page_ids is not None and compiled_on(self.graph_buffers.indices)

    def init_verify_cuda_graph_state(self, max_bs: int, width: int, max_context_len: int) -> None:
        # the page ids go to the decode graphs' buffer (one large buffer for both); a backend
        # that captures no decode graphs (a hybrid's prefill backend) makes it here
        if self.graph_buffers is None:
            self.init_cuda_graph_state(max_bs, max_context_len)
        assert self.graph_buffers is not None
        max_pages = -(-max_context_len // self.page_size)
        if self.graph_buffers.indices.numel() < max_bs * max_pages:
            raise RuntimeError("verify graphs of more requests than the decode graphs")
        with torch.inference_mode(False):
            self.verify_buffers = (
                torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
                torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
                torch.ones(max_bs, dtype=torch.int32, device=self.device),
            )
        self.verify_wrappers = {}

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        bs = forward_batch.batch_size
        if forward_batch.forward_mode.is_extend():  # a verify graph
            self.verify_wrappers[bs] = self._verify_wrappers(bs)
            self.metadata = self._plan_verify(self.verify_wrappers[bs], forward_batch)
            return
        self.graph_wrappers[bs] = self._decode_wrappers(graph_bs=bs)
        self.metadata = self._plan_decode(self.graph_wrappers[bs], forward_batch)

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        assert self.graph_buffers is not None
        if forward_batch.forward_mode.is_extend():
            self.metadata = self._plan_verify(
                self.verify_wrappers[forward_batch.batch_size], forward_batch,
                self.graph_buffers.indices, self.graph_page_ids,
            )  # fmt: skip
            return
        wrappers = self.graph_wrappers[forward_batch.batch_size]
        # writes into the captured buffers (the page ids straight from the kernel, here or in
        # the graph: flashinfer's copy of them onto themselves is then a no-op)
        self.metadata = self._plan_decode(
            wrappers, forward_batch, self.graph_buffers.indices, self.graph_page_ids
        )

    def cuda_graph_prologue(self, forward_batch: ForwardBatch) -> None:
        """In the graph, before the layers: the page ids of the static batch's contexts into
        the graph's buffer (the replay's plan computed only the host tables)."""
        if self.graph_page_ids:
            fb = forward_batch
            assert self.graph_buffers is not None and page_ids is not None
            page_ids(fb.req_to_token, fb.req_pool_indices, fb.seq_lens, self.page_size,
                     self.graph_buffers.indices)  # fmt: skip

    def _verify_wrappers(self, bs: int) -> tuple[Any, Any]:
        """(full, windowed) paged prefill wrappers a verify graph of `bs` requests captures,
        None for the attention the model lacks."""
        assert self.verify_buffers is not None and self.graph_buffers is not None, (
            "init_verify_cuda_graph_state was not called"
        )
        qo_indptr, indptr, last_page_len = self.verify_buffers
        with torch.inference_mode(False):
            make = functools.partial(
                self.fi.BatchPrefillWithPagedKVCacheWrapper, self.workspace, "NHD",
                use_cuda_graph=True, qo_indptr_buf=qo_indptr[: bs + 1],
                paged_kv_indptr_buf=indptr[: bs + 1],
                paged_kv_indices_buf=self.graph_buffers.indices,
                paged_kv_last_page_len_buf=last_page_len[:bs], backend=KERNEL_BACKEND,
            )  # fmt: skip
            return (make() if self.full_layers else None), (
                make() if self.window_left >= 0 else None
            )
