"""`POST /v1/embeddings` through the router, a tokenizer, a worker started with
`--is-embedding` and a detokenizer: the offline engine's embeddings, as floats or base64
(the official `openai` client's default), for texts and token ids, with usage; a
generation request to this embedding-only deployment, and bad inputs, are 400s."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator

import httpx2 as httpx
import numpy as np
import openai
import pytest

from engine.engine import Engine
from tests.factories import tiny_model
from tests.system.procs import WORKER_TEST_ARGS, Stack, start_stack

pytest_plugins = ["tests.redis_fixtures"]

TEXTS = ["The capital of France is", "def fibonacci(n):", "你好, embeddings 🙂"]


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = str(tmp_path_factory.mktemp("embedding-stack-logs"))
    args = (*WORKER_TEST_ARGS, "--is-embedding", "--chunked-prefill-size", "8")
    with start_stack(redis_url, tiny_model("qwen3"), logs, worker_args=args, router=True) as st:
        st.wait_ready()
        yield st


@pytest.fixture(scope="module")
def want() -> list[list[float]]:
    with Engine(model_path=tiny_model("qwen3"), is_embedding=True) as engine:
        return [o["embedding"] for o in engine.encode(prompt=TEXTS)]


def post(stack: Stack, **body: object) -> httpx.Response:
    body = {"model": os.path.basename(stack.model), **body}
    return httpx.post(stack.router_url + "/v1/embeddings", json=body, timeout=60)


def test_embeddings_of_texts_equal_the_offline_engines(stack: Stack, want) -> None:
    resp = post(stack, input=TEXTS)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["object"] == "list" and out["model"] == os.path.basename(stack.model)
    assert [d["index"] for d in out["data"]] == [0, 1, 2]
    got = np.array([d["embedding"] for d in out["data"]])
    assert np.abs(got - np.array(want)).max() < 1e-6
    usage = out["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > len(TEXTS)
    one = post(stack, input=TEXTS[1]).json()  # a single string
    assert np.abs(np.array(one["data"][0]["embedding"]) - want[1]).max() < 1e-6


def test_the_openai_client_reads_base64(stack: Stack, want) -> None:
    client = openai.OpenAI(base_url=stack.router_url + "/v1", api_key="unused", max_retries=0)
    out = client.embeddings.create(model=os.path.basename(stack.model), input=TEXTS)
    got = np.array([d.embedding for d in out.data])
    assert np.abs(got - np.array(want)).max() < 1e-6
    raw = post(stack, input=TEXTS[:1], encoding_format="base64").json()["data"][0]["embedding"]
    floats = np.frombuffer(base64.b64decode(raw), dtype="<f4").tolist()
    assert floats == pytest.approx(want[0], abs=1e-6)


def test_sglangs_encode(stack: Stack, want) -> None:
    one = httpx.post(stack.router_url + "/encode", json={"text": TEXTS[0]}, timeout=60).json()
    assert one["embedding"] == pytest.approx(want[0], abs=1e-6)
    assert one["meta_info"]["prompt_tokens"] > 0
    batch = httpx.post(stack.router_url + "/encode", json={"text": TEXTS}, timeout=60).json()
    assert np.abs(np.array([o["embedding"] for o in batch]) - np.array(want)).max() < 1e-6
    by_ids = httpx.post(stack.router_url + "/encode", json={"input_ids": [5, 6, 7]}, timeout=60)
    assert by_ids.json()["meta_info"]["prompt_tokens"] == 3
    resp = httpx.post(stack.router_url + "/encode", json={}, timeout=60)
    assert resp.status_code == 400 and "exactly one" in resp.json()["error"]["message"]


def test_token_id_inputs_and_truncation(stack: Stack) -> None:
    ids = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    whole = post(stack, input=ids).json()
    assert whole["usage"]["prompt_tokens"] == 9
    cut = post(stack, input=[ids[0]], truncate_prompt_tokens=3).json()
    tail = post(stack, input=[ids[0][-3:]]).json()
    assert cut["usage"]["prompt_tokens"] == 3
    # (the second runs on the first's cached prefix: equal up to float rounding)
    assert cut["data"][0]["embedding"] == pytest.approx(tail["data"][0]["embedding"], abs=1e-6)
    gap = np.abs(np.array(cut["data"][0]["embedding"]) - whole["data"][0]["embedding"]).max()
    assert gap > 1e-3


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"input": ""}, 400, "input string is empty"),
        ({"input": []}, 400, "input: "),
        ({"input": [1, "a"]}, 400, "input: "),
        ({"input": "hi", "dimensions": 8}, 400, "matryoshka"),
        ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": [[3] * 5000]}, 400, "context length"),
        ({"input": "hi", "model": "nope"}, 404, "does not exist"),
    ],
)
def test_bad_requests(stack: Stack, body: dict, status: int, needle: str) -> None:
    resp = post(stack, **body)
    assert resp.status_code == status, resp.text
    assert needle in resp.json()["error"]["message"]


def test_generation_requests_are_refused_and_health_checks_embed(stack: Stack) -> None:
    body = {"model": os.path.basename(stack.model), "prompt": "hi", "max_tokens": 4}
    resp = httpx.post(stack.router_url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert "use /v1/embeddings" in resp.json()["error"]["message"]
    health = httpx.get(stack.router_url + "/health_generate", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text


def test_score_and_rerank_with_an_embedding_model_are_cosine_similarities(stack, want) -> None:
    """vLLM's `/v1/score` and `/v1/rerank` on an embedding model: each text embedded once, a
    pair's score the cosine similarity of its two embeddings (here: normalised, so their dot)."""
    vectors = np.array(want)
    out = httpx.post(stack.router_url + "/v1/score", timeout=60,
                     json={"text_1": TEXTS[0], "text_2": TEXTS}).json()  # fmt: skip
    cosine = vectors @ vectors[0]
    assert [d["score"] for d in out["data"]] == pytest.approx(cosine.tolist(), abs=1e-5)
    assert out["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)  # a text with itself
    ranked = httpx.post(stack.router_url + "/v1/rerank", timeout=60,
                        json={"query": TEXTS[1], "documents": TEXTS, "top_n": 2}).json()
    order = np.argsort(-(vectors @ vectors[1]))[:2].tolist()
    assert [r["index"] for r in ranked["results"]] == order == [1, order[1]]
    assert ranked["results"][0]["document"] == {"text": TEXTS[1]}
    resp = httpx.post(stack.router_url + "/v1/classify", json={"input": "hi"}, timeout=30)
    assert resp.status_code == 400 and "/v1/embeddings" in resp.json()["error"]["message"]


def test_chat_messages_are_embedded_as_their_template_renders_them(stack: Stack) -> None:
    from engine.tokenizer import apply_chat_template, load_tokenizer

    chat = [{"role": "system", "content": "Represent the question"},
            {"role": "user", "content": TEXTS[0]}]  # fmt: skip
    ids = apply_chat_template(load_tokenizer(stack.model), chat, add_generation_prompt=False)
    by_ids = post(stack, input=[ids]).json()["data"][0]["embedding"]
    out = post(stack, messages=chat).json()
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["data"][0]["embedding"] == pytest.approx(by_ids, abs=1e-6)
    plain = post(stack, input=TEXTS[0]).json()["data"][0]["embedding"]
    assert np.abs(np.array(plain) - by_ids).max() > 1e-3  # (the template changed the prompt)


def test_unnormalized_embeddings_and_vllms_pooling_route(stack: Stack, want) -> None:
    """vLLM's `normalize: false`: the pooled vectors as the offline engine gives them with
    `normalize=False` (their norms are not 1); `/pooling`: the same vectors, vLLM's shape."""
    with Engine(model_path=tiny_model("qwen3"), is_embedding=True) as engine:
        raw = [o["embedding"] for o in engine.encode(prompt=TEXTS, normalize=False)]
    norms = np.linalg.norm(np.array(raw), axis=1)
    assert (np.abs(norms - 1) > 1e-3).all()
    np.testing.assert_allclose(np.array(raw) / norms[:, None], np.array(want), atol=1e-5)
    got = post(stack, input=TEXTS, normalize=False).json()
    assert "data" in got, got
    # (as close as the normalised ones are, relative to the norm: the worker prefills in chunks)
    got_raw = np.array([d["embedding"] for d in got["data"]])
    np.testing.assert_allclose(got_raw, raw, rtol=0, atol=2e-6 * norms.max())
    body = {"model": os.path.basename(stack.model), "input": TEXTS}
    pooled = httpx.post(stack.router_url + "/pooling", json=body, timeout=60).json()
    assert pooled["object"] == "list" and pooled["id"].startswith("pool-")
    assert [d["object"] for d in pooled["data"]] == ["pooling"] * len(TEXTS)
    np.testing.assert_allclose(np.array([d["data"] for d in pooled["data"]]), want, atol=1e-6)
    assert pooled["usage"]["prompt_tokens"] > len(TEXTS)
    bad = httpx.post(stack.router_url + "/pooling", json={**body, "normalize": "no"}, timeout=60)
    assert bad.status_code == 400
