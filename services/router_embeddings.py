"""OpenAI's embeddings API, `POST /v1/embeddings`, as vLLM and SGLang serve it, for workers
started with `--is-embedding` (engine/pooling.py).

`input` is a string, a list of strings, a list of token ids or a list of such lists (at most
`MAX_INPUTS`); each becomes one sub-request through a tokenizer to an embedding worker, which
pools the prompt's final hidden states into one normalised float32 vector. It comes back in
the request's final step row (float32 bytes, little-endian) and is answered as a list of
floats or, with `encoding_format` "base64" (what OpenAI's Python client asks for), as those
bytes in base64. vLLM's `truncate_prompt_tokens` keeps a prompt's last k tokens. `dimensions`
keeps the first k values of each embedding, normalised again, for a matryoshka model (its
config's `is_matryoshka` or `matryoshka_dimensions`, as vLLM reads them; a 400 otherwise).
vLLM's chat form takes `messages` (rendered by the chat template, no generation prompt by
default) instead of `input`: one prompt. vLLM's `normalize` false returns the pooled vectors
as they are. vLLM's `/pooling` takes the same body and answers the same vectors as
`{"object": "pooling", "data": [...]}` items. SGLang's `/encode` (`text` or `input_ids`, one
or a batch) answers `{"embedding", "meta_info"}` per input. Without an embedding worker the
request is a 400, as is a generation request to a deployment that has only embedding workers
(services/router_workers.py).
"""

from __future__ import annotations

import base64
import functools
import json
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from services.router_chat import ChatMessageIn
from services.router_fields import _Strict
from services.router_handle import merged
from services.router_models import check_adapters
from services.router_protocol import ApiError, SubRequest, parse_body
from services.router_stream import Usage

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(type(t) is int and t >= 0 for t in v)


def check_inputs(v: Any) -> list[str] | list[list[int]]:
    """A pooling request's `input` as a list of prompts (texts or token id lists)."""
    if isinstance(v, str) or _is_ids(v):
        v = [v]
    ok = isinstance(v, list) and v and (
        all(isinstance(p, str) for p in v) or all(_is_ids(p) for p in v)
    )  # fmt: skip
    if not ok:
        raise ValueError("must be a string, a list of strings, a non-empty list of token "
                         "ids, or a list of those")  # fmt: skip
    if any(p == "" for p in v):
        raise ValueError("an input string is empty")
    if len(v) > MAX_INPUTS:
        raise ValueError(f"at most {MAX_INPUTS} inputs per request, got {len(v)}")
    return v


class EmbeddingRequest(_Strict):
    model: str
    input: Any = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM's: false returns the pooled vector as it is (not L2-normalised); None: the model's
    normalize: bool | None = None
    # vLLM's chat form: `messages` instead of `input`, rendered by the model's chat template
    # (no generation prompt unless asked for) and embedded as one prompt
    messages: list[ChatMessageIn] | None = Field(None, min_length=1)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, v: Any) -> list[str] | list[list[int]]:
        return check_inputs(v)

    def to_subrequests(self) -> list[SubRequest]:
        params = pooling_params(self.truncate_prompt_tokens)
        if self.normalize is not None:
            params["normalize_embedding"] = self.normalize
        if (self.input is None) == (self.messages is None):
            raise ApiError(400, "give exactly one of input and messages", "input",
                           "invalid_value")  # fmt: skip
        if self.messages is None:
            return prompt_subrequests(self.input, params)
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(400, "continue_final_message needs add_generation_prompt=false",
                           "continue_final_message", "invalid_value")  # fmt: skip
        chat = SubRequest(0, 0, params, messages=[m.flat() for m in self.messages], embed=True,
                          add_generation_prompt=self.add_generation_prompt,
                          continue_final_message=self.continue_final_message,
                          chat_template_kwargs=self.chat_template_kwargs)  # fmt: skip
        return [chat]


def pooling_params(truncate_prompt_tokens: int | None) -> dict[str, Any]:
    """A pooling sub-request's sampling dict: no new tokens, and vLLM's truncation."""
    if truncate_prompt_tokens == 0:
        raise ApiError(400, "truncate_prompt_tokens must be -1 or >= 1",
                       "truncate_prompt_tokens", "invalid_value")  # fmt: skip
    params: dict[str, Any] = {"max_new_tokens": 0}
    if truncate_prompt_tokens is not None:
        params["truncate_prompt_tokens"] = truncate_prompt_tokens
    return params


def prompt_subrequests(prompts: list, params: dict[str, Any]) -> list[SubRequest]:
    """One pooling sub-request per prompt (a text or token ids)."""
    return [SubRequest(i, i, dict(params), embed=True,
                       **{"text" if isinstance(p, str) else "input_ids": p})
            for i, p in enumerate(prompts)]  # fmt: skip


def check_dimensions(workers: Any, dims: int) -> None:
    """400 unless every live embedding worker's model can cut its embeddings to `dims`."""
    for hb in workers.live.values():
        if not hb.is_embedding:
            continue
        allowed = hb.matryoshka_dimensions
        if allowed is None:
            raise ApiError(400, "dimensions: the model has no matryoshka representation; its "
                           "embeddings have one size", "dimensions", "unsupported")  # fmt: skip
        if allowed and dims not in allowed:
            raise ApiError(400, f"dimensions: {dims} is not one of the model's matryoshka "
                           f"sizes {allowed}", "dimensions", "invalid_value")  # fmt: skip


