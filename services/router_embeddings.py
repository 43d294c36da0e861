"""OpenAI's embeddings API, `POST /v1/embeddings`, as vLLM and SGLang serve it, for workers
started with `--is-embedding` (engine/pooling.py).

`input` is a string, a list of strings, a list of token ids or a list of such lists (at most
`MAX_INPUTS`); each becomes one sub-request through a tokenizer to an embedding worker, which
pools the prompt's final hidden states into one normalised float32 vector. It comes back in
the request's final step row (float32 bytes, little-endian) and is answered as a list of
floats or, with `encoding_format` "base64" (what OpenAI's Python client asks for), as those
bytes in base64. vLLM's `truncate_prompt_tokens` keeps a prompt's last k tokens. `dimensions`
(matryoshka truncation) is refused: no served model declares matryoshka representations.
Without an embedding worker the request is a 400, as is a generation request to
a deployment that has only embedding workers (services/router_requests.py).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from services.router_fields import _Strict
from services.router_handle import merged
from services.router_models import check_adapters
from services.router_protocol import ApiError, SubRequest, parse_body

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(type(t) is int and t >= 0 for t in v)


class EmbeddingRequest(_Strict):
    model: str
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)

    @field_validator("input")
    @classmethod
    def _check_input(cls, v: Any) -> list[str] | list[list[int]]:
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

    def to_subrequests(self) -> list[SubRequest]:
        if self.dimensions is not None:
            raise ApiError(400, "dimensions: the model has no matryoshka representation; "
                           "its embeddings have one size", "dimensions", "unsupported")  # fmt: skip
        if self.truncate_prompt_tokens == 0:
            raise ApiError(400, "truncate_prompt_tokens must be -1 or >= 1",
                           "truncate_prompt_tokens", "invalid_value")  # fmt: skip
        params: dict[str, Any] = {"max_new_tokens": 0}
        if self.truncate_prompt_tokens is not None:
            params["truncate_prompt_tokens"] = self.truncate_prompt_tokens
        subs = []
        for i, prompt in enumerate(self.input):
            kind = "text" if isinstance(prompt, str) else "input_ids"
            subs.append(SubRequest(i, i, dict(params), embed=True, **{kind: prompt}))
        return subs


def response_item(index: int, data: bytes, encoding: str) -> dict[str, Any]:
    """One input's entry of the answer's `data`: its float32 bytes as floats or base64."""
    if encoding == "base64":
        embedding: Any = base64.b64encode(data).decode("ascii")
    else:
        embedding = np.frombuffer(data, dtype="<f4").tolist()
    return {"object": "embedding", "index": index, "embedding": embedding}


async def embed(router: Any, body: EmbeddingRequest) -> dict[str, Any]:
    """Send the request's inputs to the embedding workers; the answer once all are pooled."""
    subs = body.to_subrequests()
    lora = await router.resolve_model(body.model)
    for sub in subs:
        sub.lora_name = lora
    await check_adapters(router.broker, subs)
    handles = await router.broker.open(subs)
    try:
        await router.broker.submit(handles)
    except BaseException:
        for h in handles:
            h.close()
        raise
    router.num_handled += 1
    vectors: dict[int, bytes] = {}
    prompt_tokens = 0
    async for index, delta in merged(handles):
        if delta.embedding is not None:
            vectors[index] = delta.embedding
        if delta.usage is not None:
            prompt_tokens += delta.usage.prompt_tokens
        reason = delta.finish_reason
        if reason is not None and index not in vectors:  # (an abort: /abort_request)
            why = reason.message or reason.type
            raise ApiError(503, f"input {index} was not embedded: {why}", None, "aborted")
    data = [response_item(i, vectors[i], body.encoding_format) for i in range(len(subs))]
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": body.model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def add_routes(app: Any, state: dict[str, Any]) -> None:
    from services.router_api import unless_disconnected

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        router = state["router"]
        router.authorize(request)
        body = parse_body(EmbeddingRequest, await request.body())
        return JSONResponse(await unless_disconnected(request, embed(router, body)))
