"""BERT-style encoders served through the router, a tokenizer, a worker and a detokenizer,
started with no pooling flags (the architecture and the sentence-transformers config say
it): a BERT cross-encoder's `/v1/rerank` and `/v1/score` are transformers' sigmoid of its
logits on the tokenizer's pairs (the second text's token types crossing the streams); an
XLM-R embedding model's `/v1/embeddings` are transformers' [CLS] states, normalised, up to a
prompt of all 512 positions."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx2 as httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForSequenceClassification

from engine.tokenizer import load_tokenizer
from tests.factories import tiny_model
from tests.system.procs import WORKER_TEST_ARGS, Stack, start_stack

pytest_plugins = ["tests.redis_fixtures"]

QUERY = "where does the scheduler keep the requests"
DOCS = ["the scheduler keeps a waiting queue", "paris is in france", "你好 🙂", "x y z"]
TEXTS = ["the cache keeps the prefix", "a small model runs on the CPU", "🙂"]
TOL = 1e-5


@pytest.fixture(scope="module")
def reranker(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = str(tmp_path_factory.mktemp("bert-reranker-logs"))
    args = (*WORKER_TEST_ARGS, "--chunked-prefill-size", "8")  # (overridden: one piece)
    model = tiny_model("bert", num_labels=1)
    with start_stack(redis_url, model, logs, worker_args=args, router=True) as st:
        st.wait_ready()
        yield st


@pytest.fixture(scope="module")
def embedder(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = str(tmp_path_factory.mktemp("xlmr-embedder-logs"))
    model = tiny_model("xlm-roberta")
    with start_stack(redis_url, model, logs, worker_args=WORKER_TEST_ARGS, router=True) as st:
        st.wait_ready()
        yield st


def post(stack: Stack, path: str, **body: object) -> httpx.Response:
    body = {"model": os.path.basename(stack.model), **body}
    return httpx.post(stack.router_url + path, json=body, timeout=60)


@torch.inference_mode()
def test_bert_rerank_and_score_are_transformers_sigmoid(reranker: Stack) -> None:
    tok = load_tokenizer(reranker.model, padding_side="right")
    batch = tok([QUERY] * len(DOCS), DOCS, padding=True, return_tensors="pt",
                return_token_type_ids=True)  # fmt: skip
    model = AutoModelForSequenceClassification.from_pretrained(reranker.model)
    want = torch.sigmoid(model(**batch).logits[:, 0]).numpy()
    resp = post(reranker, "/v1/rerank", query=QUERY, documents=DOCS)
    assert resp.status_code == 200, resp.text
    results = resp.json()["results"]
    order = np.argsort(-want).tolist()
    assert [r["index"] for r in results] == order
    assert np.abs(np.array([r["relevance_score"] for r in results]) - want[order]).max() < TOL
    score = post(reranker, "/v1/score", text_1=QUERY, text_2=DOCS)
    got = np.array([d["score"] for d in score.json()["data"]])
    assert np.abs(got - want).max() < TOL and want.std() > 0.05
    generate = post(reranker, "/v1/completions", prompt="a", max_tokens=2)
    assert generate.status_code == 400, generate.text  # (a pooling-only deployment)


@torch.inference_mode()
def test_xlmr_embeddings_are_transformers_cls_states(embedder: Stack) -> None:
    tok = load_tokenizer(embedder.model, padding_side="right")
    model = AutoModel.from_pretrained(embedder.model)
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    want = F.normalize(model(**batch).last_hidden_state[:, 0], dim=-1).numpy()
    resp = post(embedder, "/v1/embeddings", input=TEXTS)
    assert resp.status_code == 200, resp.text
    got = np.array([d["embedding"] for d in resp.json()["data"]])
    assert np.abs(got - want).max() < TOL
    full = tok(" ".join(TEXTS * 300), truncation=True, max_length=512)["input_ids"]
    resp = post(embedder, "/v1/embeddings", input=[full])  # all 512 positions
    assert resp.status_code == 200, resp.text
    one = model(input_ids=torch.tensor([full])).last_hidden_state[0, 0]
    got = np.array(resp.json()["data"][0]["embedding"])
    assert np.abs(got - F.normalize(one, dim=-1).numpy()).max() < TOL
    over = post(embedder, "/v1/embeddings", input=[full + full[-1:]])
    assert over.status_code == 400 and "513" in over.text, over.text
