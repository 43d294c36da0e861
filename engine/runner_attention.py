"""The model runner's choice and construction of its attention backend (a mixin of
`ModelRunner`, engine/model_runner.py): flashinfer, Triton or torch_native, one per phase
where prefill and decode differ (engine/attention/hybrid_attn.py), wrapped for sliding-window
layers (engine/attention/hybrid_swa.py)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.attention.base import AttentionBackend, create_attention_backend

logger = logging.getLogger(__name__)


class RunnerAttention:
    args: Any
    model_config: Any
    dtype: torch.dtype
    device: torch.device
    kv_pool: Any
    page_size: int
    swa_window: int | None
    allocator: Any

    def _make_attention_backend(self, swa_layers: frozenset[int]) -> AttentionBackend:
        prefill, decode = self._attention_backend_names()

        def make_one(name: str) -> AttentionBackend:
            return create_attention_backend(
                name,
                device=self.device,
                model_config=self.model_config,
                kv_pool=self.kv_pool,
                page_size=self.page_size,
                decode_tensor_cores=self.args.flashinfer_decode_tensor_cores,
                num_kv_splits=self.args.triton_attention_num_kv_splits,
                fused_merge=self.args.triton_decode_merge == "fused",
            )

        def make() -> AttentionBackend:
            if prefill == decode:
                return make_one(prefill)
            from engine.attention.hybrid_attn import HybridAttnBackend

            return HybridAttnBackend(make_one(prefill), make_one(decode))

        if prefill != decode:
            logger.info("attention backends: %s prefill, %s decode", prefill, decode)

        if self.swa_window is None:
            return make()
        from engine.attention.hybrid_swa import HybridSWABackend

        full = make() if len(swa_layers) < self.model_config.num_layers else None
        return HybridSWABackend(full, make(), self.allocator)

    def _attention_backend_names(self) -> tuple[str, str]:
        """(prefill, decode) backends: each phase's own flag when given, else
        `_attention_backend_name`'s choice, except that where that choice is flashinfer by
        default (no backend named), decode takes Triton's kernel when Triton runs compiled.
        On the H100 (benchmarks/results/gpu_decode_backends.json, Llama-3.2-1B shape, bf16)
        Triton's decode step took 0.84-0.91x flashinfer's from batch 8 at 8k tokens to batch
        256 at 512, 1.07x at batch 1 over 8k, and its graph replays plan nothing on the host;
        prefill stays flashinfer's. Where Triton cannot read the cache (float8 e4m3 before
        sm_89), decode stays flashinfer's. A model with attention sinks (gpt-oss) runs on
        Triton where no backend is named (torch_native on CPU), and flashinfer is refused:
        those two and torch_native compute the sinks. With draft trees
        (speculative_eagle_topk > 1) prefill takes Triton's kernel too where decode does: the
        model's verify steps are extends, and flashinfer's have no tree masks here."""
        if self._has_attention_sinks():
            args = self.args
            named = {args.attention_backend, args.prefill_attention_backend,
                     args.decode_attention_backend}  # fmt: skip
            if "flashinfer" in named:
                raise ValueError(
                    "this model's attention has sinks (gpt-oss), which the triton and "
                    "torch_native backends compute, not flashinfer"
                )
            name = args.resolved_attention_backend
            name = "triton" if name == "flashinfer" else name
            return args.prefill_attention_backend or name, args.decode_attention_backend or name
        name = self._attention_backend_name()
        prefill = decode = name
        if name == "flashinfer" and not self.args.attention_backend:
            from kernels.jit import HAS_TRITON, interpreting

            if HAS_TRITON and not interpreting():
                from engine.attention.triton_backend import float8_loads

                # (an e4m3 cache before sm_89 stays on flashinfer, which reads it)
                if float8_loads(self.kv_pool.dtype, torch.device(self.device)):
                    decode = "triton"
                    if self.args.speculative_algorithm and self.args.speculative_eagle_topk > 1:
                        prefill = "triton"  # (draft trees' verify steps: its tree masks)
        args = self.args
        return args.prefill_attention_backend or prefill, args.decode_attention_backend or decode

    def _has_attention_sinks(self) -> bool:
        model = getattr(self, "model", None)
        if model is None:  # (a host-only runner: the config says it)
            hf_config = getattr(self.model_config, "hf_config", None)
            return getattr(hf_config, "model_type", None) == "gpt_oss"
        return any(getattr(m, "sinks", None) is not None for m in model.modules())

    def _attention_backend_name(self) -> str:
        """`attention_backend` when given; by default flashinfer on CUDA where it can run this
        model (installed, fp16/bf16, a head size it compiles, at most one sliding window), else
        triton; torch_native on CPU."""
        name = self.args.resolved_attention_backend
        if self.args.attention_backend or name != "flashinfer":
            return name
        from engine.attention import flashinfer_support as fi

        head_dim = self.model_config.head_dim
        if not fi.flashinfer_available():
            why = "flashinfer is not installed"
        elif self.dtype not in fi.SUPPORTED_DTYPES:
            why = f"flashinfer has no {self.dtype} kernels"
        elif head_dim not in fi.SUPPORTED_HEAD_DIMS:
            why = f"flashinfer has no head_dim {head_dim} kernels"
        elif len(self.model_config.sliding_window_sizes) > 1:
            why = "the model has several sliding windows"
        else:
            return "flashinfer"
        logger.info("attention backend: triton (%s)", why)
        return "triton"
