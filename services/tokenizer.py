"""The tokenizer service: text or chat messages in, validated token ids out to a worker.

Reads `{p}:tokenize` in group `tokenizers` (any number of tokenizers share it). Each
`TokenizeReqMsg` becomes token ids — `text` encoded as the offline engine encodes it,
`messages` rendered with the model's chat template (`engine.tokenizer`), `input_ids` as
given — and is checked before it reaches the worker: ids inside the vocabulary, prompt
shorter than the context length, prompt + max_new_tokens within it, sampling parameters
valid (`SamplingParams.from_dict` + `verify`; that module imports no torch, so the
tokenizer shares the engine's rules instead of copying them). Stop strings and the
detokenizer flags are lifted out of the sampling dict into the `GenerateReqMsg`, which
goes to `{p}:worker:{w}:in` for the worker the router chose. A request that fails becomes
an `ErrorMsg` (status 400) on the router's stream `{p}:router:{r}:out`. Entries are acked
after forwarding; those of a dead tokenizer are taken over after `--claim-idle-ms` (the
worker ignores a request id it already has).

The context length is the target worker's (from its heartbeat: it may run with
`--context-length`), else the model's config.

    sluice tokenizer --redis-url redis://127.0.0.1:6379/0 --model /models/m
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from engine.sampling.sampling_params import SamplingParams
from services.group_consumer import (
    GroupConsumer,
    GroupSpec,
    dead_letter_unexpected,
    exit_process,
    stop_on_signals,
)
from shared.bus import Bus, Entry
from shared.heartbeat import list_live
from shared.keys import (
    TOKENIZER_GROUP,
    TOKENIZER_KIND,
    WORKER_KIND,
    router_out_stream,
    tokenize_stream,
    worker_in_stream,
)
from shared.logging import setup_logging
from shared.messages import ErrorMsg, GenerateReqMsg, Message, TokenizeReqMsg, WorkerLoadMsg
from shared.settings import (
    TokenizerSettings,
    add_settings_args,
    default_service_id,
    settings_from_args,
)

logger = logging.getLogger(__name__)

# Keys of the sampling dict that travel as GenerateReqMsg fields instead.
_LIFTED = ("stop", "skip_special_tokens", "spaces_between_special_tokens")
_REQUEST_LEVEL = ("return_logprob", "top_logprobs_num")


class RequestError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def model_limits(model_path: str) -> tuple[int, int]:
    """(vocab size, context length) from the model's config.json (no torch needed)."""
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    context = config.get("max_position_embeddings") or config.get("n_positions") or 2048
    return int(config["vocab_size"]), int(context)


class RequestTokenizer:
    """Turns a `TokenizeReqMsg` into a `GenerateReqMsg`, or raises RequestError."""

    def __init__(self, tokenizer: Any, vocab_size: int, context_len: int) -> None:
        from engine.tokenizer import apply_chat_template

        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len
        self._chat = apply_chat_template

    def to_generate(self, msg: TokenizeReqMsg, context_len: int | None = None) -> GenerateReqMsg:
        ids = self._input_ids(msg)
        sp = dict(msg.sampling_params)
        lifted = {k: sp.pop(k) for k in _LIFTED if k in sp}
        for key in _REQUEST_LEVEL:
            sp.pop(key, None)  # the message fields say it
        params = self._check_params(sp, lifted, msg)
        self._check_length(ids, params.max_new_tokens, context_len or self.context_len)
        return GenerateReqMsg(
            rid=msg.rid,
            router_id=msg.router_id,
            input_ids=ids,
            sampling_params=sp,
            stop=params.stop_strs,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            created=msg.created,
        )

    def _input_ids(self, msg: TokenizeReqMsg) -> list[int]:
        if msg.text is not None:
            ids = self.tokenizer.encode(msg.text)
        elif msg.messages is not None:
            turns = [{"role": m.role, "content": m.content} for m in msg.messages]
            try:
                ids = self._chat(self.tokenizer, turns)
            except Exception as exc:  # template errors: roles out of order, bad content
                raise RequestError("invalid_request", f"messages: {exc}") from None
        else:
            ids = list(msg.input_ids or [])
        if not ids:
            raise RequestError("invalid_request", "the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise RequestError(
                "invalid_request", f"input_ids: token ids must be in [0, {self.vocab_size})"
            )
        return ids

    def _check_params(
        self, sp: dict[str, Any], lifted: dict[str, Any], msg: TokenizeReqMsg
    ) -> SamplingParams:
        full = {**sp, **lifted, "return_logprob": msg.return_logprob}
        full["top_logprobs_num"] = msg.top_logprobs_num
        try:
            params = SamplingParams.from_dict(full)
            params.verify(self.vocab_size)
        except (ValueError, TypeError) as exc:
            raise RequestError("invalid_request", f"sampling_params: {exc}") from None
        if params.n != 1:
            raise RequestError("invalid_request", "sampling_params: n must be 1 per request")
        return params

    def _check_length(self, ids: list[int], max_new_tokens: int, context_len: int) -> None:
        if len(ids) >= context_len:
            raise RequestError(
                "prompt_too_long",
                f"the prompt has {len(ids)} tokens; the context length is {context_len}",
            )
        if len(ids) + max_new_tokens > context_len:
            raise RequestError(
                "prompt_too_long",
                f"{len(ids)} prompt tokens + max_new_tokens {max_new_tokens} exceed the "
                f"context length {context_len}",
            )


