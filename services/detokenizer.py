"""The detokenizer service: step messages in, text deltas out, no per-request state.

Reads `{p}:detok` in group `detokenizers` (any number of detokenizers share it), turns
each worker step (`StepOutputMsg`) into one `DetokOutputMsg` per router with rows in the
step (`services.detokenize`), appends those to `{p}:router:{r}:out`, then acks. Entries
of a dead detokenizer are taken over after `--claim-idle-ms`; a step handled twice sends
the same rows twice, which routers ignore (they keep each token range once).

    sluice detokenizer --redis-url redis://127.0.0.1:6379/0 --model /models/m
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from services.detokenize import StepDetokenizer
from services.group_consumer import (
    GroupConsumer,
    GroupSpec,
    dead_letter_unexpected,
    exit_process,
    stop_on_signals,
)
from shared.bus import Bus, Entry
from shared.keys import DETOKENIZER_GROUP, DETOKENIZER_KIND, detok_stream, router_out_stream
from shared.logging import setup_logging
from shared.messages import ErrorMsg, Message, StepOutputMsg
from shared.settings import (
    DetokenizerSettings,
    add_settings_args,
    default_service_id,
    settings_from_args,
)

logger = logging.getLogger(__name__)


class Detokenizer:
    """Handles batches of `{p}:detok` entries for `GroupConsumer`."""

    def __init__(self, bus: Bus, spec: GroupSpec, detok: StepDetokenizer) -> None:
        self.bus = bus
        self.spec = spec
        self.detok = detok

    def handle(self, entries: Sequence[Entry]) -> list[tuple[str, Message]]:
        out: list[tuple[str, Message]] = []
        for entry in entries:
            msg = entry[1]
            if not isinstance(msg, StepOutputMsg):
                dead_letter_unexpected(self.bus, self.spec, entry, "StepOutputMsg")
                continue
            try:
                outputs = self.detok.detokenize_step(msg)
            except Exception as exc:  # e.g. token ids the tokenizer does not know
                logger.exception("step %d of worker %s failed", msg.step, msg.worker_id)
                out += self._fail(entry, msg, exc)
                continue
            prefix = self.bus.prefix
            out += [(router_out_stream(prefix, o.router_id), o) for o in outputs]
        return out

    def _fail(self, entry: Entry, msg: StepOutputMsg, exc: Exception) -> list[tuple[str, Message]]:
        """Dead-letter the step and fail its requests, so their routers need not time out."""
        reason = f"detokenizing failed: {type(exc).__name__}: {exc}"
        self.bus.dead_letter(self.spec.stream, entry[0], msg.to_msg(), reason, self.spec.group)
        source = f"{DETOKENIZER_KIND}:{self.spec.consumer}"
        return [
            (
                router_out_stream(self.bus.prefix, router_id),
                ErrorMsg(rid, router_id, "internal", reason, 500, source),
            )
            for rid, router_id in dict(zip(msg.rids, msg.router_ids, strict=True)).items()
        ]


def run(settings: DetokenizerSettings) -> None:
    from engine.tokenizer import load_tokenizer
    from services.engine_args import ensure_model

    common = settings.common
    url = common.require_redis_url()  # fail before the slow part
    consumer = settings.consumer or default_service_id()
    logging.getLogger().handlers.clear()  # this process logs through setup_logging only
    setup_logging(DETOKENIZER_KIND, consumer, common.log_level)
    spec = GroupSpec(
        DETOKENIZER_KIND,
        detok_stream(common.prefix),
        DETOKENIZER_GROUP,
        consumer,
        settings.batch_size,
        settings.block_ms,
    )
    detok = StepDetokenizer(load_tokenizer(ensure_model(settings.model)))
    bus = Bus.from_url(url, common.prefix, maxlen=common.stream_maxlen)
    service = GroupConsumer(bus, spec, common, Detokenizer(bus, spec, detok).handle)
    stop_on_signals(service.stop)
    service.run()
    logger.info("stopped after %d step messages", service.num_handled)


def _main(ns: argparse.Namespace) -> None:
    run(settings_from_args(DetokenizerSettings, ns))
    exit_process(0)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("detokenizer", help="a detokenizer service (token ids → text deltas)")
    add_settings_args(p, DetokenizerSettings)
    p.set_defaults(func=_main)
