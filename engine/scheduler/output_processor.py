"""Turning a batch's sampled tokens into request progress (CPU post-processing of a step)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.pooling import EmbeddingBatchResult, PooledState
from engine.scheduler.req import FinishReason, Req
from engine.speculative.scheduling import trim_kv
from engine.speculative.verify import VerifyResult

if TYPE_CHECKING:
    from engine.scheduler.schedule_batch import ScheduleBatch
    from engine.scheduler.scheduler import Scheduler


@dataclass
class StepEvent:
    """What one step did to one request: tokens appended at output index `start`, and the
    finish reason if it ended. `req` gives read access to its full state (for windows,
    usage, logprobs)."""

    req: Req
    new_token_ids: list[int]
    start: int
    finished_reason: FinishReason | None

    @property
    def rid(self) -> str:
        return self.req.rid


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer: Any | None) -> None:
        # A weak reference: a cycle scheduler <-> processor would keep the model runner and
        # its KV pool alive after the engine is dropped, until a full garbage collection.
        self.scheduler = weakref.proxy(scheduler)
        self.tokenizer = tokenizer
        self._events: list[StepEvent] = []

    def emit(self, event: StepEvent) -> None:
        self._events.append(event)
        if event.finished_reason is not None:
            self.scheduler.stats.num_finished += 1

    def take_events(self) -> list[StepEvent]:
        events, self._events = self._events, []
        return events

    def process_batch_result(self, batch: ScheduleBatch, result: Any) -> None:
        """`result.next_token_ids` holds one sampled token per request of `batch` (a tensor or
        list); optional `logprobs` / `top_logprobs` / `prompt_logprobs` alongside. A verify
        step's result (`VerifyResult`) has several tokens per request."""
        if isinstance(result, VerifyResult):
            self.process_verify_result(batch, result)
            return
        if isinstance(result, EmbeddingBatchResult):
            self.process_embedding_result(batch, result)
            return
        next_ids = result.next_token_ids
        if hasattr(next_ids, "tolist"):
            next_ids = next_ids.tolist()
        logprobs = (
            result.logprobs.tolist() if getattr(result, "logprobs", None) is not None else None
        )
        top = getattr(result, "top_logprobs", None)
        prompt = getattr(result, "prompt_logprobs", None)
        if prompt is not None:
            _add_prompt_logprobs(batch.reqs, prompt)
        chunked = getattr(batch, "chunked_req", None)
        tree_cache = self.scheduler.tree_cache
        context_len = self.scheduler.context_len
        stats = self.scheduler.stats
        drafter = getattr(self.scheduler, "drafter", None)  # (its requests' draft K/V)
        tokenizer = self.tokenizer
        # Prompts go into the prefix cache after an extend step, unless the overlap loop has
        # done so already; a mixed batch's decoding requests are no prompts.
        cache_prompts = batch.forward_mode.is_extend() and not getattr(
            batch, "prompts_cached", False
        )
        decoding = batch.decoding_reqs
        events = self._events
        num_new = num_finished = 0
        for i, req in enumerate(batch.reqs):  # (the per-request loop of every step: kept lean)
            if req.finished_reason is not None or req is chunked:
                continue  # a partial prompt: its sampled token means nothing
            output_ids = req.output_ids
            start = len(output_ids)
            if req.to_abort is None:
                if logprobs is None and req.grammar is None:  # (most steps: the token alone)
                    token = next_ids[i]
                    output_ids.append(token)
                    limit = req.quick_len if req.quick_len >= 0 else req.quick_limit(context_len)
                    if start + 1 < limit and token not in req.finish_tokens:
                        # `check_finished` would find nothing: the request goes on
                        if cache_prompts and req not in decoding:
                            tree_cache.cache_unfinished_req(req)
                        num_new += 1
                        events.append(StepEvent(req, [token], start, None))
                        continue
                else:
                    _take_token(req, next_ids[i], logprobs, top, i)
            req.check_finished(context_len, tokenizer)
            reason = req.finished_reason
            if reason is not None:
                req.fill_ids = req.all_ids()[: req.kv_allocated_len]
                tree_cache.cache_finished_req(req)
                num_finished += 1
                if drafter is not None:
                    drafter.forget(req)
            elif cache_prompts and req not in decoding:
                tree_cache.cache_unfinished_req(req)
            new = output_ids[start:]
            num_new += len(new)
            events.append(StepEvent(req, new, start, reason))
        stats.generation_tokens += num_new
        stats.num_finished += num_finished

    def process_verify_result(self, batch: ScheduleBatch, result: VerifyResult) -> None:
        """Append each request's accepted tokens one at a time, as if each were a step of
        its own (the tokens after one that finishes the request are dropped), then give
        back the KV of what was not kept: every request holds KV for all its tokens but the
        last, as after a decode step."""
        sched = self.scheduler
        drafter = sched.drafter
        drafter.count(result.num_drafts, result.accepted)
        tree_cache, pools, context_len = sched.tree_cache, sched.pools, sched.context_len
        tokenizer = self.tokenizer
        logprobs, top = result.logprobs, result.top_logprobs
        num_new = num_finished = 0
        rejected = []  # KV slots of rejected drafts (freed at once)
        live_from: list[int] = []  # per run: where its window KV starts (hybrid window memory)
        for i, req in enumerate(batch.reqs):
            if req.finished_reason is not None:
                continue
            output_ids = req.output_ids
            start = len(output_ids)
            own_logprobs = logprobs[i] if logprobs is not None else None
            own_top = top[i] if top is not None else None
            for j, token in enumerate(result.tokens[i]):  # (at least one)
                if req.to_abort is None:
                    _take_token(req, token, own_logprobs, own_top, j)
                req.check_finished(context_len, tokenizer)
                if req.finished_reason is not None:
                    break
            trimmed = trim_kv(pools, req, req.seqlen - 1)
            if trimmed is not None:
                rejected.append(trimmed[0])
                live_from.append(trimmed[1])
            reason = req.finished_reason
            if reason is not None:
                req.fill_ids = req.all_ids()[: req.kv_allocated_len]
                tree_cache.cache_finished_req(req)
                num_finished += 1
                if drafter is not None:
                    drafter.forget(req)
            new = output_ids[start:]
            num_new += len(new)
            self._events.append(StepEvent(req, new, start, reason))
        if rejected:  # (each from a page boundary: trim_kv; nothing read from the device)
            pools.allocator.free_runs(rejected, live_from)
        sched.stats.generation_tokens += num_new
        sched.stats.num_finished += num_finished


    def process_embedding_result(self, batch: ScheduleBatch, result: EmbeddingBatchResult) -> None:
        """An embedding model's (or a classifier's) extend batch: each request takes its
        chunk's pooled states; one whose prompt is complete ends with its embedding (finish
        reason "length": it asked for no new tokens) and goes into the prefix cache."""
        sched = self.scheduler
        pooling = sched.args.pooling_type
        normalize = not sched.model_runner.model_config.labels  # (a classifier's: raw logits)
        chunked = getattr(batch, "chunked_req", None)
        for i, req in enumerate(batch.reqs):
            if req.finished_reason is not None:
                continue
            if req.embedding is None:
                asked = req.sampling_params.normalize_embedding
                req.embedding = PooledState(pooling, normalize if asked is None else asked)
            req.embedding.add(result.pooled[i], req.extend_input_len)
            if req is chunked:
                continue
            req.finished_reason = req.to_abort or FinishReason("length", length=0)
            req.fill_ids = req.all_ids()[: req.kv_allocated_len]
            sched.tree_cache.cache_finished_req(req)
            sched.stats.num_finished += 1
            self._events.append(StepEvent(req, [], 0, req.finished_reason))


def _take_token(
    req: Req, token: int, logprobs: list | None, top: list | None, index: int
) -> None:
    """Append a sampled token to a request that is not being aborted: its grammar must accept
    it (else the request is to abort), and entry `index` of the step's logprobs (and top
    logprobs) is its logprob if it asked for them."""
    req.output_ids.append(token)
    if req.grammar is not None and not req.grammar.accept(token):
        req.to_abort = FinishReason("abort", message=f"token {token} does not follow the grammar")
    if logprobs is not None and req.sampling_params.return_logprob:
        req.logprobs.append(logprobs[index])
        if top is not None and req.sampling_params.top_logprobs_num > 0:
            req.top_logprobs.append(top[index])


def _add_prompt_logprobs(reqs: list[Req], prompt: list) -> None:
    """Append each request's prompt logprobs from a batch (a chunk's too, in chunk order)."""
    for req, entry in zip(reqs, prompt, strict=True):
        if entry is not None and req.finished_reason is None:
            logprobs, top, ranks = entry
            req.prompt_token_logprobs.extend(logprobs)
            if ranks is not None:
                req.prompt_token_ranks.extend(ranks)
            if top is not None:
                req.prompt_top_logprobs.extend(top)
