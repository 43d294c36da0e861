"""The draft model's runner and its memory (engine/speculative/draft_model.py drafts with
it; an EAGLE head's runner, engine/speculative/eagle.py, is built from the same arguments):
its engine arguments, its rows and pool, and what it takes of the model's KV budget on a
GPU."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch

from engine.speculative import EAGLE_ALGORITHMS

if TYPE_CHECKING:
    from engine.config import EngineArgs, ModelConfig

logger = logging.getLogger(__name__)


def draft_args(
    args: EngineArgs, max_total_tokens: int | None, dtype: str | torch.dtype
) -> EngineArgs:
    """The draft model's engine arguments: the model's, less what is the model's alone
    (speculation, LoRA, quantization flags, overrides, tensor parallelism, cache tiers)."""
    return dataclasses.replace(
        args,
        model_path=args.speculative_draft_model_path,
        dtype=dtype,
        page_size=1,
        max_total_tokens=max_total_tokens,
        max_running_requests=draft_rows(args),
        context_length=None,
        hf_overrides=None,
        quantization=None,
        kv_cache_dtype="auto",
        enable_hierarchical_cache=False,
        hybrid_swa_memory=False,
        lora_paths=(),
        enable_lora=False,
        is_embedding=False,
        pooling_type=None,
        speculative_algorithm=None,
        speculative_draft_model_path=None,
        tp_size=1,
        ep_size=1,
        nnodes=1,
        node_rank=0,
        dist_init_addr=None,
    )


# leaf rows of a draft runner's table at most (each as long as the context): what a tree
# forward's largest decode graph takes by default
MAX_LEAF_ROWS = 256


def draft_rows(args: EngineArgs) -> int:
    """The draft runner's requests: the model's, and with draft trees rows of its table for
    the leaves (`DraftModelDrafter._tree_forwards`): topk a request, at most as many as its
    largest decode graph has rows (a forward with more leaves runs eagerly over a table of
    its own)."""
    m, topk = args.max_running_requests, args.speculative_eagle_topk
    if topk == 1:
        return m
    cap = max(args.cuda_graph_bs) if args.cuda_graph_bs else MAX_LEAF_ROWS
    return m + min(m * topk, cap)


def draft_pool_tokens(target_tokens: int, args: EngineArgs) -> int:
    """The draft pool's tokens: the model's, plus the last drafts of every running request
    (with draft trees, the leaves of its forwards: topk a forward)."""
    per_request = args.speculative_num_draft_tokens
    if args.speculative_eagle_topk > 1:
        per_request = max(per_request, args.speculative_eagle_topk
                          * ((args.speculative_num_steps or per_request) - 1))  # fmt: skip
    return target_tokens + args.max_running_requests * per_request


def make_draft_runner(args: EngineArgs, runner: Any) -> Any:
    from engine.config import ModelConfig
    from engine.model_runner import ModelRunner

    path = args.speculative_draft_model_path
    config = ModelConfig.from_pretrained(path)
    dtype = str(runner.dtype).replace("torch.", "")
    tokens = draft_pool_tokens(runner.max_total_tokens, args)
    # (its catch-up extends, of at most k + 1 tokens a request after the first, replay the
    # verify graphs of that width: DraftModelDrafter._extend)
    width = args.speculative_num_draft_tokens + 1
    draft = ModelRunner(config, draft_args(args, tokens, dtype), verify_graph_width=width)
    logger.info(
        "draft model %s: %d layers, KV pool of %d tokens", path, config.num_layers, tokens
    )
    return draft


def draft_memory(args: EngineArgs, dtype: torch.dtype, target: ModelConfig) -> tuple[int, int]:
    """(bytes the draft takes whatever the model's pool, bytes of its K/V per token of the
    model's pool) in `dtype`, for the model's KV budget on a GPU: its weights (counted as
    its checkpoint tensors' size: an upper bound where they are stored wider than the dtype
    they run in) and its pool's tokens beyond the model's (`draft_pool_tokens`); an EAGLE head's
    too, what `eagle.head_memory` adds."""
    from engine.config import ModelConfig
    from engine.loader import checkpoint_bytes
    from engine.mem_cache.kv_pool import KVPool

    if args.speculative_algorithm in EAGLE_ALGORITHMS:
        from engine.speculative.eagle import head_model_config

        mc = head_model_config(args)  # (an MTP head: one layer of the model's checkpoint)
    else:
        mc = ModelConfig.from_pretrained(args.speculative_draft_model_path)
    weights = checkpoint_bytes(mc)
    per_token = KVPool.bytes_per_token(
        mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, mc.kv_shared
    )
    fixed = weights + draft_pool_tokens(0, args) * per_token
    if args.speculative_algorithm in EAGLE_ALGORITHMS:
        from engine.speculative.eagle import head_memory

        more_fixed, more_per_token = head_memory(args, dtype, target)
        fixed, per_token = fixed + more_fixed, per_token + more_per_token
    return fixed, per_token
