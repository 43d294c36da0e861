"""Owns the model and the device memory; turns a ModelWorkerBatch into a forward + sample."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention.base import create_attention_backend
from engine.config import EngineArgs, ModelConfig, resolve_dtype
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.loader import load_model
from engine.mem_cache.allocator import TokenToKVPoolAllocator
from engine.mem_cache.kv_pool import KVPool
from engine.mem_cache.memory_pool import ReqToTokenPool
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.scheduler.schedule_batch import ModelWorkerBatch

logger = logging.getLogger(__name__)

# Without --max-total-tokens on CPU, the KV pool gets this many bytes, and at most this many
# tokens (a tiny model would otherwise get millions of slots it never uses).
DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_CPU_KV_TOKENS = 1 << 17


@dataclass
class GenerationBatchResult:
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B]
    top_logprobs: list[tuple[list[int], list[float]]] | None = None


class ModelRunner:
    def __init__(self, model_config: ModelConfig, args: EngineArgs) -> None:
        self.model_config = model_config
        self.args = args
        self.device = torch.device(args.device)
        config_dtype = getattr(model_config.hf_config, "torch_dtype", None) or getattr(
            model_config.hf_config, "dtype", None
        )
        self.dtype = resolve_dtype(args.dtype, str(config_dtype).replace("torch.", ""))
        if self.device.type == "cpu" and args.dtype == "auto":
            self.dtype = torch.float32
        torch.manual_seed(args.random_seed)
        self.model = load_model(model_config, self.dtype, self.device)
        self.page_size = args.page_size
        self.max_total_tokens = self._kv_budget_tokens()
        mc = model_config
        self.req_to_token_pool = ReqToTokenPool(
            args.max_running_requests + 1, mc.context_len + 8, self.device
        )
        self.allocator = TokenToKVPoolAllocator(self.max_total_tokens, self.page_size, self.device)
        self.kv_pool = KVPool(
            self.max_total_tokens + self.page_size,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
            self.page_size,
        )
        self.attn_backend = create_attention_backend(
            args.resolved_attention_backend,
            device=self.device,
            model_config=mc,
            kv_pool=self.kv_pool,
            page_size=self.page_size,
        )
        self.sampler = Sampler(seed=args.random_seed, device=self.device)
        logger.info("KV pool: %d tokens, page size %d", self.max_total_tokens, self.page_size)

    def _kv_budget_tokens(self) -> int:
        mc = self.model_config
        per_token = KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)
        if self.args.max_total_tokens is not None:
            tokens = self.args.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            usable = free - total * (1 - self.args.mem_fraction_static)
            tokens = int(max(usable, 0) // per_token)
        else:
            tokens = min(DEFAULT_CPU_KV_BYTES // per_token, DEFAULT_CPU_KV_TOKENS)
        tokens = tokens // self.page_size * self.page_size
        if tokens < 2 * self.page_size:
            raise ValueError(f"max_total_tokens: KV pool too small ({tokens} tokens)")
        return tokens

    # -- batches --------------------------------------------------------------------------------
    def build_forward_batch(self, mwb: ModelWorkerBatch) -> ForwardBatch:
        dev = self.device

        def i64(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=dev)

        extend = mwb.forward_mode == ForwardMode.EXTEND
        start_loc = None
        if extend:
            lens = i64(mwb.extend_seq_lens)
            start_loc = torch.cumsum(lens, 0) - lens
        fb = ForwardBatch(
            forward_mode=mwb.forward_mode,
            batch_size=mwb.batch_size,
            input_ids=i64(mwb.input_ids),
            positions=i64(mwb.positions) if extend else i64(mwb.positions),
            out_cache_loc=mwb.out_cache_loc.to(dev, torch.int64),
            req_pool_indices=i64(mwb.req_pool_indices),
            seq_lens=i64(mwb.seq_lens),
            seq_lens_cpu=list(mwb.seq_lens),
            req_to_token=self.req_to_token_pool.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            extend_prefix_lens_cpu=mwb.extend_prefix_lens,
            extend_seq_lens_cpu=mwb.extend_seq_lens,
            extend_start_loc=start_loc,
        )
        return fb

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        info = SamplingBatchInfo.from_params(
            mwb.sampling_params,
            self.model_config.vocab_size,
            self.device,
            output_ids=mwb.output_ids,
            input_ids=mwb.prompt_ids,
            step_positions=[len(o) for o in mwb.output_ids],
        )
        out = self.sampler(logits, info, mwb.return_logprob, mwb.top_logprobs_nums)
        return GenerationBatchResult(out.next_token_ids, out.logprobs, out.top_logprobs)

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        logits = self.forward(self.build_forward_batch(mwb))
        return self.sample(logits, mwb)
