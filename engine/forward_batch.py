"""The device-side view of one forward pass.

Data flow (as in SGLang):

    ScheduleBatch   (scheduler; Python objects, requests, CPU index lists)
        -> ModelWorkerBatch  (exactly what one forward needs; plain lists + index tensors)
        -> ForwardBatch      (device tensors; built by the model runner, read by layers
                              and attention backends)

Token layout of a batch: the new tokens of all requests are packed back to back
(`input_ids`, `positions`, `out_cache_loc` are all of length `num_tokens`). For EXTEND,
request i contributes `extend_seq_lens[i]` tokens starting at `extend_start_loc[i]`; it
already has `extend_prefix_lens[i]` tokens in the KV cache (a radix hit or an earlier
prefill chunk). For DECODE every request contributes one token.

`req_to_token[req_pool_indices[i], :seq_lens[i]]` are the KV slots of request i after this
forward (prefix + new tokens); the backend writes new K/V at `out_cache_loc` first.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.attention.base import AttentionBackend
    from engine.mem_cache.kv_pool import KVPool


class ForwardMode(IntEnum):
    EXTEND = 1  # prefill, possibly on top of a cached prefix, possibly one chunk of a prompt
    DECODE = 2  # one new token per request
    IDLE = 3  # nothing to run

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot for each new token
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, length after this forward
    seq_lens_cpu: list[int]
    req_to_token: torch.Tensor  # [pool_rows, max_context_len] int32 (ReqToTokenPool.req_to_token)
    kv_pool: KVPool
    attn_backend: AttentionBackend
    # EXTEND only (for DECODE: prefix = seq_len - 1, extend = 1)
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens_cpu: list[int] | None = None
    extend_start_loc: torch.Tensor | None = None  # [B] int64
    extend_seq_lens: torch.Tensor | None = None  # [B] int64, extend_seq_lens_cpu on the device
    # logits for every position instead of the last of each request (teacher forcing)
    return_all_logits: bool = False
    # EXTEND: packed token indices whose logits follow the last tokens' (prompt logprobs)
    prompt_logprob_rows: torch.Tensor | None = None
    # per request, its LoRA adapter's id (0: the base model); None: no adapter in the batch
    lora_ids: list[int] | None = None
    # an embedding model's pooling ("last", "mean", "cls"): the forward returns each
    # request's pooled final hidden states instead of logits (engine/pooling.py)
    pooling: str | None = None
    # an encoder's token types of the packed tokens (None: all 0; engine/models/bert.py)
    token_type_ids: torch.Tensor | None = None
    # hierarchical cache: K/V copies the forward runs first (ModelWorkerBatch.kv_transfers)
    kv_transfers: list[tuple[str, torch.Tensor, torch.Tensor]] | None = None
    # DECODE built by the model runner: [4, B] int64, the tensor whose rows req_pool_indices,
    # seq_lens, input_ids and positions are (a graph replay loads them with one copy)
    decode_rows: torch.Tensor | None = None
    # DECODE inside a CUDA graph: the graph's [B, >= vocab] buffer, into which the logits
    # processor writes the logits (the lm_head's output in the model's dtype; a float32
    # buffer gets the float32 conversion): no copy after it
    logits_out: torch.Tensor | None = None
    # a speculative verify step (EXTEND, every position's logits): each request's number of
    # drafts, its tokens being its last token and those drafts (engine/speculative/verify.py)
    spec_draft_lens: list[int] | None = None
    # ... whose drafts are trees: each request's parent of every draft (None: chains); the
    # attention backends mask each node's keys to the cached ones and its ancestors
    # (engine/speculative/tree.py)
    spec_parents: list[list[int]] | None = None
    # ... replayed from a verify graph of trees: its static masks (uint8 masks, starts per
    # request, in `tree.packed_masks`' layout), which the graph's kernels read
    spec_tree_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # an EAGLE draft head's forward (engine/models/llama_eagle.py): the hidden states it
    # reads [num_tokens, width], and those it leaves for its next forward [num_tokens, hidden]
    spec_hidden: torch.Tensor | None = None
    spec_hidden_out: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def last_token_indices(self) -> torch.Tensor:
        """Index into the packed tokens of each request's last new token."""
        if self.forward_mode.is_decode():
            return torch.arange(self.batch_size, device=self.input_ids.device)
        assert self.extend_start_loc is not None and self.extend_seq_lens_cpu is not None
        lens = self.extend_seq_lens
        if lens is None:
            lens = torch.tensor(self.extend_seq_lens_cpu, device=self.input_ids.device)
        return self.extend_start_loc + lens - 1
