"""`PrefillAdder`: which waiting requests join the next prefill batch, under the memory,
prefill-token, chunk, sliding-window and LoRA budgets."""

from __future__ import annotations

from enum import Enum, auto
from typing import Any

from engine.scheduler.req import CLIP_MAX_NEW_TOKENS, Req
from engine.scheduler.schedule_batch import swa_request_cap


class AddResult(Enum):
    CONTINUE = auto()  # admitted; keep going
    NO_TOKEN = auto()  # the memory budget is exhausted
    OTHER = auto()  # a per-batch limit (prefill tokens, chunk) is reached
    SKIP = auto()  # not this request (its LoRA adapter has no slot); later ones may go


class PrefillAdder:
    """Admits requests into one prefill batch while the budgets hold.

    rem_total_tokens: free + evictable KV tokens minus what running requests will still need
        (remaining max_new_tokens, clipped, × new_token_ratio); each admitted request takes its
        new input tokens plus its own clipped max_new_tokens.
    rem_input_tokens: max_prefill_tokens for the whole batch (one request may exceed it alone).
    rem_chunk_tokens: chunked_prefill_size; a request that does not fit is cut to a chunk.
    rem_swa_tokens (hybrid sliding-window memory only): the same for the window pool, where
        a request takes its new input tokens (freed by the next batch once out of the window)
        plus at most a window of output (`swa_request_cap`); None without it.
    Both input budgets leave room for `mixed_decode_tokens`, the running requests' tokens
    that a mixed batch also carries.
    lora_slots (LoRA serving only): the adapters one batch may use. Once the running
        requests' adapters (`running_loras`) and the admitted ones are that many, a request of
        another adapter is not admitted (`SKIP`: the scheduler passes it over, as SGLang and
        vLLM do, so that requests of adapters in slots behind it still go).
    """

    def __init__(
        self,
        pools: Any,
        running_need: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        max_new_reqs: int,
        mixed_decode_tokens: int = 0,
        running_swa_need: float = 0.0,
        lora_slots: int | None = None,
        running_loras: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        self.pools = pools
        self.lora_slots = lora_slots
        self.loras = set(running_loras) - {0}
        self.page_size = pools.page_size
        tc = pools.tree_cache
        self.rem_total_tokens = (
            pools.allocator.available_size() + tc.evictable_size() - running_need
        )
        self.rem_input_tokens = max_prefill_tokens - mixed_decode_tokens
        self.rem_chunk_tokens = (
            None if chunked_prefill_size is None else chunked_prefill_size - mixed_decode_tokens
        )
        self.max_new_reqs = max_new_reqs
        self.rem_swa_tokens: float | None = None
        self.swa_cap = swa_request_cap(pools)
        if pools.sliding_window is not None:
            self.rem_swa_tokens = (
                pools.allocator.swa_available_size() + tc.swa_evictable_size() - running_swa_need
            )
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None

    def _ceil_page(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def _swa_need(self, input_len: int, max_new: int) -> int:
        return self._ceil_page(input_len) + min(max_new, self.swa_cap)

    def _no_swa_room(self, input_len: int, max_new: int) -> bool:
        rem = self.rem_swa_tokens
        return rem is not None and self._swa_need(input_len, max_new) >= rem

    def _take(self, input_len: int, max_new: int) -> None:
        self.rem_total_tokens -= self._ceil_page(input_len) + max_new
        if self.rem_swa_tokens is not None:
            self.rem_swa_tokens -= self._swa_need(input_len, max_new)
        self.rem_input_tokens -= input_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= input_len

    def _lock(self, req: Req) -> tuple[float, float]:
        """Lock the request's cached prefix; what was evictable before is no longer free.
        Returns what it took off the (total, window) budgets, for `_unlock`."""
        tc = self.pools.tree_cache
        hybrid = self.rem_swa_tokens is not None
        before, swa_before = tc.evictable_size(), tc.swa_evictable_size() if hybrid else 0
        tc.inc_lock_ref(req.last_node)
        charged = before - tc.evictable_size()
        swa_charged = swa_before - tc.swa_evictable_size() if hybrid else 0
        self.rem_total_tokens -= charged
        if self.rem_swa_tokens is not None:
            self.rem_swa_tokens -= swa_charged
        return charged, swa_charged

    def _unlock(self, req: Req, charged: tuple[float, float], result: AddResult | None):
        """Undo `_lock` (the request is not admitted); returns `result`."""
        self.pools.tree_cache.dec_lock_ref(req.last_node)
        self.rem_total_tokens += charged[0]
        if self.rem_swa_tokens is not None:
            self.rem_swa_tokens += charged[1]
        return result

    def _no_lora_slot(self, req: Req) -> bool:
        if self.lora_slots is None or not req.lora_id or req.lora_id in self.loras:
            return False
        return len(self.loras) >= self.lora_slots

    def _admit(self, req: Req) -> None:
        self.can_run_list.append(req)
        if req.lora_id:
            self.loras.add(req.lora_id)

    def add_chunked_req(self, req: Req) -> Req | None:
        """Continue a prompt cut in an earlier round; returns it if it is still unfinished."""
        remaining = req.seqlen - req.kv_allocated_len
        n = remaining if self.rem_chunk_tokens is None else min(remaining, self.rem_chunk_tokens)
        if n < remaining:
            n = max(self.page_size, n // self.page_size * self.page_size)
        req.fill_ids = req.all_ids()[: req.kv_allocated_len + n]
        req.extend_input_len = n
        self._admit(req)
        truncated = n < remaining
        self._take(n, 0 if truncated else min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS))
        return req if truncated else None

    def add_one_req(self, req: Req) -> AddResult:
        if len(self.can_run_list) >= self.max_new_reqs:
            return AddResult.OTHER
        if self._no_lora_slot(req):
            return AddResult.SKIP
        max_new = min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS)
        # Lock the cached prefix first: what the lock protects stops being evictable, so the
        # budget must hold the request without it (SGLang checks inside its lock too). Each
        # way out that does not admit the request unlocks it again.
        charged = self._lock(req)
        if self._ceil_page(req.extend_input_len) + max_new >= self.rem_total_tokens:
            return self._unlock(req, charged, AddResult.NO_TOKEN)
        if req.host_hit_len:
            # hierarchical cache: its prefix's host part comes back to the device instead of
            # being computed (the device memory it takes is charged by the new lock)
            charged = self._load_back(req, charged)
        input_len = req.extend_input_len
        if input_len > self.rem_input_tokens and self.can_run_list:
            return self._unlock(req, charged, AddResult.OTHER)
        chunk = self.rem_chunk_tokens
        if self._no_swa_room(input_len if chunk is None else min(input_len, chunk), max_new):
            return self._unlock(req, charged, AddResult.NO_TOKEN)
        if chunk is None or input_len <= chunk:
            self._admit(req)
            self._take(input_len, max_new)
            return AddResult.CONTINUE
        trunc = chunk // self.page_size * self.page_size
        if trunc <= 0:
            return self._unlock(req, charged, AddResult.OTHER)
        prefix_len = len(req.prefix_indices)
        req.extend_input_len = trunc
        req.fill_ids = req.fill_ids[: prefix_len + trunc]
        self._admit(req)
        self.new_chunked_req = req
        self._take(trunc, 0)
        return AddResult.OTHER

    def _load_back(self, req: Req, charged: tuple[float, float]) -> tuple[float, float]:
        """Load the host part of the request's prefix (`PrefixCache.load_back`) and move its
        lock to the deeper prefix; returns what its lock now charges."""
        self._unlock(req, charged, None)  # (the cache locks what it needs while it loads)
        self.pools.tree_cache.load_back(req)
        req.extend_input_len = len(req.fill_ids) - len(req.prefix_indices)
        return self._lock(req)
