"""The tokenizer service: text or chat messages in, checked token ids out to a worker.

Reads `{p}:tokenize` in group `tokenizers` (any number of tokenizers share it). Each
`TokenizeReqMsg` becomes token ids (`services.tokenize_request`: `text` encoded as the
offline engine encodes it, `messages` rendered with the model's chat template,
`input_ids` as given), checked, and forwarded as a `GenerateReqMsg` to `{p}:worker:{w}:in`
for the worker the router chose; a query (`reply`: the router's `/tokenize` and
`/detokenize`) is answered with a `TokenizeRespMsg` on the router's stream instead. A request
that fails becomes an `ErrorMsg` (status 400; 500 for a bug) on the router's stream
`{p}:router:{r}:out`. Entries are acked after forwarding;
those of a dead tokenizer are taken over after `--claim-idle-ms` (the worker ignores a
request id it already has).

The context length is the target worker's (from its heartbeat: it may run with
`--context-length`), else the model's config.

    sluice tokenizer --redis-url redis://127.0.0.1:6379/0 --model /models/m
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence

from services.group_consumer import (
    GroupConsumer,
    GroupSpec,
    dead_letter_unexpected,
    exit_process,
    stop_on_signals,
)
from services.tokenize_request import RequestError, RequestTokenizer, model_limits
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
from shared.messages import ErrorMsg, Message, TokenizeReqMsg, WorkerLoadMsg
from shared.settings import (
    TokenizerSettings,
    add_settings_args,
    default_service_id,
    settings_from_args,
)

logger = logging.getLogger(__name__)


# Keys of the sampling dict that travel as GenerateReqMsg fields instead.
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
            if msg.reply:  # a query (the router's /tokenize, /detokenize): answer it
                return router_out_stream(prefix, msg.router_id), self.requests.answer(msg)
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
