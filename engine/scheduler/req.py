"""One generation request as the scheduler sees it (CPU state only, no model tensors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.mem_cache.base import cache_namespace, namespaced
from engine.sampling.sampling_params import SamplingParams

# SGLang clips a request's remaining max_new_tokens at this when estimating memory needs, so
# one request asking for a huge budget does not block admission of everything else.
CLIP_MAX_NEW_TOKENS = 4096


@dataclass(frozen=True)
class FinishReason:
    """`type` is "stop" (EOS, stop token or stop string: `matched`), "length" (the limit
    reached: `length`) or "abort" (`message`). `to_dict` is SGLang's JSON form."""

    type: str
    matched: int | str | None = None
    message: str | None = None
    length: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return finish_reason_dict(self.type, self.matched, self.message, self.length)


def finish_reason_dict(
    type: str, matched: int | str | None, message: str | None, length: int | None
) -> dict[str, Any]:
    """As SGLang's `meta_info.finish_reason`: {"type": "stop", "matched": 2},
    {"type": "length", "length": 16}, {"type": "abort", "message": "..."}."""
    out: dict[str, Any] = {"type": type}
    if type == "stop":
        out["matched"] = matched
    if type == "length" and length is not None:
        out["length"] = length
    if message is not None:
        out["message"] = message
    return out


