"""Classify, score and rerank on the router without a stack: the bodies they take, which
deployments can answer them, the pairs they make, and their answers from given logits or
embeddings (the workers' side is stubbed: `pooled` returns what a worker would)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest

import services.router_scores as scores
from services.router_protocol import ApiError, parse_body
from services.router_workers import WorkerTable


def worker(labels: list[str] | None = None, embedding: bool = True) -> SimpleNamespace:
    return SimpleNamespace(is_embedding=embedding, labels=labels)


class FakeRouter:
    """A router whose workers pool each sub-request into `vector_of(sub)`."""

    model_name = "served"

    def __init__(self, live: dict, vector_of) -> None:
        table = WorkerTable()
        table.live = live
        self.broker = SimpleNamespace(workers=table)
        self.vector_of = vector_of
        self.subs: list = []

    async def resolve_model(self, name: str) -> None:
        return None


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    def make(live: dict, vector_of) -> FakeRouter:
        router = FakeRouter(live, vector_of)

        async def pooled(_router, subs):
            router.subs += subs
            f32 = [np.asarray(vector_of(s), dtype="<f4").tobytes() for s in subs]
            return [(v, SimpleNamespace(prompt_tokens=3)) for v in f32]

        monkeypatch.setattr(scores, "pooled", pooled)
        return router

    return make


def body(cls, **kw):
    return parse_body(cls, json.dumps(kw).encode())


def run(coro):
    return asyncio.run(coro)


def test_the_deployments_pooling_model_decides() -> None:
    table = WorkerTable()
    table.live = {"a": worker(["yes"]), "g": worker(embedding=False)}
    assert table.pooling_labels() == ["yes"]
    table.live = {"e": worker()}
    assert table.pooling_labels() is None
    table.live = {"a": worker(["yes"]), "e": worker()}
    with pytest.raises(ApiError, match="different models"):
        table.pooling_labels()
    table.live = {"g": worker(embedding=False)}
    with pytest.raises(ApiError, match="--is-embedding or a classifier") as err:
        table.pooling_labels()
    assert err.value.status == 400


def test_classify_gives_each_inputs_probabilities_and_label(fake) -> None:
    logits = {"a": [2.0, 0.0, -1.0], "b": [0.0, 3.0, 0.0]}
    router = fake({"c": worker(["neg", "neu", "pos"])}, lambda s: logits[s.text])
    out = run(scores.classify(router, body(scores.ClassifyRequest, input=["a", "b"])))
    assert out["object"] == "list" and out["model"] == "served"
    assert [(d["index"], d["label"], d["num_classes"]) for d in out["data"]] == [
        (0, "neg", 3), (1, "neu", 3)]  # fmt: skip
    e = np.exp(logits["a"])
    assert out["data"][0]["probs"] == pytest.approx(list(e / e.sum()))
    assert out["usage"] == {"prompt_tokens": 6, "total_tokens": 6, "completion_tokens": 0}
    raw = run(scores.classify(router, body(scores.ClassifyRequest, input="b",
                                           use_activation=False)))  # fmt: skip
    assert raw["data"][0]["probs"] == logits["b"]
    embedder = fake({"e": worker()}, lambda s: [1.0, 0.0])
    with pytest.raises(ApiError, match="/v1/embeddings"):
        run(scores.classify(embedder, body(scores.ClassifyRequest, input="a")))


def test_a_cross_encoder_scores_each_pair_as_one_prompt(fake) -> None:
    router = fake({"c": worker(["LABEL_0"])}, lambda s: [len(s.text_pair) - 3.0])
    req = body(scores.ScoreRequest, text_1="q", text_2=["abc", "abcdef", "a"])
    out = run(scores.score(router, req))
    assert [(s.text, s.text_pair, s.embed) for s in router.subs] == [
        ("q", "abc", True), ("q", "abcdef", True), ("q", "a", True)]  # fmt: skip
    sigmoid = [1 / (1 + np.exp(-x)) for x in (0.0, 3.0, -2.0)]
    assert [d["score"] for d in out["data"]] == pytest.approx(sigmoid)
    assert [d["object"] for d in out["data"]] == ["score"] * 3
    zipped = body(scores.ScoreRequest, text_1=["a", "b"], text_2=["cc", "dddd"])
    assert zipped.pairs() == [("a", "cc"), ("b", "dddd")]
    with pytest.raises(ApiError, match="give one or as many"):
        body(scores.ScoreRequest, text_1=["a", "b"], text_2=["c", "d", "e"]).pairs()
    two = fake({"c": worker(["x", "y"])}, lambda s: [0.0, 1.0])
    with pytest.raises(ApiError, match="has 2 labels"):
        run(scores.score(two, req))


def test_an_embedding_model_scores_by_cosine_embedding_each_text_once(fake) -> None:
    vectors = {"q": [1.0, 0.0], "x": [0.6, 0.8], "y": [0.0, 1.0]}
    router = fake({"e": worker()}, lambda s: vectors[s.text])
    out = run(scores.score(router, body(scores.ScoreRequest, text_1="q", text_2=["x", "y", "x"])))
    assert [d["score"] for d in out["data"]] == pytest.approx([0.6, 0.0, 0.6], abs=1e-6)
    assert sorted(s.text for s in router.subs) == ["q", "x", "y"]  # the query once, x once
    assert all(s.text_pair is None for s in router.subs)


def test_rerank_orders_documents_best_first(fake) -> None:
    router = fake({"c": worker(["LABEL_0"])}, lambda s: [float(len(s.text_pair))])
    docs = ["bb", "dddd", "a", "ccc"]
    out = run(scores.rerank(router, body(scores.RerankRequest, query="q", documents=docs)))
    assert [r["index"] for r in out["results"]] == [1, 3, 0, 2]
    assert [r["document"]["text"] for r in out["results"]] == ["dddd", "ccc", "bb", "a"]
    assert out["results"][0]["relevance_score"] == pytest.approx(1 / (1 + np.exp(-4.0)))
    assert out["usage"] == {"prompt_tokens": 12, "total_tokens": 12}
    top = run(scores.rerank(router, body(scores.RerankRequest, query="q", documents=docs,
                                         top_n=2, return_documents=False)))  # fmt: skip
    assert [r["index"] for r in top["results"]] == [1, 3]
    assert "document" not in top["results"][0]


@pytest.mark.parametrize(
    "cls, bad",
    [
        (scores.RerankRequest, {"query": "q", "documents": []}),
        (scores.RerankRequest, {"query": "q", "documents": "one string"}),
        (scores.RerankRequest, {"query": "", "documents": ["d"]}),
        (scores.RerankRequest, {"query": "q", "documents": ["d"], "top_n": -1}),
        (scores.ScoreRequest, {"text_1": "q", "text_2": []}),
        (scores.ScoreRequest, {"text_1": "q", "text_2": ["d", ""]}),
        (scores.ScoreRequest, {"text_1": "q", "text_2": [1, 2]}),
        (scores.ClassifyRequest, {"input": []}),
    ],
)
def test_bad_bodies_are_400s(cls, bad) -> None:
    with pytest.raises(ApiError) as err:
        body(cls, **bad)
    assert err.value.status == 400
