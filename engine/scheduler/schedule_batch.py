"""Batches on the scheduler side.

ScheduleBatch    a set of requests and the memory operations on them (allocation of
                 request rows and KV slots, retraction, filtering, merging). CPU only.
ModelWorkerBatch the plain data one forward + sampling needs; built by
                 `ScheduleBatch.get_model_worker_batch()`, turned into device tensors
                 (`ForwardBatch`) by the model runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch

from engine.forward_batch import ForwardMode
from engine.host_tensors import int64_rows
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.req import CLIP_MAX_NEW_TOKENS, Req
from engine.speculative.tree import depths

_RETURN_LOGPROB = attrgetter("return_logprob")
_TOP_LOGPROBS_NUM = attrgetter("top_logprobs_num")
_RETURN_PROMPT_RANKS = attrgetter("return_prompt_ranks")

# After a retraction, keep enough memory for this many decode steps of what remains.
RETRACT_DECODE_STEPS = 20


@dataclass
class ModelWorkerBatch:
    forward_mode: ForwardMode
    input_ids: list[int]
    positions: list[int]
    out_cache_loc: torch.Tensor
    req_pool_indices: list[int]
    seq_lens: list[int]
    extend_prefix_lens: list[int] | None
    extend_seq_lens: list[int] | None
    sampling_params: list[SamplingParams]
    output_ids: list[list[int]]  # per request, the tokens generated so far (for penalties)
    prompt_ids: list[list[int]]  # per request, the prompt (for the repetition penalty)
    return_logprob: bool = False
    top_logprobs_nums: list[int] = field(default_factory=list)
    # prompt logprobs (EXTEND; None when no request wants any): the packed token indices
    # whose logits give them, the prompt token each row scores, and the rows per request
    prompt_logprob_rows: list[int] | None = None
    prompt_logprob_targets: list[int] | None = None
    prompt_logprob_counts: list[int] | None = None
    prompt_ranks: bool = False  # with them: their ranks too (a request asked for them)
    # structured output: (rows, token bitmasks) of the grammar rows (engine/sampling/grammar.py),
    # set by the plain scheduler, whose grammars are up to date when it builds the batch
    vocab_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # per request, its LoRA adapter's id (0: the base model); None when no request has one
    lora_ids: list[int] | None = None
    # a speculative verify step (an EXTEND of each request's last token and drafts): the
    # number of drafts of each request (engine/speculative/)
    spec_draft_lens: list[int] | None = None
    # ... whose drafts are trees: each request's parent of every draft (None: chains;
    # engine/speculative/tree.py)
    spec_parents: list[list[int]] | None = None
    # EXTEND of an encoder: each new token's type (None: all 0; engine/models/bert.py)
    token_type_ids: list[int] | None = None
    # hierarchical cache: host <-> device K/V copies to run, in order, before the forward
    # ((kind, source slots, destination slots); engine/mem_cache/host_pool.py)
    kv_transfers: list[tuple[str, torch.Tensor, torch.Tensor]] | None = None
    # DECODE: req_pool_indices, seq_lens, input_ids and positions as the rows of one int64
    # tensor on the pool's device, copied there once by `prepare_for_decode` (which writes
    # the new slots through rows 0 and 3); the model runner's batch takes them as they are
    decode_rows: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.req_pool_indices)


class ScheduleBatch:
    def __init__(self, reqs: list[Req], pools: Any, forward_mode: ForwardMode) -> None:
        """`pools` bundles req_to_token_pool, allocator and tree_cache (see `MemoryPools`)."""
        # the decode inputs on the device (ModelWorkerBatch.decode_rows), valid for the
        # requests `prepare_for_decode` saw: setting `reqs` drops them
        self._decode_rows: torch.Tensor | None = None
        self.reqs = reqs
        self.pools = pools
        self.forward_mode = forward_mode
        self.out_cache_loc: torch.Tensor | None = None
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.token_type_ids: list[int] | None = None
        # requests decoding one token inside this prefill batch (mixed chunk; see
        # `mix_with_running`): they are not prompts, the prefix cache is not updated for them
        self.decoding_reqs: frozenset[Req] = frozenset()
        # (rows, targets, counts) of prompt logprobs, see ModelWorkerBatch
        self._prompt_logprobs: tuple[list[int], list[int], list[int]] | None = None
        # a verify step's drafts per request (engine/speculative/scheduling.py)
        self.spec_draft_lens: list[int] | None = None
        self.spec_parents: list[list[int]] | None = None

    @property
    def reqs(self) -> list[Req]:
        """The requests, in batch order. Replace the list to change them (never mutate it in
        place): the setter drops the decode inputs built for the previous members."""
        return self._reqs

    @reqs.setter
    def reqs(self, reqs: list[Req]) -> None:
        self._reqs = reqs
        self._decode_rows = None

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    # -- prefill --------------------------------------------------------------------------------
    def prepare_for_extend(self) -> None:
        """Give each request a row and KV slots for its new tokens; set up the inputs.

        Requests arrive with `prefix_indices`, `fill_ids` and `extend_input_len` set by the
        prefill adder (which also checked the budget; the allocator may still evict)."""
        p = self.pools
        new_rows = [r for r in self.reqs if r.req_pool_idx is None]
        if new_rows:
            rows = p.req_to_token_pool.alloc(len(new_rows))
            assert rows is not None, "prefill adder admitted more requests than pool rows"
            for r, row in zip(new_rows, rows):
                r.req_pool_idx = row
        prefix_lens = [len(r.fill_ids) - r.extend_input_len for r in self.reqs]
        seq_lens = [len(r.fill_ids) for r in self.reqs]
        req_to_token = p.req_to_token_pool.req_to_token
        for r in self.reqs:
            n = len(r.prefix_indices)
            if n and r.kv_allocated_len < n:
                req_to_token[r.req_pool_idx, :n] = r.prefix_indices.to(torch.int32)
        p.release_swa_window(self.reqs, prefix_lens)
        out = p.alloc_kv(prefix_lens, seq_lens, self._last_locs(prefix_lens))
        rows: list[int] = []
        for r, pl, sl in zip(self.reqs, prefix_lens, seq_lens):
            rows.extend([r.req_pool_idx] * (sl - pl))
            r.kv_allocated_len = sl
            self.input_ids.extend(r.fill_ids[pl:sl])
            self.positions.extend(range(pl, sl))
        # the new slots into the requests' rows: one copy of the (row, position) pairs, one
        # write (not one per request)
        where = int64_rows([rows, self.positions]).to(req_to_token.device)
        req_to_token[where[0], where[1]] = out.to(torch.int32)
        if any(r.token_type_ids for r in self.reqs):
            self.token_type_ids = [t for r, pl, sl in zip(self.reqs, prefix_lens, seq_lens)
                                   for t in (r.token_type_ids or [0] * sl)[pl:sl]]  # fmt: skip
        self.out_cache_loc = out
        self._prefix_lens = prefix_lens
        self._seq_lens = seq_lens
        if any(r.prompt_logprob_start is not None for r in self.reqs):
            self._plan_prompt_logprobs()

    def _plan_prompt_logprobs(self) -> None:
        """The rows whose logits give prompt logprobs (each position once, over chunks)."""
        rows: list[int] = []
        targets: list[int] = []
        counts: list[int] = []
        offset = 0
        for r, pl, sl in zip(self.reqs, self._prefix_lens, self._seq_lens):
            positions = r.prompt_logprob_rows(pl, sl)
            rows.extend(range(offset + positions.start - pl, offset + positions.stop - pl))
            targets.extend(r.origin_input_ids[positions.start + 1 : positions.stop + 1])
            counts.append(len(positions))
            offset += sl - pl
        if rows:
            self._prompt_logprobs = (rows, targets, counts)

    def _last_locs(self, prefix_lens: list[int]) -> torch.Tensor | None:
        """Slot of each request's last cached token, as a device tensor read where it is (no
        host read): the allocator continues a partly filled page from it. None where no
        request continues a page (always with page_size 1); entries of those that do not are
        meaningless."""
        ps = self.pools.page_size
        if all(n % ps == 0 for n in prefix_lens):
            return None
        req_to_token = self.pools.req_to_token_pool.req_to_token
        rows = [r.req_pool_idx for r in self.reqs]
        where = int64_rows([rows, [max(n - 1, 0) for n in prefix_lens]]).to(req_to_token.device)
        return req_to_token[where[0], where[1]].to(torch.int64)

    # -- decode ---------------------------------------------------------------------------------
    def new_page_tokens_needed(self) -> int:
        """KV tokens the next decode step must allocate (a new page where a request's last
        page is full)."""
        page = self.pools.page_size
        if page == 1:  # (every request, every step)
            return len(self.reqs)
        return sum(page for r in self.reqs if r.kv_allocated_len % page == 0)

    def check_decode_mem(self) -> bool:
        self.pools.release_swa_window(self.reqs, None)
        return self.pools.make_room(self.new_page_tokens_needed())

    def prepare_for_decode(
        self,
        input_ids: list[int] | None = None,
        drafts: list[list[int]] | None = None,
        parents: list[list[int]] | None = None,
    ) -> None:
        """One new token per request: the last output token (or `input_ids` given by the
        overlap scheduler, which may hold future placeholders). With `drafts` (speculative
        decoding, engine/speculative/), each request's last token and its drafts: a verify
        step, still a decode batch for the scheduler, whose worker batch is an EXTEND; with
        `parents`, the drafts are trees (each node at its depth's position)."""
        self.forward_mode = ForwardMode.DECODE
        req_to_token = self.pools.req_to_token_pool.req_to_token
        prefix_lens = [r.kv_allocated_len for r in self.reqs]
        rows_list = [r.req_pool_idx for r in self.reqs]
        if drafts is None:
            self.spec_draft_lens = self.spec_parents = None
            seq_lens = [n + 1 for n in prefix_lens]
            positions = prefix_lens
            if input_ids is None:
                input_ids = [r.output_ids[-1] for r in self.reqs]
        else:
            self.spec_draft_lens = [len(d) for d in drafts]
            seq_lens = [n + 1 + k for n, k in zip(prefix_lens, self.spec_draft_lens)]
            # (a tree's node j takes the slot of position n + j but sits at n + its depth)
            columns = [p for n, s in zip(prefix_lens, seq_lens) for p in range(n, s)]
            positions = columns
            if parents is not None:
                positions = [n + d for n, ps in zip(prefix_lens, parents) for d in depths(ps)]
            self.spec_parents = parents
            input_ids = [t for r, d in zip(self.reqs, drafts) for t in (r.output_ids[-1], *d)]
            rows_list = [row for row, k in zip(rows_list, self.spec_draft_lens)
                         for _ in range(k + 1)]  # fmt: skip
        self.pools.release_swa_window(self.reqs, prefix_lens)
        self._decode_rows = None
        if drafts is None:
            # one token per request: the batch's inputs go to the device once (the model
            # runner's rows: ModelWorkerBatch.decode_rows), and each request's last slot is
            # read there (no host read of the device table)
            assert min(prefix_lens, default=1) >= 1, "a decoding request has no cached token"
            rows = int64_rows([rows_list, seq_lens, input_ids, positions])
            self._decode_rows = rows = rows.to(req_to_token.device)
            where = (rows[0], rows[3])
            last_locs = None
            if self.pools.page_size > 1:
                last_locs = req_to_token[where[0], where[1] - 1].to(torch.int64)
            out = self.pools.alloc_decode(prefix_lens, last_locs)
            req_to_token[where[0], where[1]] = out.to(torch.int32)
        else:
            out = self.pools.alloc_kv(prefix_lens, seq_lens, self._last_locs(prefix_lens))
            where = int64_rows([rows_list, columns]).to(req_to_token.device)
            req_to_token[where[0], where[1]] = out.to(torch.int32)
        for r, n in zip(self.reqs, seq_lens):
            r.kv_allocated_len = n
        self.input_ids = input_ids
        self.positions = positions
        self.out_cache_loc = out
        self._prefix_lens = prefix_lens
        self._seq_lens = seq_lens

    def mix_with_running(self, running: ScheduleBatch) -> None:
        """Put the decode step of `running` (prepared by `prepare_for_decode`) into this
        prefill batch, each request as a one-token extend on top of its cached tokens: SGLang's
        mixed chunk. The running requests go first, so that once merged back the running
        batch keeps its order."""
        assert self.forward_mode.is_extend() and running.forward_mode.is_decode()
        self.reqs = running.reqs + self.reqs
        self.input_ids = list(running.input_ids) + self.input_ids
        self.positions = list(running.positions) + self.positions
        self.out_cache_loc = torch.cat([running.out_cache_loc, self.out_cache_loc])
        self._prefix_lens = running._prefix_lens + self._prefix_lens
        self._seq_lens = running._seq_lens + self._seq_lens
        self.decoding_reqs = frozenset(running.reqs)
        running._decode_rows = None  # its step runs in this batch
        if self._prompt_logprobs is not None:  # the running requests' tokens come first
            rows, targets, counts = self._prompt_logprobs
            n = len(running.reqs)
            self._prompt_logprobs = ([i + n for i in rows], targets, [0] * n + counts)

    def retract_decode(self) -> list[Req]:
        """Free memory by sending requests back to the waiting queue: fewest output tokens
        first, then longest input, until the rest can decode RETRACT_DECODE_STEPS steps."""
        p = self.pools
        order = sorted(
            range(len(self.reqs)),
            key=lambda i: (len(self.reqs[i].output_ids), -len(self.reqs[i].origin_input_ids)),
            reverse=True,
        )
        retracted: list[Req] = []
        while len(order) > 1:
            need = len(order) * RETRACT_DECODE_STEPS
            if p.allocator.available_size() + p.tree_cache.evictable_size() >= need and (
                p.sliding_window is None
                or p.allocator.swa_available_size() + p.tree_cache.swa_evictable_size() >= need
            ):
                break
            req = self.reqs[order.pop()]
            self._give_back(req)
            retracted.append(req)
        keep = sorted(order)
        self.reqs = [self.reqs[i] for i in keep]
        p.tree_cache.evict(len(self.reqs) * p.page_size)
        p.make_room(len(self.reqs) * p.page_size)
        return retracted

    def retract(self, reqs: list[Req]) -> None:
        """Send `reqs` (of this batch) back to waiting: their memory is given back, their
        output kept (it is prefilled again with the prompt when they are readmitted)."""
        gone = {id(r) for r in reqs}
        for req in reqs:
            self._give_back(req)
        self.reqs = [r for r in self.reqs if id(r) not in gone]

    def _give_back(self, req: Req) -> None:
        """One request's memory back to the pools; it starts over from waiting."""
        self.pools.release_req(req)
        req.reset_for_retract()

    def retract_new_token_ratio(self) -> float:
        total_decoded = sum(len(r.output_ids) for r in self.reqs)
        total_max_new = sum(r.sampling_params.max_new_tokens for r in self.reqs)
        steps = RETRACT_DECODE_STEPS * len(self.reqs)
        return min(1.0, (total_decoded + steps) / max(1, total_max_new))

    # -- membership -----------------------------------------------------------------------------
    def filter(self, exclude: Req | None = None) -> None:
        """Drop finished requests, and `exclude` (every step: attributes, not properties)."""
        self.reqs = [r for r in self.reqs if r.finished_reason is None and r is not exclude]

    def merge(self, other: ScheduleBatch) -> None:
        self.reqs = self.reqs + other.reqs

    def running_need_tokens(self, new_token_ratio: float) -> float:
        return (
            sum(min(r.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) for r in self.reqs)
            * new_token_ratio
        )

    def running_swa_need_tokens(self, new_token_ratio: float) -> float:
        """With hybrid sliding-window memory: what the running requests may still take of the
        window pool (each holds about a window of its own tokens at most)."""
        cap = swa_request_cap(self.pools)
        return sum(
            min(min(r.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * new_token_ratio, cap)
            for r in self.reqs
        )

    def get_model_worker_batch(self) -> ModelWorkerBatch:
        verify = self.spec_draft_lens is not None  # a decode batch that runs as an extend
        extend = self.forward_mode.is_extend() or verify
        reqs = self.reqs
        params = [r.sampling_params for r in reqs]
        lora_ids = [r.lora_id for r in reqs]
        return ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND if verify else self.forward_mode,
            input_ids=self.input_ids,
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=[r.req_pool_idx for r in reqs],
            seq_lens=self._seq_lens,
            extend_prefix_lens=self._prefix_lens if extend else None,
            extend_seq_lens=[s - p for s, p in zip(self._seq_lens, self._prefix_lens)]
            if extend
            else None,
            sampling_params=params,
            output_ids=[r.output_ids for r in reqs],
            prompt_ids=[r.origin_input_ids for r in reqs],
            # (every step: the flags' reads run in C)
            return_logprob=any(map(_RETURN_LOGPROB, params)),
            top_logprobs_nums=list(map(_TOP_LOGPROBS_NUM, params)),
            prompt_ranks=any(map(_RETURN_PROMPT_RANKS, params)),
            lora_ids=lora_ids if any(lora_ids) else None,
            spec_draft_lens=self.spec_draft_lens,
            spec_parents=self.spec_parents,
            token_type_ids=self.token_type_ids if extend else None,
            kv_transfers=self.pools.tree_cache.take_transfers(),
            decode_rows=None if extend else self._decode_rows,
            **_prompt_logprob_fields(self._prompt_logprobs if extend and not verify else None),
        )


def swa_request_cap(pools: Any) -> int:
    """The window-pool tokens a decoding request holds at most: its window, plus the page in
    progress and the page the freeing lags behind (one batch in flight)."""
    return (pools.sliding_window or 0) + 2 * pools.page_size


def _prompt_logprob_fields(plan: tuple | None) -> dict[str, Any]:
    if plan is None:
        return {}
    rows, targets, counts = plan
    return dict(
        prompt_logprob_rows=rows, prompt_logprob_targets=targets, prompt_logprob_counts=counts
    )
