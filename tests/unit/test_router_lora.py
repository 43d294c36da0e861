"""`update_adapters`, the router's half of loading and unloading LoRA adapters, over workers
that answer in every way they can: workers without LoRA are left out (all of them: a 400),
a refusal is a 400 naming the worker and its reason and where it did succeed, unloading a
name no worker has is a 404, a worker that does not answer is a 503."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.router_lora import update_adapters
from services.router_protocol import ApiError
from shared.messages import LoraReqMsg, LoraRespMsg


class _Workers:
    def model_names(self) -> set[str]:
        return {"/models/tiny", "tiny"}


class _Questions:
    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers, self.asked = answers, []

    async def ask(self, question: Any, timeout_s: float) -> dict[str, LoraRespMsg | None]:
        msg = question("q1")
        self.asked.append(msg)
        return {w: (f(msg) if f else None) for w, f in self.answers.items()}


class _Redis:
    def __init__(self) -> None:
        self.hashes: dict[str, dict[str, str]] = {}

    async def hset(self, key: str, name: str, value: str) -> None:
        self.hashes.setdefault(key, {})[name] = value


class _Bus:
    prefix = "p"

    def __init__(self) -> None:
        self.redis = _Redis()


class _Broker:
    def __init__(self, answers: dict[str, Any]) -> None:
        self.bus = _Bus()
        self.router_id, self.workers = "r1", _Workers()
        self.to_workers = _Questions(answers)
        self.refreshed = 0

    async def refresh_workers(self) -> None:
        self.refreshed += 1


class _Router:
    model_name = "served"

    def __init__(self, answers: dict[str, Any]) -> None:
        self.broker = _Broker(answers)


def ok(adapters: dict[str, str]):
    return lambda m: LoraRespMsg(m.request_id, m.router_id, "w", True, "", True, adapters)


def refuse(why: str, enabled: bool = True):
    return lambda m: LoraRespMsg(m.request_id, m.router_id, "w", False, why, enabled, {})


def call(answers: dict[str, Any], *args: Any) -> tuple[_Router, Any]:
    router = _Router(answers)
    try:
        return router, asyncio.run(update_adapters(router, *args))
    except ApiError as exc:
        return router, exc


def test_load_on_every_lora_worker() -> None:
    answers = {"w0": ok({"a": "/x/a"}), "w1": ok({"a": "/x/a", "b": "/x/b"}),
               "w2": refuse("LoRA is not enabled", enabled=False)}  # fmt: skip
    router, out = call(answers, "load", "a", "/x/a", True)
    assert out == {"a": "/x/a", "b": "/x/b"}
    assert router.broker.to_workers.asked == [LoraReqMsg("q1", "r1", "load", "a", "/x/a", True)]
    assert router.broker.refreshed == 2  # before asking, and after the answers
    # recorded for workers that start later
    assert router.broker.bus.redis.hashes == {"p:lora-adapters": {"a": "/x/a"}}


@pytest.mark.parametrize(
    ("answers", "args", "status", "why"),
    [
        ({"w0": refuse("not enabled", enabled=False)}, ("load", "a", "/x"), 400,
         "no live worker serves LoRA adapters (start workers with --enable-lora"),
        ({"w0": ok({"a": "/x"}), "w1": refuse("no adapter_config.json in /x")},
         ("load", "a", "/x"), 400,
         "'a' not loaded: w1: no adapter_config.json in /x (done on w0)"),
        ({"w0": refuse("the LoRA adapter 'a' is not loaded (served: none)")},
         ("unload", "a"), 404, "'a' not unloaded: w0: the LoRA adapter 'a' is not loaded"),
        ({"w0": refuse("the LoRA adapter 'a' is not loaded"), "w1": refuse("boom")},
         ("unload", "a"), 400, "w1: boom"),
        ({"w0": ok({"a": "/x"}), "w1": None}, ("load", "a", "/x"), 503, "no answer from w1"),
        ({"w0": ok({})}, ("load", "served", "/x"), 400, "'served' is the base model's name"),
        ({"w0": ok({})}, ("load", "tiny", "/x"), 400, "'tiny' is the base model's name"),
        ({"w0": ok({})}, ("unload", ""), 400, "lora_name must not be empty"),
    ],
)  # fmt: skip
def test_failures(answers: dict, args: tuple, status: int, why: str) -> None:
    router, out = call(answers, *args)
    assert isinstance(out, ApiError), out
    assert (out.status, why in out.message) == (status, True), out.message
    assert router.broker.bus.redis.hashes == {}  # nothing recorded
