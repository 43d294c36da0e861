"""The offline, in-process API (SGLang's `sgl.Engine`, without the subprocesses)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

from engine.config import EngineArgs, ModelConfig
from engine.engine_pooling import PoolingCalls
from engine.mem_cache.base import PrefixCache
from engine.mem_cache.no_cache import NoRadixCache
from engine.mem_cache.radix_cache import RadixCache
from engine.mem_cache.swa_radix_cache import SWARadixCache
from engine.model_runner import ModelRunner
from engine.pooling import resolve_model_kind
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.output_processor import StepEvent
from engine.scheduler.req import Req
from engine.scheduler.scheduler import Scheduler
from engine.weight_groups import JOIN_TIMEOUT_S

logger = logging.getLogger(__name__)


def build_scheduler(args: EngineArgs, tokenizer: Any | None = None) -> Scheduler:
    """Model runner + prefix cache + scheduler, as the worker service also builds them."""
    model_config = ModelConfig.from_args(args)
    args = resolve_model_kind(args, model_config)
    # With a device process (CPU overlap), the model and KV pool live there, not here.
    runner = ModelRunner(model_config, args, host_only=args.overlap_device_process)
    tree_cache = make_tree_cache(runner, args)
    scheduler_cls: type[Scheduler] = Scheduler
    if not args.disable_overlap_schedule:
        try:
            from engine.overlap.scheduler import OverlapScheduler
        except ImportError:  # the overlap loop is not built yet
            pass
        else:
            scheduler_cls = OverlapScheduler
    return scheduler_cls(args, runner, tree_cache, tokenizer)


def make_tree_cache(runner: ModelRunner, args: EngineArgs) -> PrefixCache:
    pools = (runner.req_to_token_pool, runner.allocator, args.page_size)
    if args.disable_radix_cache:
        return NoRadixCache(*pools)
    if runner.swa_window is not None:
        return SWARadixCache(*pools, runner.swa_window)
    if runner.host_kv_tokens:
        from engine.mem_cache.allocator import TokenToKVPoolAllocator
        from engine.mem_cache.hiradix_cache import HiRadixCache

        host = TokenToKVPoolAllocator(runner.host_kv_tokens, args.page_size, "cpu")
        return HiRadixCache(*pools, host, args.hicache_write_policy)
    return RadixCache(*pools)


class Engine(PoolingCalls):
    """`Engine(model_path=..., **sglang_style_args).generate(prompt=..., sampling_params=...)`."""

    def __init__(self, **kwargs: Any) -> None:
        self.args = EngineArgs.from_kwargs(**kwargs)
        self.tokenizer = None
        if not self.args.skip_tokenizer_init:
            from engine.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(self.args.model_path)
        self.scheduler = build_scheduler(self.args, self.tokenizer)
        self.weight_version = "default"  # SGLang's label of the weights, in every meta_info
        self.args = self.scheduler.args  # (a classifier's: a pooling model's)
        self._rids = itertools.count()

    # -- generation -----------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | None = None,
        top_logprobs_num: int | None = None,
        logprob_start_len: int | None = None,
        lora_path: str | list[str | None] | None = None,
        extra_key: str | list[str | None] | None = None,
    ) -> dict | list[dict]:
        """Generate for one prompt (returns a dict) or a batch (returns a list of dicts).

        With `return_logprob`, `meta_info` has SGLang's `output_token_logprobs` ([logprob,
        token id, None] per output token: SGLang's entries, whose text is None unless asked
        for) and, with `top_logprobs_num`, `output_top_logprobs`;
        `logprob_start_len` >= 0 adds the prompt's from that position (`input_token_logprobs`,
        `input_top_logprobs`; position 0 has none). `max_new_tokens` 0 runs the prompt only.
        `lora_path` (SGLang's name): the LoRA adapter of `lora_paths` to run with, by name,
        one for all prompts or one each (None: the base model). `extra_key` (SGLang's; vLLM's
        `cache_salt`): a prompt reuses cached prefixes only of requests with the same key, one
        for all prompts or one each (None: unsalted)."""
        if self.args.is_embedding:
            raise ValueError("generate: this engine serves an embedding model; use encode()")
        single, prompts_ids = self._input_ids(prompt, input_ids)
        logprob_args = {"return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num,
                        "logprob_start_len": logprob_start_len}  # fmt: skip
        params = self._params(sampling_params, len(prompts_ids), logprob_args)
        rids = [f"offline-{next(self._rids)}" for _ in prompts_ids]
        loras = _per_prompt("lora_path", lora_path, len(prompts_ids))
        salts = _per_prompt("extra_key", extra_key, len(prompts_ids))
        start = time.perf_counter()
        for rid, ids, p, lora, salt in zip(rids, prompts_ids, params, loras, salts):
            self.scheduler.add_request(rid, ids, p, lora_name=lora, cache_salt=salt)
        finished: dict[str, tuple[Req, float]] = {}  # rid -> (request, seconds to its end)
        for event in self._run_until(set(rids)):
            if event.finished_reason is not None:
                finished[event.rid] = event.req, time.perf_counter() - start
        outs = [self._format(*finished[rid]) for rid in rids]
        return outs[0] if single else outs

    def _run_until(self, rids: set[str]) -> Iterator[StepEvent]:
        """The events of `rids` until all finish. A request whose grammar fails to compile
        aborts the others and raises its ValueError (once they have ended)."""
        pending, error = set(rids), None
        while pending:
            if not self.scheduler.has_work():
                raise RuntimeError(f"scheduler idle with {len(pending)} requests unfinished")
            for event in self.scheduler.step():
                if event.finished_reason is not None:
                    pending.discard(event.rid)
                yield event
            for rid, why in self.scheduler.take_rejected():
                pending.discard(rid)
                if error is None:
                    error = ValueError(why)
                    for other in pending:
                        self.scheduler.abort_request(other)
        if error is not None:
            raise error

    def _input_ids(self, prompt: Any, input_ids: Any) -> tuple[bool, list[list[int]]]:
        if self.scheduler.weights_missing:  # (the first thing generate and encode do)
            raise RuntimeError(f"{self.scheduler.weights_missing} weights were discarded at a "
                               "release and not sent again (update_weights_from_tensor or "
                               "_from_distributed), or use update_weights_from_disk")  # fmt: skip
        if self.scheduler.asleep:
            raise RuntimeError("the engine's memory is released (release_memory_occupation, "
                               "sleep): resume it first")  # fmt: skip
        if (prompt is None) == (input_ids is None):
            raise ValueError("generate: pass exactly one of prompt= or input_ids=")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("prompt: the engine was started with skip_tokenizer_init")
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt: must be a string or a list of strings")
            return single, [self.tokenizer.encode(t) for t in texts]
        single = bool(input_ids) and isinstance(input_ids[0], int)
        batch = [input_ids] if single else list(input_ids)
        for ids in batch:
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError("input_ids: must be a list of ints or a list of such lists")
            if any(t < 0 or t >= self.scheduler.model_runner.model_config.vocab_size for t in ids):
                raise ValueError("input_ids: token id out of the vocabulary")
        return single, batch

    def _params(self, sp: Any, n: int, logprob_args: dict[str, Any]) -> list[SamplingParams]:
        dicts = sp if isinstance(sp, list) else [sp or {}] * n
        if len(dicts) != n:
            raise ValueError(f"sampling_params: {len(dicts)} given for {n} prompts")
        out = []
        vocab = self.scheduler.model_runner.model_config.vocab_size
        for d in dicts:
            d = dict(d or {})
            for key, value in logprob_args.items():
                if value is not None:
                    d.setdefault(key, value)
            if "bad_words" in d:  # vLLM's, as token sequences
                if self.tokenizer is None:
                    raise ValueError("bad_words: the engine was started with skip_tokenizer_init")
                from engine.tokenizer import bad_words_ids

                d["bad_words_ids"] = bad_words_ids(self.tokenizer, d.pop("bad_words") or [])
            p = SamplingParams.from_dict(d)
            p.verify(vocab)
            p.normalize()
            if p.n != 1:
                raise ValueError("n: the offline engine takes n=1; repeat the prompt instead")
            out.append(p)
        return out

    def _format(self, req: Req, e2e_latency: float) -> dict:
        params = req.sampling_params
        reason = req.finished_reason
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(
                req.output_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                clean_up_tokenization_spaces=False,
            )
            if reason is not None and isinstance(reason.matched, str):
                cut = text.find(reason.matched)
                if cut >= 0:
                    text = text[: cut + len(reason.matched) * params.no_stop_trim]
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": reason.to_dict() if reason else None,
            "e2e_latency": e2e_latency,  # SGLang's: seconds from the call to the request's end
            "weight_version": self.weight_version,
        }
        if params.return_logprob:
            meta.update(_logprob_meta(req))
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    # -- management -----------------------------------------------------------------------------
    def get_stats(self) -> dict[str, Any]:
        s = self.scheduler.stats
        return {
            "num_running_reqs": s.num_running,
            "num_waiting_reqs": s.num_waiting,
            "token_usage": s.token_usage,
            "cache_hit_tokens": s.cache_hit_tokens,
            "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens,
            "num_retractions": s.num_retractions,
            "new_token_ratio": s.new_token_ratio,
            **_spec_stats(self.scheduler),
            **self.scheduler.tree_cache.host_stats(),
        }

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def load_lora_adapter(self, lora_name: str, lora_path: str, replace: bool = False) -> None:
        """Serve the PEFT adapter in `lora_path` as `lora_name` (SGLang's Engine call; needs
        `enable_lora` or `lora_paths`); `replace` swaps the weights of a loaded one."""
        self.scheduler.load_lora_adapter(lora_name, lora_path, replace)

    def unload_lora_adapter(self, lora_name: str) -> None:
        self.scheduler.unload_lora_adapter(lora_name)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        """Serve the weights of the checkpoint in `model_path` (the same model's: the same
        architecture and tensor shapes) from now on (SGLang's Engine call), labelled
        `weight_version` if given; the prefix cache is emptied. ValueError, the old weights
        (and label) kept, if the checkpoint does not fit."""
        self.scheduler.update_weights_from_disk(model_path)
        if weight_version is not None:
            self.weight_version = weight_version

    # -- device memory given back while idle (engine/memory_occupation.py) ---------------------
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Give back the device memory of `tags` ("weights", "kv_cache", "cuda_graph"; None:
        all) until `resume_memory_occupation` (SGLang's Engine call; RL trainers train on
        the GPU meanwhile). The weights are copied to host memory with
        `enable_weights_cpu_backup`, else discarded: read from the checkpoint again before
        the next forward, unless `update_weights_from_disk` fills them first; the K/V are
        forgotten (the prefix cache is emptied). ValueError while a request holds K/V."""
        self.scheduler.release_memory_occupation(tags, self.args.enable_weights_cpu_backup)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take the memory of `tags` (None: all released) again."""
        self.scheduler.resume_memory_occupation(tags)

    def sleep(self, level: int = 1) -> None:
        """vLLM's `LLM.sleep`: level 1 copies the weights to host memory and discards the
        K/V; level 2 discards both (the weights are read again at the first forward after
        `wake_up`, or come from `update_weights_from_disk`)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: use 1 (weights kept in host memory) or 2")
        self.scheduler.release_memory_occupation(("weights", "kv_cache"), level == 1)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's `LLM.wake_up`: the memory of `tags` ("weights", "kv_cache"; None: all)."""
        self.scheduler.resume_memory_occupation(tags)

    def is_sleeping(self) -> bool:
        return bool(self.scheduler.released_memory)

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, Any]],
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """The tensors `named_tensors` ((checkpoint name, tensor) pairs, any part of the
        model: an RL trainer's new weights, a bucket at a time) into the served weights
        (SGLang's Engine call); the prefix cache is emptied with `flush_cache`. ValueError,
        nothing changed, if a name is not the model's or a tensor does not fit, or while a
        request holds K/V. Released weights are taken back for it; after a release that
        discarded weights updated this way (no copy on disk), every tensor of the checkpoint
        must be sent again before the engine generates."""
        if load_format is not None:
            raise ValueError(f"load_format {load_format!r}: only the default (None) is "
                             "supported")  # fmt: skip
        named = [(str(name), tensor) for name, tensor in named_tensors]
        self.scheduler.update_weights_from_tensor(named, flush_cache)

    # -- weights broadcast by an RL trainer (engine/weight_groups.py) ---------------------------
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float = JOIN_TIMEOUT_S,
    ) -> None:
        """Join the trainer's process group (SGLang's Engine call): the trainer is rank 0
        and serves the rendezvous at `master_address:master_port`; this engine is rank
        `rank_offset`. Blocks until every rank has joined (the trainer joins from another
        process or thread meanwhile). ValueError for a bad rank or backend ("nccl" needs
        CUDA; "gloo" works on any device) or a name in use; RuntimeError if the rendezvous
        fails within `timeout_s`."""
        self.scheduler.init_weights_update_group(master_address, master_port, rank_offset,
                                                 world_size, group_name, backend,
                                                 timeout_s)  # fmt: skip

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> None:
        """Receive the tensors the trainer broadcasts (`torch.distributed.broadcast(t,
        src=0, group=...)`, one per name, in this order; `dtypes` as "bfloat16" or
        "torch.bfloat16"; with `load_format` "flattened_bucket", SGLang's, one uint8 tensor of
        their bytes end to end) and load them as `update_weights_from_tensor` does. The bucket is
        received in full even when refused (ValueError, nothing changed: a name or shape
        that does not fit the model, a request holding K/V), so the trainer never waits on
        a refusal."""
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format {load_format!r}: use None or 'flattened_bucket'")
        self.scheduler.update_weights_from_distributed(
            list(names), list(dtypes), [list(s) for s in shapes], group_name, flush_cache,
            load_format == "flattened_bucket",
        )  # fmt: skip
        if weight_version is not None:
            self.weight_version = weight_version

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Leave the trainer's group (ValueError if not joined)."""
        self.scheduler.destroy_weights_update_group(group_name)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` served values of the checkpoint tensor `name` (a row
        range of a fused projection, a transposed Conv1D weight: as the checkpoint has it)
        or of the model parameter `name`, flattened (SGLang's Engine call: how a trainer
        checks the weights it sent). ValueError if there is none, if the loader computes the
        served weight from it (FP8 quantized while loading), or while weights are released."""
        if truncate_size < 0:
            raise ValueError("truncate_size must be >= 0")
        return self.scheduler.get_weights_by_name(name, truncate_size)

    def lora_adapters(self) -> dict[str, str]:
        """The adapters served now: name -> folder."""
        return dict(self.scheduler.loras.paths)

    def shutdown(self) -> None:
        """Stop the scheduler and free the model's device memory (weights, KV cache, graphs);
        the engine cannot generate afterwards."""
        close = getattr(self.scheduler, "close", None)
        if close is not None:
            close()
        runner = getattr(self.scheduler, "model_runner", None)
        if runner is not None:
            runner.release_memory()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _logprob_meta(req: Req) -> dict[str, Any]:
    """SGLang's logprob fields of `meta_info` ([logprob, token id, None] entries, as SGLang
    gives them without `return_text_in_logprobs`; top ones best first)."""
    top = req.sampling_params.top_logprobs_num > 0
    meta: dict[str, Any] = {
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids)]
    }
    if top:
        meta["output_top_logprobs"] = [_pairs(t) for t in req.top_logprobs]
    start = req.prompt_logprob_start
    if start is None:
        return meta
    first: list[None] = [None] * (req.prompt_logprob_first - start)  # position 0 has none
    lps = first + req.prompt_token_logprobs
    ids = req.origin_input_ids[start:]
    if len(lps) == len(ids):  # (not when it ended before its prompt's were computed)
        meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
        if top:
            meta["input_top_logprobs"] = first + [_pairs(t) for t in req.prompt_top_logprobs]
    return meta


def _pairs(top: tuple[list[int], list[float]]) -> list[list]:
    return [[v, t, None] for t, v in zip(*top)]


def _spec_stats(scheduler: Scheduler) -> dict[str, Any]:
    """Speculative decoding's counts (vLLM's spec decode metrics), when it is on."""
    drafter = scheduler.drafter
    if drafter is None:
        return {}
    s = drafter.stats
    return {
        "spec_num_drafts": s.num_drafts,
        "spec_draft_tokens": s.draft_tokens,
        "spec_accepted_tokens": s.accepted_tokens,
        "spec_accept_length": s.accept_length,
        "spec_memory_skips": s.memory_skips,
    }


def _per_prompt(name: str, value: Any, num_prompts: int) -> list[Any]:
    """Argument `name` of each prompt: one value for all, or a list of one per prompt."""
    values = value if isinstance(value, list) else [value] * num_prompts
    if len(values) != num_prompts:
        raise ValueError(f"{name}: {len(values)} given for {num_prompts} prompts")
    return values