def cut(vector: bytes, dims: int, normalize: bool = True) -> bytes:
    """A matryoshka embedding's first `dims` values, normalised again (unless not asked)."""
    full = np.frombuffer(vector, dtype="<f4")
    if dims > len(full):
        raise ApiError(400, f"dimensions: {dims} is more than the model's {len(full)}",
                       "dimensions", "invalid_value")  # fmt: skip
    if not normalize:
        return full[:dims].tobytes()
    part = full[:dims].astype(np.float64)
    return (part / max(np.linalg.norm(part), 1e-12)).astype("<f4").tobytes()


def _floats(data: bytes) -> list[float]:
    return np.frombuffer(data, dtype="<f4").tolist()


def response_item(index: int, data: bytes, encoding: str, kind: str = "embedding") -> dict:
    """One input's entry of the answer's `data`: its float32 bytes as floats or base64, under
    `kind` ("embedding"; vLLM's /pooling: "pooling", the vector under "data")."""
    vector = base64.b64encode(data).decode("ascii") if encoding == "base64" else _floats(data)
    return {"object": kind, "index": index, ("data" if kind == "pooling" else "embedding"): vector}


async def model_labels(router: Any) -> list[str] | None:
    """The deployment's pooling model's labels (`WorkerTable.pooling_labels`; None: an
    embedding model), after a fresh look at the workers if the table has none."""
    if not router.broker.workers.live:
        await router.broker.refresh_workers()
    return router.broker.workers.pooling_labels()


async def pooled(router: Any, subs: list[SubRequest]) -> list[tuple[bytes, Usage]]:
    """Send the sub-requests to the embedding workers: each one's embedding and usage, in
    order, once all are pooled."""
    await check_adapters(router.broker, subs)
    handles = await router.broker.open(subs)
    try:
        await router.broker.submit(handles)
    except BaseException:
        for h in handles:
            h.close()
        raise
    router.num_handled += 1
    out: dict[int, tuple[bytes, Usage]] = {}
    async for index, delta in merged(handles):
        reason = delta.finish_reason
        if reason is None:
            continue
        if delta.embedding is None or delta.usage is None:  # (an abort: /abort_request)
            why = reason.message or reason.type
            raise ApiError(503, f"input {index} was not embedded: {why}", None, "aborted")
        out[index] = (delta.embedding, delta.usage)
    return [out[i] for i in range(len(subs))]


async def embed(router: Any, body: EmbeddingRequest, kind: str = "embedding") -> dict[str, Any]:
    """OpenAI's answer to an embeddings request (`kind` "pooling": vLLM's /pooling answer,
    the same vectors as `{"object": "pooling", "data": [...]}` items)."""
    subs = body.to_subrequests()
    lora = await router.resolve_model(body.model)
    if await model_labels(router) is not None:
        raise ApiError(400, "the model is a sequence classifier: use /v1/classify, /v1/score "
                       "or /v1/rerank", None, "invalid_request")  # fmt: skip
    for sub in subs:
        sub.lora_name = lora
    dims = body.dimensions
    if dims is not None:
        check_dimensions(router.broker.workers, dims)
    results = await pooled(router, subs)
    if dims is not None:
        results = [(cut(v, dims, body.normalize is not False), u) for v, u in results]
    data = [response_item(i, v, body.encoding_format, kind) for i, (v, _) in enumerate(results)]
    prompt_tokens = sum(u.prompt_tokens for _, u in results)
    return {
        "id": f"{'pool' if kind == 'pooling' else 'embd'}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": body.model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


class EncodeRequest(_Strict):
    """SGLang's `/encode` body (EmbeddingReqInput): `text` or `input_ids`, one or a batch."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None

    def to_embedding_request(self) -> EmbeddingRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ApiError(400, "give exactly one of text and input_ids", None, "invalid_value")
        given = self.text if self.text is not None else self.input_ids
        return parse_body(EmbeddingRequest, json.dumps({"model": "", "input": given}).encode())


async def encode(router: Any, body: EncodeRequest) -> Any:
    """SGLang's answer to `/encode`: `{"embedding", "meta_info"}`, a list of them for a batch."""
    single = isinstance(body.text, str) or (
        body.input_ids is not None and all(type(t) is int for t in body.input_ids)
    )  # fmt: skip
    subs = body.to_embedding_request().to_subrequests()
    outs = []
    for vector, usage in await pooled(router, subs):
        meta = {"id": uuid.uuid4().hex, "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.cached_tokens}  # fmt: skip
        outs.append({"embedding": _floats(vector), "meta_info": meta})
    return outs[0] if single else outs


def add_routes(app: Any, state: dict[str, Any]) -> None:
    """The pooling APIs: embeddings and `/encode` here, classify / score / rerank
    (services/router_scores.py)."""
    from services.router_api import unless_disconnected
    from services.router_scores import ROUTES

    def route(path: str, body_cls: type, answer: Any) -> None:
        @app.post(path)
        async def handler(request: Request) -> JSONResponse:
            router = state["router"]
            router.authorize(request)
            body = parse_body(body_cls, await request.body())
            return JSONResponse(await unless_disconnected(request, answer(router, body)))

    route("/v1/embeddings", EmbeddingRequest, embed)
    route("/pooling", EmbeddingRequest, functools.partial(embed, kind="pooling"))
    route("/encode", EncodeRequest, encode)
    for paths, body_cls, answer in ROUTES:
        for path in paths:
            route(path, body_cls, answer)
