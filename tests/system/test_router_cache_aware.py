"""Cache-aware routing over two real workers (`sluice serve --dp-size 2`): a prompt's
follow-ups go to the worker that was sent its prefix and are served from that worker's
prefix cache; new prefixes spread over the workers; a conversation stays on its worker
turn after turn; /flush_cache makes the router forget."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx2 as httpx
import pytest
import redis

from services.serve import count_live
from tests.factories import tiny_model
from tests.system.procs import router_available, sluice_serve

pytestmark = pytest.mark.skipif(not router_available(), reason="router dependencies missing")

DOCS = {
    name: " ".join(f"{name} fact {i} is {word}." for i, word in enumerate(words * 4))
    for name, words in {
        "alpha": ["red", "green", "blue", "gold", "teal", "pink", "gray", "navy"],
        "beta": ["one", "two", "three", "four", "five", "six", "seven", "eight"],
    }.items()
}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(router URL, redis URL) of `sluice serve --dp-size 2` with the cache-aware policy."""
    log_path = tmp_path_factory.mktemp("dp") / "serve.log"
    with sluice_serve(
        str(log_path), "--model", tiny_model("qwen3"), "--dp-size", "2",
        "--policy", "cache_aware", "--disable-overlap-schedule", "--max-total-tokens", "8192",
    ) as urls:  # fmt: skip
        yield urls


def _routed(client: httpx.Client) -> dict[tuple[str, str], int]:
    text = client.get("/metrics").text
    pattern = (r'sluice:router_routed_requests_total\{[^}]*worker_id="([^"]+)",'
               r'reason="([^"]+)"\} (\d+)')  # fmt: skip
    return {(w, why): int(n) for w, why, n in re.findall(pattern, text)}


def _generate(client: httpx.Client, text: str) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["meta_info"]


def test_follow_ups_go_where_their_prefix_is_cached(served) -> None:
    url, redis_url = served
    client_redis = redis.Redis.from_url(redis_url)
    assert count_live(client_redis, "sluice")["worker"] == 2
    client_redis.close()
    with httpx.Client(base_url=url, timeout=120) as client:
        info = client.get("/get_server_info").json()
        assert info["policy"] == "cache_aware"
        assert sorted(w["worker_id"] for w in info["internal_states"]) == ["0", "1"]
        client.post("/flush_cache").raise_for_status()  # (a rerun of this test file)

        firsts = {name: _generate(client, doc + " Question 0?") for name, doc in DOCS.items()}
        routed = _routed(client)
        assert sorted(routed) == [("0", "new_prefix"), ("1", "new_prefix")], routed
        for i in range(1, 4):
            for name, doc in DOCS.items():
                meta = _generate(client, doc + f" Question {i}?")
                # the document's tokens (all but the last few, which the question changes)
                # come from the cache of the worker that was sent it
                doc_tokens = firsts[name]["prompt_tokens"] - 4
                assert meta["cached_tokens"] >= doc_tokens, (name, i, meta, firsts[name])
        after = _routed(client)
        assert after[("0", "prefix")] == 3 and after[("1", "prefix")] == 3, after
        assert after[("0", "new_prefix")] == after[("1", "new_prefix")] == 1

        client.post("/flush_cache").raise_for_status()  # the router forgets with the workers
        _generate(client, DOCS["alpha"] + " Question 9?")
        assert sum(n for (_, why), n in _routed(client).items() if why == "new_prefix") == 3


def test_a_conversation_stays_on_its_worker(served) -> None:
    url, _ = served
    messages = [{"role": "system", "content": DOCS["beta"]}]
    with httpx.Client(base_url=url, timeout=120) as client:
        before = _routed(client)
        model = client.get("/v1/models").json()["data"][0]["id"]
        cached = []
        for turn in range(4):
            messages.append({"role": "user", "content": f"Tell me about fact {turn}."})
            body = {"model": model, "messages": messages, "max_tokens": 3, "temperature": 0}
            resp = client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            out = resp.json()
            cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            answer = out["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": answer})
        new = {k: n - before.get(k, 0) for k, n in _routed(client).items() if n != before.get(k, 0)}
        # one worker took every turn: first as a new prefix, then by its prefix
        workers = {w for w, _ in new}
        assert len(workers) == 1 and sum(new.values()) == 4, new
        (worker,) = workers
        assert new.get((worker, "prefix")) == 3, new
        assert all(c > 0 for c in cached[1:]), cached  # each turn reuses the one before
