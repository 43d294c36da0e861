"""A cross-encoder (a one-label sequence classifier) served through the router, a tokenizer,
a worker and a detokenizer, started without `--is-embedding` (the architecture says it):
`/v1/score`, `/v1/rerank` (and `/rerank`, `/v2/rerank`) and `/v1/classify` give the offline
engine's logits on the tokenizer's pairs, through a sigmoid; generation and embedding
requests, and bad bodies, are 400s."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx2 as httpx
import numpy as np
import pytest

from engine.engine import Engine
from engine.tokenizer import load_tokenizer
from tests.factories import tiny_model
from tests.system.procs import WORKER_TEST_ARGS, Stack, start_stack

pytest_plugins = ["tests.redis_fixtures"]

QUERY = "where is the capital of France"
DOCS = ["Paris is the capital of France.", "def fibonacci(n):", "你好 🙂", "the sky is blue"]


def model() -> str:
    return tiny_model("llama", num_labels=1)


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = str(tmp_path_factory.mktemp("classifier-stack-logs"))
    args = (*WORKER_TEST_ARGS, "--chunked-prefill-size", "8")
    with start_stack(redis_url, model(), logs, worker_args=args, router=True) as st:
        st.wait_ready()
        yield st


@pytest.fixture(scope="module")
def logits() -> np.ndarray:
    """The offline engine's logit of (QUERY, doc) for each of DOCS, and of DOCS[0] alone."""
    tok = load_tokenizer(model())
    prompts = [tok(QUERY, text_pair=d)["input_ids"] for d in DOCS] + [tok(DOCS[0])["input_ids"]]
    with Engine(model_path=model()) as engine:
        return np.array([o["embedding"][0] for o in engine.encode(input_ids=prompts)])


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def post(stack: Stack, path: str, **body: object) -> httpx.Response:
    return httpx.post(stack.router_url + path, json=body, timeout=60)


def test_score_gives_each_pairs_sigmoid(stack: Stack, logits: np.ndarray) -> None:
    resp = post(stack, "/v1/score", model=os.path.basename(stack.model), text_1=QUERY,
                text_2=DOCS)  # fmt: skip
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["object"] == "list" and [d["index"] for d in out["data"]] == [0, 1, 2, 3]
    got = np.array([d["score"] for d in out["data"]])
    assert np.abs(got - sigmoid(logits[:4])).max() < 1e-5
    assert got.std() > 0.01  # the documents score apart
    assert out["usage"]["prompt_tokens"] > sum(len(d) for d in DOCS) // 4
    raw = post(stack, "/score", text_1=[QUERY, QUERY], text_2=DOCS[:2], use_activation=False)
    assert [d["score"] for d in raw.json()["data"]] == pytest.approx(logits[:2], abs=1e-5)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents(stack: Stack, logits: np.ndarray, path: str) -> None:
    resp = post(stack, path, query=QUERY, documents=DOCS, top_n=3)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    order = np.argsort(-logits[:4])[:3].tolist()
    assert [r["index"] for r in out["results"]] == order
    assert [r["document"]["text"] for r in out["results"]] == [DOCS[i] for i in order]
    scores = [r["relevance_score"] for r in out["results"]]
    assert scores == pytest.approx(sigmoid(logits[order]).tolist(), abs=1e-5)
    assert out["usage"]["total_tokens"] > 0 and out["id"].startswith("rerank-")


def test_classify_and_the_truncated_pair(stack: Stack, logits: np.ndarray) -> None:
    out = post(stack, "/v1/classify", input=[DOCS[0]]).json()
    assert out["data"][0]["label"] == "LABEL_0" and out["data"][0]["num_classes"] == 1
    assert out["data"][0]["probs"] == pytest.approx([sigmoid(logits[4])], abs=1e-5)
    cut = post(stack, "/v1/score", text_1=QUERY, text_2=DOCS[0], truncate_prompt_tokens=6)
    assert cut.json()["usage"]["prompt_tokens"] == 6, cut.text


@pytest.mark.parametrize(
    "path, body, needle",
    [
        ("/v1/embeddings", {"model": "m", "input": "hi"}, "/v1/classify"),
        ("/v1/completions", {"model": "m", "prompt": "hi"}, "/v1/rerank"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "give one or as many"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -2}, "top_n"),
        ("/v1/classify", {"input": ""}, "empty"),
    ],
)
def test_bad_requests_are_400s(stack: Stack, path: str, body: dict, needle: str) -> None:
    if body.get("model") == "m":
        body = {**body, "model": os.path.basename(stack.model)}
    resp = post(stack, path, **body)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]


def test_health_generate_runs_the_classifier_and_the_model_info_says_so(stack: Stack) -> None:
    health = httpx.get(stack.router_url + "/health_generate", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    info = httpx.get(stack.router_url + "/get_model_info", timeout=30).json()
    assert info["is_generation"] is False