class Req:
    """A request's lifetime: waiting → (chunked) prefill → decode → finished, possibly
    retracted back to waiting.

    KV invariants: `req_to_token[req_pool_idx, :kv_allocated_len]` hold this request's slots;
    the first `len(prefix_indices)` are shared with the prefix cache (locked via `last_node`),
    the rest are owned by the request alone. `fill_ids` are the tokens whose KV exists (or is
    computed by the batch being built).
    """

    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival: int = 0,
        priority: int = 0,
        lora_id: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.rid = rid
        self.priority = priority  # with priority scheduling (EngineArgs)
        self.lora_id = lora_id  # the LoRA adapter it runs with (0: the base model)
        # its prefix-cache namespace: K/V is shared only with requests of the same adapter
        # (whose K/V differ from the base model's and other adapters' for the same tokens)
        # and the same cache salt (mem_cache/base.py)
        self.cache_namespace = cache_namespace(lora_id, cache_salt)
        self.origin_input_ids = origin_input_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        self.stop_strs = tuple(sampling_params.stop_strs)  # (read every step: made once)
        # A stop string spans at most len(stop) tokens (each token decodes to >= 1 char, or
        # part of one); one more token covers a character split across tokens.
        self.stop_window = max(map(len, self.stop_strs), default=0) + 1
        # `check_finished`'s quick test (every request, every step; see `quick_limit`): the
        # tokens that end the request once it may stop, and the output length below which
        # nothing else can (-1: not computed yet)
        eos = frozenset() if sampling_params.ignore_eos else self.eos_token_ids
        self.finish_tokens = self.stop_token_ids | eos
        self.quick_len = -1
        self.arrival = arrival
        self.output_ids: list[int] = []
        # structured output: the matcher of `output_ids` (engine/sampling/grammar.py)
        self.grammar: Any = None
        self.finished_reason: FinishReason | None = None
        self.to_abort: FinishReason | None = None
        # memory state
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.last_node: Any = None
        # hierarchical cache: tokens of the prefix in host memory past `prefix_indices`, down
        # to `host_node` (loaded back when the request is admitted); the cache's `epoch` at
        # the match
        self.host_hit_len = 0
        self.host_node: Any = None
        self.match_epoch = -1
        self.fill_ids: list[int] = []
        self.kv_allocated_len = 0
        self.extend_input_len = 0
        # hybrid sliding-window memory (MemoryPools.release_swa_window): the first new
        # position of the last batch prepared for the request, and where its own tokens'
        # window KV has been freed up to
        self.swa_batch_start: int | None = None
        self.swa_released = 0
        self.swa_prefix_released = False  # its window lock on the cached prefix is dropped
        # an embedding model's pooled states so far (engine/pooling.py PooledState)
        self.embedding: Any = None
        # an encoder's token types, one per prompt token (a BERT pair's second text: 1);
        # None: all 0
        self.token_type_ids: list[int] | None = None
        # speculative decoding's copy of the tokens: (int64 array, tokens in it)
        self.spec_tokens: tuple[Any, int] = (None, 0)
        # bookkeeping
        self.cached_tokens = 0
        self.is_retracted = False
        self.num_retractions = 0
        self.logprobs: list[float] = []
        self.top_logprobs: list[tuple[list[int], list[float]]] = []
        # Prompt logprobs (return_logprob with 0 <= logprob_start_len < prompt length): those
        # of prompt positions `prompt_logprob_first`... (position 0 has none), computed from
        # the logits of the position before each. `prompt_logprob_cursor` is the first of
        # those logit positions no batch has been built for yet.
        self.prompt_logprob_start: int | None = None
        start = sampling_params.logprob_start_len
        if sampling_params.return_logprob and 0 <= start < len(origin_input_ids):
            self.prompt_logprob_start = start
        self.prompt_logprob_cursor = max(start, 1) - 1
        self.prompt_token_logprobs: list[float] = []
        self.prompt_token_ranks: list[int] = []  # vLLM's rank of each
        self.prompt_top_logprobs: list[tuple[list[int], list[float]]] = []

    # -- inputs for the next round ------------------------------------------------------------
    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def prompt_logprob_first(self) -> int:
        """The first prompt position with a logprob (the start, but not position 0)."""
        return max(self.prompt_logprob_start or 0, 1)

    def prompt_logprob_rows(self, prefix_len: int, seq_len: int) -> range:
        """Positions among the new tokens [prefix_len, seq_len) of a prefill whose logits
        give prompt logprobs still to compute; advances the cursor past them."""
        if self.prompt_logprob_start is None:
            return range(0)
        rows = range(max(prefix_len, self.prompt_logprob_cursor), min(seq_len, self.prompt_len - 1))
        self.prompt_logprob_cursor = max(self.prompt_logprob_cursor, rows.stop)
        return rows

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    def init_next_round_input(self, tree_cache: Any) -> None:
        """Match the prefix cache for a (re-)prefill of everything known so far. At least one
        token is always left to compute, since its logits give the next token; and the prefix
        stops where prompt logprobs still need logits (a cached prefix computes none)."""
        self.fill_ids = self.all_ids()
        m = tree_cache.match(self.prefix_key())
        self.prefix_indices, self.last_node = m.slots, m.node
        self.host_hit_len, self.host_node = m.host_len, m.host_node
        self.match_epoch = tree_cache.epoch
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def prefix_key(self) -> list[int]:
        """The prefix-cache key `fill_ids` may reuse a prefix of (see above)."""
        limit = len(self.fill_ids) - 1
        cursor = self.prompt_logprob_cursor
        if self.prompt_logprob_start is not None and cursor < self.prompt_len - 1:
            limit = min(limit, cursor)
        return namespaced(self.fill_ids[:limit], self.cache_namespace)

    def reset_for_retract(self) -> None:
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.host_hit_len, self.host_node = 0, None
        self.req_pool_idx = None
        self.kv_allocated_len = 0
        self.fill_ids = []
        self.extend_input_len = 0
        self.swa_batch_start = None
        self.swa_released = 0
        self.swa_prefix_released = False
        self.is_retracted = True
        self.num_retractions += 1
        # results of batches in flight for this request are dropped (see the overlap
        # scheduler): prompt logprobs not received yet are computed again
        self.prompt_logprob_cursor = self.prompt_logprob_first - 1 + len(self.prompt_token_logprobs)

    # -- finishing ----------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def remaining_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens - len(self.output_ids)

    def check_finished(self, context_len: int, tokenizer: Any | None) -> None:
        """Decide whether the last appended token ends the request (SGLang's order)."""
        if self.finished_reason is not None:
            return
        if self.to_abort is not None:
            self.finished_reason = self.to_abort
            return
        params = self.sampling_params
        output_ids = self.output_ids  # (every request, every step: read once)
        n = len(output_ids)
        if n >= params.max_new_tokens:
            if params.max_new_tokens == 0:  # the prompt only (for its logprobs): no output
                del output_ids[:], self.logprobs[:], self.top_logprobs[:]
            self.finished_reason = FinishReason("length", length=params.max_new_tokens)
            return
        if n and n >= params.min_new_tokens:
            last = output_ids[-1]
            if self.grammar is not None and self.grammar.is_terminated():
                self.finished_reason = FinishReason("stop", last)  # its stop token, ignore_eos
                return  # or not: a complete grammar allows nothing else
            if last in self.stop_token_ids or (
                not params.ignore_eos and last in self.eos_token_ids
            ):
                self.finished_reason = FinishReason("stop", last)
                return
            if self.stop_strs and tokenizer is not None:
                matched = self._match_stop_str(tokenizer)
                if matched is not None:
                    self.finished_reason = FinishReason("stop", matched)
                    return
        if len(self.origin_input_ids) + n >= context_len:
            self.finished_reason = FinishReason("length", length=context_len)

    def quick_limit(self, context_len: int) -> int:
        """The output length below which only a token of `finish_tokens` can end the request
        (`check_finished` finds nothing else to do): its max_new_tokens or the context's
        end, whichever comes first; 0 (no quick test) with stop strings, which only the full
        check matches. A grammar or an abort is the caller's to test."""
        if self.quick_len < 0:
            room = context_len - len(self.origin_input_ids)
            limit = min(self.sampling_params.max_new_tokens, room)
            self.quick_len = 0 if self.stop_strs else max(limit, 0)
        return self.quick_len

    def _match_stop_str(self, tokenizer: Any) -> str | None:
        tail = tokenizer.decode(self.output_ids[-self.stop_window :], skip_special_tokens=False)
        for s in self.stop_strs:
            if s in tail:
                return s
        return None
