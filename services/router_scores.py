"""vLLM's pooling APIs beyond embeddings: `POST /v1/classify`, `/v1/score` and `/v1/rerank`
(the Jina / Cohere shape; also at `/classify`, `/score`, `/rerank` and `/v2/rerank`).

A sequence classifier (engine/models/classification.py) answers each prompt with one logit
per label. `/v1/classify` gives every input's probabilities (softmax over the labels; a
one-label model's sigmoid) and its most likely label. `/v1/score` (`text_1`, `text_2`: one
and many, or as many of each) and `/v1/rerank` (`query`, `documents`, `top_n`) score pairs:
with a cross-encoder (a classifier of one label) each pair is one prompt, the two texts
joined as the model's tokenizer joins a pair, and its score is the logit's sigmoid; with an
embedding model each text is embedded once and a pair's score is the cosine similarity of
its two embeddings (as vLLM does for both kinds). `use_activation: false` gives the raw
logits instead. Rerank results come best first, `top_n` of them (0: all).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from pydantic import Field, field_validator

from services.router_embeddings import (
    MAX_INPUTS,
    check_inputs,
    model_labels,
    pooled,
    pooling_params,
    prompt_subrequests,
)
from services.router_fields import _Strict
from services.router_protocol import ApiError, SubRequest


def _logits(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<f4").astype(np.float64)


def activated(logits: np.ndarray) -> np.ndarray:
    """A classifier's probabilities: the sigmoid of a single logit, else the softmax."""
    if logits.shape[-1] == 1:
        return 0.5 * (1.0 + np.tanh(0.5 * logits))  # (the sigmoid, without overflow)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _listed(kind: str, router: Any, body: Any, data: list, prompt_tokens: int) -> dict:
    """vLLM's answer shape: a list object of `data`, with the usage."""
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}
    return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": body.model or router.model_name, "data": data, "usage": usage}  # fmt: skip


class _PoolingFields(_Strict):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    use_activation: bool = True

    def params(self) -> dict[str, Any]:
        return pooling_params(self.truncate_prompt_tokens)


async def _run(router: Any, body: _PoolingFields, subs: list[SubRequest]) -> tuple[list, int]:
    """Each sub-request's pooled bytes, in order, and the prompt tokens they took."""
    lora = None if body.model is None else await router.resolve_model(body.model)
    for sub in subs:
        sub.lora_name = lora
    results = await pooled(router, subs)
    return [v for v, _ in results], sum(u.prompt_tokens for _, u in results)


# --- /v1/classify --------------------------------------------------------------------------------


class ClassifyRequest(_PoolingFields):
    input: Any

    @field_validator("input")
    @classmethod
    def _check_input(cls, v: Any) -> list[str] | list[list[int]]:
        return check_inputs(v)


async def classify(router: Any, body: ClassifyRequest) -> dict[str, Any]:
    labels = await model_labels(router)
    if labels is None:
        raise ApiError(400, "the model is an embedding model, not a classifier: use "
                       "/v1/embeddings", None, "invalid_request")  # fmt: skip
    subs = prompt_subrequests(body.input, body.params())
    vectors, prompt_tokens = await _run(router, body, subs)
    data = []
    for i, vector in enumerate(vectors):
        logits = _logits(vector)
        probs = activated(logits) if body.use_activation else logits
        data.append({"index": i, "label": labels[int(np.argmax(logits))],
                     "probs": probs.tolist(), "num_classes": len(labels)})  # fmt: skip
    return _listed("classify", router, body, data, prompt_tokens)


# --- /v1/score and /v1/rerank --------------------------------------------------------------------


def _texts(v: Any, name: str) -> list[str]:
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not v or not all(isinstance(t, str) for t in v):
        raise ValueError(f"{name} must be a string or a non-empty list of strings")
    if any(t == "" for t in v):
        raise ValueError(f"{name}: a text is empty")
    if len(v) > MAX_INPUTS:
        raise ValueError(f"at most {MAX_INPUTS} texts, got {len(v)}")
    return v


async def pair_scores(router: Any, body: _PoolingFields, pairs: list[tuple[str, str]]) -> tuple:
    """Each (text_1, text_2) pair's score, and the prompt tokens it took: a cross-encoder's
    sigmoid of the pair's logit, or an embedding model's cosine similarity."""
    labels = await model_labels(router)
    params = body.params()
    if labels is not None:
        if len(labels) != 1:
            raise ApiError(400, f"scoring needs a cross-encoder (a classifier of one label); "
                           f"the model has {len(labels)} labels: use /v1/classify", None,
                           "invalid_request")  # fmt: skip
        subs = [SubRequest(i, i, dict(params), text=a, text_pair=b, embed=True)
                for i, (a, b) in enumerate(pairs)]  # fmt: skip
        vectors, prompt_tokens = await _run(router, body, subs)
        logits = np.array([_logits(v)[0] for v in vectors])
        return (activated(logits[:, None])[:, 0] if body.use_activation else logits), prompt_tokens
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each embedded once
    subs = [SubRequest(i, i, dict(params), text=t, embed=True) for i, t in enumerate(texts)]
    vectors, prompt_tokens = await _run(router, body, subs)
    embedding = {t: _logits(v) for t, v in zip(texts, vectors)}
    cosine = [float(embedding[a] @ embedding[b]) / max(
        float(np.linalg.norm(embedding[a]) * np.linalg.norm(embedding[b])), 1e-12)
        for a, b in pairs]  # fmt: skip
    return np.array(cosine), prompt_tokens


class ScoreRequest(_PoolingFields):
    text_1: Any
    text_2: Any

    @field_validator("text_1", "text_2")
    @classmethod
    def _check_texts(cls, v: Any, info: Any) -> list[str]:
        return _texts(v, info.field_name)

    def pairs(self) -> list[tuple[str, str]]:
        first, second = self.text_1, self.text_2
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            msg = f"text_1 has {len(first)} texts and text_2 {len(second)}: give one or as many"
            raise ApiError(400, msg, "text_1", "invalid_value")
        return list(zip(first, second))


async def score(router: Any, body: ScoreRequest) -> dict[str, Any]:
    scores, prompt_tokens = await pair_scores(router, body, body.pairs())
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]
    return _listed("score", router, body, data, prompt_tokens)


class RerankRequest(_PoolingFields):
    query: str = Field(min_length=1)
    documents: Any
    top_n: int = Field(0, ge=0)  # 0: every document
    return_documents: bool = True

    @field_validator("documents")
    @classmethod
    def _check_documents(cls, v: Any) -> list[str]:
        return _texts(v if isinstance(v, list) else None, "documents")


async def rerank(router: Any, body: RerankRequest) -> dict[str, Any]:
    pairs = [(body.query, d) for d in body.documents]
    scores, prompt_tokens = await pair_scores(router, body, pairs)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if body.return_documents:
            result["document"] = {"text": body.documents[i]}
        results.append(result)
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    model = body.model or router.model_name
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results, "usage": usage}


ROUTES = (
    (("/v1/classify", "/classify"), ClassifyRequest, classify),
    (("/v1/score", "/score"), ScoreRequest, score),
    (("/v1/rerank", "/rerank", "/v2/rerank"), RerankRequest, rerank),
)
