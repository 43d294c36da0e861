"""What reaches the scheduler between its steps: new requests (a grammar compiles beside
the scheduler first, `GrammarQueue`), aborts, cache flushes, and the grammar masks of a
batch. A mixin of `Scheduler` (engine/scheduler/scheduler.py), which owns the state it
reads: the waiting queue, the running and in-flight batches, the grammar queue.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch

from engine.sampling.grammar import GrammarBackend
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.output_processor import StepEvent
from engine.scheduler.req import FinishReason, Req

if TYPE_CHECKING:
    from engine.config import EngineArgs
    from engine.scheduler.grammar_queue import GrammarQueue
    from engine.scheduler.output_processor import OutputProcessor
    from engine.scheduler.schedule_batch import ScheduleBatch

GRAMMAR_POLL_S = 0.005


class RequestIntake:
    """`Scheduler`'s requests in and out (see module doc)."""

    args: EngineArgs
    model_runner: Any
    tree_cache: Any
    tokenizer: Any | None
    context_len: int
    eos_token_ids: tuple[int, ...]
    stats: Any
    output: OutputProcessor
    grammar_queue: GrammarQueue
    waiting_queue: list[Req]
    running_batch: ScheduleBatch
    last_batch: ScheduleBatch | None
    chunked_req: Req | None
    _constrained: set[Req]
    _rejected: list[tuple[str, str]]
    _arrival: itertools.count
    lora_ids: dict[str, int]  # LoRA adapter name -> id (engine/lora)
    holds_kv: Any  # (Pausing's)

    def add_request(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        priority: int | None = None,
        lora_name: str | None = None,
        token_type_ids: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> Req:
        """Queue a validated request. Raises ValueError if it cannot fit the context, its
        grammar is known not to compile, it has a priority without priority scheduling,
        names a LoRA adapter the engine does not serve, or asks an embedding model for new
        tokens or logprobs; one whose grammar fails later is
        rejected (`take_rejected`). `token_type_ids` (one per prompt token) go to an encoder
        (a BERT pair's); a decoder has none, and ignores them. `cache_salt` (a non-empty
        string): the request shares cached prefixes only with requests of the same salt."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt: must be a non-empty string")
        lora_id = self.lora_ids.get(lora_name, 0) if lora_name else 0
        if lora_name and not lora_id:
            served = sorted(self.lora_ids) or "none"
            raise ValueError(f"lora_path: no LoRA adapter {lora_name!r} (served: {served})")
        if priority and not self.args.enable_priority_scheduling:
            raise ValueError(
                "priority: priority scheduling is off (the worker's --enable-priority-scheduling)"
            )
        if not input_ids:
            raise ValueError("input_ids: the prompt is empty")
        if self.args.is_embedding and (params.max_new_tokens or params.return_logprob):
            raise ValueError("an embedding model pools the prompt: max_new_tokens must be 0, "
                             "and it has no logprobs")  # fmt: skip
        # a prompt to generate from leaves room for a token; a pooled one may fill the context
        if len(input_ids) > self.context_len - (not self.args.is_embedding):
            raise ValueError(
                f"input_ids: the prompt has {len(input_ids)} tokens, the context length is "
                f"{self.context_len}"
            )
        if len(input_ids) + params.max_new_tokens > self.context_len:
            raise ValueError(
                f"max_new_tokens: {len(input_ids)} prompt tokens + {params.max_new_tokens} new "
                f"tokens exceed the context length {self.context_len}"
            )
        types = self._token_types(input_ids, token_type_ids)
        req = Req(
            rid,
            list(input_ids),
            params,
            self.eos_token_ids,
            next(self._arrival),
            priority or 0,
            lora_id,
            cache_salt,
        )
        req.token_type_ids = types
        compiling = params.has_grammar and not self.grammar_queue.submit(req)
        self.stats.prompt_tokens += len(input_ids)
        if not compiling:
            self._enqueue(req)
        return req

    def _token_types(self, input_ids: list[int], types: list[int] | None) -> list[int] | None:
        """The request's token types for an encoder (None: all 0, or not an encoder)."""
        config = self.model_runner.model_config
        if not types or not config.is_encoder or not any(types):
            return None
        if len(types) != len(input_ids):
            raise ValueError(f"token_type_ids: {len(types)} for {len(input_ids)} prompt tokens")
        num_types = int(getattr(config.hf_config, "type_vocab_size", 1))
        if min(types) < 0 or max(types) >= num_types:
            raise ValueError(f"token_type_ids: the model's types are 0..{num_types - 1}")
        return list(types)

    def _enqueue(self, req: Req) -> None:
        if req.grammar is not None:
            self._constrained.add(req)
        self.waiting_queue.append(req)

    def _make_grammar_backend(self) -> GrammarBackend:
        if self.tokenizer is None:
            raise ValueError("structured outputs need the tokenizer (skip_tokenizer_init)")
        vocab = self.model_runner.model_config.vocab_size
        return GrammarBackend(self.tokenizer, vocab, self.eos_token_ids)

    def _admit_compiled(self) -> None:
        """Requests whose grammar has compiled join the waiting queue; failed ones end."""
        ready, rejected = self.grammar_queue.take_ready()
        for req in ready:
            self._enqueue(req)
        for req, why in rejected:
            req.finished_reason = FinishReason("abort", message=why)
            self._rejected.append((req.rid, why))

    def take_rejected(self) -> list[tuple[str, str]]:
        """(rid, why) of the requests whose grammar failed to compile since the last call:
        they are gone from the scheduler without an event (the caller reports the error)."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def abort_request(self, rid: str, why: str = "aborted by request") -> None:
        reason = FinishReason("abort", message=why)
        queued = self.grammar_queue.remove(rid)  # compiling its grammar, or waiting
        for i, req in enumerate(self.waiting_queue if queued is None else ()):
            if req.rid == rid:
                queued = self.waiting_queue.pop(i)
                break
        if queued is not None:
            queued.finished_reason = reason
            self.output.emit(StepEvent(queued, [], len(queued.output_ids), reason))
            return
        for req in itertools.chain(self.running_batch.reqs, self._in_flight_reqs()):
            if req.rid == rid and not req.finished:
                req.to_abort = reason

    def _in_flight_reqs(self) -> list[Req]:
        reqs = list(self.last_batch.reqs) if self.last_batch is not None else []
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        return reqs

    def has_work(self) -> bool:
        return bool(self.waiting_queue) or len(self.grammar_queue) > 0 or self.holds_kv()

    def flush_cache(self, keep_waiting: bool = False) -> bool:
        """Empty the prefix cache; refused (False) while any request runs or, unless
        `keep_waiting` (a paused worker's), waits: a waiting request holds no K/V and matches
        the cache again when admitted (a flush that frees slots moves its epoch on)."""
        if self.holds_kv() or (self.has_work() and not keep_waiting):
            return False
        self.tree_cache.reset()
        return True

    def wait_for_grammars(self) -> None:
        """With nothing to run but requests whose grammar compiles: block briefly on the
        compilations rather than spin (new requests wait at most this long)."""
        if len(self.grammar_queue):
            self.grammar_queue.wait(GRAMMAR_POLL_S)

    def vocab_mask(self, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The grammar rows of a batch and their token masks, as of the requests' outputs now
        (None if none of them has a grammar)."""
        if self._constrained:
            self._constrained = {r for r in self._constrained if not r.finished}
        if not self._constrained or not any(r in self._constrained for r in reqs):
            return None
        return self.grammar_queue.backend().vocab_mask([r.grammar for r in reqs])