class Tokenizer:
    """Handles batches of `{p}:tokenize` entries for `GroupConsumer`."""

    WORKERS_REFRESH_S = 2.0

    def __init__(self, bus: Bus, spec: GroupSpec, requests: RequestTokenizer) -> None:
        self.bus = bus
        self.spec = spec
        self.requests = requests
        self._workers: dict[str, Message] = {}
        self._workers_at = 0.0

    def handle(self, entries: Sequence[Entry]) -> list[tuple[str, Message]]:
        out: list[tuple[str, Message]] = []
        for entry in entries:
            msg = entry[1]
            if not isinstance(msg, TokenizeReqMsg):
                dead_letter_unexpected(self.bus, self.spec, entry, "TokenizeReqMsg")
                continue
            out.append(self._one(msg))
        return out

    def _one(self, msg: TokenizeReqMsg) -> tuple[str, Message]:
        prefix = self.bus.prefix
        try:
            gen = self.requests.to_generate(msg, self._context_len(msg.worker_id))
            return worker_in_stream(prefix, msg.worker_id), gen
        except RequestError as exc:
            code, status, text = exc.code, 400, str(exc)
        except Exception as exc:  # a bug must fail one request, not the service
            logger.exception("tokenizing %s failed", msg.rid)
            code, status, text = "internal", 500, f"tokenizer: {type(exc).__name__}: {exc}"
        source = f"{TOKENIZER_KIND}:{self.spec.consumer}"
        error = ErrorMsg(msg.rid, msg.router_id, code, text, status, source)
        return router_out_stream(prefix, msg.router_id), error

    def _context_len(self, worker_id: str) -> int | None:
        if time.monotonic() - self._workers_at > self.WORKERS_REFRESH_S:
            self._workers = list_live(self.bus.redis, self.bus.prefix, WORKER_KIND)
            self._workers_at = time.monotonic()
        load = self._workers.get(worker_id)
        return load.context_len if isinstance(load, WorkerLoadMsg) else None


def run(settings: TokenizerSettings) -> None:
    from engine.tokenizer import load_tokenizer
    from services.engine_args import ensure_model

    common = settings.common
    url = common.require_redis_url()  # fail before the slow part
    consumer = settings.consumer or default_service_id()
    logging.getLogger().handlers.clear()  # this process logs through setup_logging only
    setup_logging(TOKENIZER_KIND, consumer, common.log_level)
    model = ensure_model(settings.model)
    requests = RequestTokenizer(load_tokenizer(model), *model_limits(model))
    spec = GroupSpec(
        TOKENIZER_KIND,
        tokenize_stream(common.prefix),
        TOKENIZER_GROUP,
        consumer,
        settings.batch_size,
        settings.block_ms,
    )
    bus = Bus.from_url(url, common.prefix, maxlen=common.stream_maxlen)
    service = GroupConsumer(bus, spec, common, Tokenizer(bus, spec, requests).handle)
    stop_on_signals(service.stop)
    service.run()
    logger.info("stopped after %d requests", service.num_handled)


def _main(ns: argparse.Namespace) -> None:
    run(settings_from_args(TokenizerSettings, ns))
    exit_process(0)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="a tokenizer service (text → token ids)")
    add_settings_args(p, TokenizerSettings)
    p.set_defaults(func=_main)
