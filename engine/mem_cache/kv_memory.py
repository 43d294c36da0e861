"""How much KV memory a model runner gets, and in which pools.

Bytes per token are those of the cache's dtype (`kv_cache_dtype`: float8 holds twice the
tokens of bfloat16 in the same memory).

Without `hybrid_swa_memory` (or for a model without sliding windows) every layer's buffers
have one slot per token of the budget. With it, the windowed layers' buffers are
`swa_full_tokens_ratio` as long, and the budget is split so that both fit: full tokens x
(bytes of the full layers + ratio x bytes of the windowed layers) = the bytes available.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import EngineArgs, ModelConfig
from engine.mem_cache.allocator import TokenToKVPoolAllocator
from engine.mem_cache.host_pool import host_pool_tokens
from engine.mem_cache.kv_pool import KVPool
from engine.mem_cache.kv_quant import resolve_kv_cache_dtype
from engine.mem_cache.swa_allocator import SWATokenToKVPoolAllocator
from engine.speculative import EAGLE_ALGORITHMS

# Without --max-total-tokens on CPU, the KV pool gets this many bytes, and at most this many
# tokens (a tiny model would otherwise get millions of slots it never uses).
logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_CPU_KV_TOKENS = 1 << 17


@dataclass
class KVMemory:
    tokens: int  # full slots
    swa_tokens: int  # window slots (0 without hybrid memory)
    swa_window: int | None  # the longest window, with hybrid memory
    swa_layers: frozenset[int]
    kv_dtype: torch.dtype  # what the buffers hold (the model's dtype, or float8)
    host_tokens: int = 0  # the hierarchical cache's host pool (0: none)

    def make_allocator(self, page_size: int, device: torch.device) -> TokenToKVPoolAllocator:
        if self.swa_window is None:
            return TokenToKVPoolAllocator(self.tokens, page_size, device)
        return SWATokenToKVPoolAllocator(self.tokens, self.swa_tokens, page_size, device)

    def make_pool(
        self,
        mc: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        page_size: int,
        kv_scales: dict[int, tuple[float, float]] | None = None,
    ) -> KVPool:
        """The pool; `kv_scales` ({layer: (k_scale, v_scale)}, the checkpoint's) are used by
        a float8 cache and ignored by any other."""
        pool = KVPool(
            self.tokens + page_size,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            dtype,
            device,
            page_size,
            swa_layers=self.swa_layers,
            swa_num_slots=self.swa_tokens + page_size,
            kv_cache_dtype=self.kv_dtype,
            shared=mc.kv_shared,
        )
        if pool.quantized and kv_scales:
            pool.set_scales(kv_scales)
        elif pool.quantized:
            logger.info("%s KV cache: scale 1.0 (the checkpoint has no KV scales)", pool.dtype)
        elif kv_scales:
            logger.info("the checkpoint's KV-cache scales are unused: the cache is %s", pool.dtype)
        return pool


def plan_kv_memory(
    mc: ModelConfig, args: EngineArgs, dtype: torch.dtype, device: torch.device
) -> KVMemory:
    windows = mc.sliding_windows or (None,) * mc.num_layers
    swa_layers = frozenset(i for i, w in enumerate(windows) if w is not None)
    hybrid = args.hybrid_swa_memory and bool(swa_layers)
    ratio = args.swa_full_tokens_ratio if hybrid else 0.0
    num_swa = len(swa_layers) if hybrid else 0
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    per_token = KVPool.bytes_per_token(
        mc.num_layers - num_swa, mc.num_kv_heads, mc.head_dim, kv_dtype, mc.kv_shared
    )
    per_token += ratio * KVPool.bytes_per_token(
        num_swa, mc.num_kv_heads, mc.head_dim, kv_dtype, mc.kv_shared
    )
    ps = args.page_size
    if args.max_total_tokens is not None:
        tokens = args.max_total_tokens
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        usable = free - total * (1 - args.mem_fraction_static)
        draft_per_token = 0
        if args.speculative_draft_model_path is not None:
            # the draft model's weights and its pool (as many tokens, and the last drafts of
            # each running request: engine/speculative/draft_model.py) come out of the budget
            from engine.speculative.draft_runner import draft_memory

            fixed, draft_per_token = draft_memory(args, dtype, mc)
            usable -= fixed
        tokens = int(max(usable, 0) // (per_token + draft_per_token))
    else:
        tokens = min(int(DEFAULT_CPU_KV_BYTES // per_token), DEFAULT_CPU_KV_TOKENS)
    tokens = tokens // ps * ps
    if tokens < 2 * ps:
        raise ValueError(f"max_total_tokens: KV pool too small ({tokens} tokens)")
    if not hybrid:
        host = 0
        if args.enable_hierarchical_cache:
            host_per_token = per_token
            if args.speculative_algorithm in EAGLE_ALGORITHMS:  # (its hidden states go too)
                from engine.speculative.eagle import head_memory

                host_per_token += head_memory(args, dtype, mc)[1]
            host = host_pool_tokens(
                tokens, int(host_per_token), args.hicache_ratio, args.hicache_size, ps
            )
        return KVMemory(tokens, 0, None, frozenset(), kv_dtype, host)
    if args.enable_hierarchical_cache:
        raise ValueError(
            "enable_hierarchical_cache: not with hybrid_swa_memory (the host pool keeps "
            "every layer's K/V; turn one of them off)"
        )
    window = max(mc.sliding_window_sizes)
    swa_tokens = int(tokens * ratio) // ps * ps
    chunk = args.chunked_prefill_size
    chunk = mc.context_len if chunk is None or chunk < 0 else min(chunk, mc.context_len)
    # one prefill chunk, plus a request's window of output and a locked prefix's window
    need = chunk + 2 * (window + 2 * ps)
    if swa_tokens < need:
        raise ValueError(
            f"hybrid_swa_memory: the window pool ({swa_tokens} tokens = "
            f"swa_full_tokens_ratio {ratio} x {tokens}) cannot hold a prefill chunk of {chunk} "
            f"tokens plus two windows of {window} (needs {need}); raise swa_full_tokens_ratio "
            "or the KV budget, or lower chunked_prefill_size"
        )
    return KVMemory(tokens, swa_tokens, window, swa_layers, kv_dtype)
