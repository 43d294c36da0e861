"""`sluice serve --enable-hierarchical-cache`: a chat whose earlier turn was evicted from the
worker's small KV pool by other conversations is served from host memory at its next turn
(`cached_tokens` in its usage), with the same answer as a server without it, and the
worker's host pool shows in /metrics."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest

from tests.factories import tiny_model
from tests.system.procs import router_available, sluice_serve

pytestmark = pytest.mark.skipif(not router_available(), reason="router dependencies missing")

# documents of ~600 tokens for the tiny tokenizer; the worker's pool holds about two
DOCS = [" ".join(f"doc{d} line {i} says {w}." for i, w in enumerate(["red", "blue", "green",
        "gold", "teal", "pink", "gray", "navy"] * 6)) for d in range(4)]  # fmt: skip


@pytest.fixture(scope="module", params=[True, False], ids=["hicache", "radix"])
def served(request, tmp_path_factory) -> Iterator[tuple[bool, str]]:
    log_path = tmp_path_factory.mktemp("hicache") / "serve.log"
    flags = ["--enable-hierarchical-cache"] if request.param else []
    with sluice_serve(
        str(log_path), "--model", tiny_model("qwen3"), "--max-total-tokens", "1536",
        "--disable-overlap-schedule", *flags,
    ) as (url, _):  # fmt: skip
        yield request.param, url


def _chat(client: httpx.Client, model: str, doc: str, question: str) -> tuple[str, int, int]:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
    }
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    usage = out["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return out["choices"][0]["message"]["content"], usage["prompt_tokens"], cached


ANSWERS: dict[bool, list[str]] = {}


def test_evicted_conversation_comes_back_from_host_memory(served) -> None:
    hicache, url = served
    with httpx.Client(base_url=url, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        answers = []
        for doc in DOCS:  # each evicts the ones before it from the device pool
            answers.append(_chat(client, model, doc, "What is line 3?")[0])
        text, prompt, cached = _chat(client, model, DOCS[0], "What is line 3?")
        answers.append(text)
        deadline = time.monotonic() + 10  # the worker's heartbeat lags a little
        while True:
            metrics = client.get("/metrics").text
            found = re.search(r"sluice:hicache_host_hit_tokens\{[^}]*\} (\d+)", metrics)
            hits = int(found.group(1)) if found else None
            if not hicache or (hits or 0) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    ANSWERS[hicache] = answers
    if hicache:
        assert cached >= prompt - 20, (cached, prompt)  # all but the unaligned tail
        # (the chat template's leading tokens, shared by every conversation, stayed on the
        # device; the rest came from host memory)
        assert hits is not None and prompt // 2 < hits <= cached
    else:
        assert cached < prompt // 2  # the plain radix cache had forgotten it
        assert hits == 0
    if len(ANSWERS) == 2:
        assert ANSWERS[True] == ANSWERS[False]
