"""`HybridAttnBackend`: one backend for prefill (EXTEND batches), another for decode.

SGLang's `--prefill-attention-backend` / `--decode-attention-backend`. The two share the KV
pool (every backend reads and writes it through `req_to_token` and `out_cache_loc`), so a
request prefilled by one decodes with the other. Each batch goes to one of them:

* DECODE batches, and the CUDA graphs of decode steps, to `decode`;
* EXTEND batches (prefill and its chunks, mixed chunks, speculative verify steps) to
  `prefill`, and so the CUDA graphs of verify steps (engine/speculative/verify_graphs.py).

Why: the best kernel differs by phase. On the H100, flashinfer's paged prefill is the
faster prefill, while at batch 1 Triton's split-K decode kernel took 5.5 us per layer
against flashinfer's 12.2 (its tensor-core decode plus the merge of its splits), and a
Triton decode replay plans nothing on the host (benchmarks/gpu_session.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend, AttentionLayer

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch


class HybridAttnBackend(AttentionBackend):
    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.prefill = prefill
        self.decode = decode
        self.supports_cuda_graph = decode.supports_cuda_graph
        self.supports_verify_cuda_graph = prefill.supports_verify_cuda_graph
        self.supports_tree_mask = prefill.supports_tree_mask  # (verify steps are extends)
        self.cuda_graph_seq_len_fill_value = decode.cuda_graph_seq_len_fill_value
        self.active: AttentionBackend | None = None  # the one planned for the current batch

    def _for(self, forward_batch: ForwardBatch) -> AttentionBackend:
        return self.decode if forward_batch.forward_mode.is_decode() else self.prefill

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.active = self._for(forward_batch)
        self.active.init_forward_metadata(forward_batch)
        self.metadata = self.active.metadata

    # -- CUDA graphs (decode steps: `decode`'s; verify steps: `prefill`'s) ---------------------
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        self.decode.init_cuda_graph_state(max_bs, max_context_len)

    def init_verify_cuda_graph_state(self, max_bs: int, width: int, max_context_len: int) -> None:
        self.prefill.init_verify_cuda_graph_state(max_bs, width, max_context_len)

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        backend = self._for(forward_batch)
        backend.init_forward_metadata_capture_cuda_graph(forward_batch)
        self.active, self.metadata = backend, backend.metadata

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        backend = self._for(forward_batch)
        backend.init_forward_metadata_replay_cuda_graph(forward_batch)
        self.active, self.metadata = backend, backend.metadata

    def cuda_graph_prologue(self, forward_batch: ForwardBatch) -> None:
        self._for(forward_batch).cuda_graph_prologue(forward_batch)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        backend = self.active
        assert backend is not None, "init_forward_metadata was not called for this batch"
        assert backend is self._for(forward_batch), "the batch is not the one planned"
        return backend.forward(q, k, v, layer, forward_batch, kv_stored)

    def kv_store_target(
        self, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        return self._for(forward_batch).kv_store_target(layer, forward_batch)

    def _attend(self, *args: object) -> torch.Tensor:  # pragma: no cover - forward routes
        raise NotImplementedError
