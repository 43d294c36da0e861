"""The embeddings API's router side without a stack: the inputs it takes, matryoshka
`dimensions` (which workers allow it, the cut and its normalisation), the two encodings."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest

from engine.pooling import matryoshka_dimensions
from services.router_embeddings import (
    EmbeddingRequest,
    EncodeRequest,
    check_dimensions,
    cut,
    response_item,
)
from services.router_protocol import ApiError, parse_body


def body(**kw) -> EmbeddingRequest:
    import json

    return parse_body(EmbeddingRequest, json.dumps({"model": "m", **kw}).encode())


def test_inputs_become_one_embedding_request_each() -> None:
    subs = body(input=["a", "b"], truncate_prompt_tokens=4).to_subrequests()
    assert [(s.text, s.embed, s.sampling_params) for s in subs] == [
        ("a", True, {"max_new_tokens": 0, "truncate_prompt_tokens": 4}),
        ("b", True, {"max_new_tokens": 0, "truncate_prompt_tokens": 4}),
    ]
    assert [s.input_ids for s in body(input=[1, 2]).to_subrequests()] == [[1, 2]]
    assert [s.input_ids for s in body(input=[[1], [2, 3]]).to_subrequests()] == [[1], [2, 3]]
    for bad in ("", [], ["a", [1]], [[1], []], [-1], {"a": 1}, ["x"] * 2049):
        with pytest.raises(ApiError) as err:
            body(input=bad)
        assert err.value.status == 400 and err.value.param == "input"
    with pytest.raises(ApiError, match="truncate_prompt_tokens"):
        body(input="a", truncate_prompt_tokens=0).to_subrequests()
    with pytest.raises(ApiError, match="exactly one"):
        EncodeRequest(text="a", input_ids=[1]).to_embedding_request()
    assert EncodeRequest(input_ids=[[4, 5]]).to_embedding_request().input == [[4, 5]]


def test_matryoshka_sizes_come_from_the_config() -> None:
    assert matryoshka_dimensions(SimpleNamespace()) is None
    assert matryoshka_dimensions(SimpleNamespace(is_matryoshka=True)) == []
    assert matryoshka_dimensions(SimpleNamespace(matryoshka_dimensions=[64, 32])) == [32, 64]


def _workers(*allowed) -> SimpleNamespace:
    live = {f"w{i}": SimpleNamespace(is_embedding=True, matryoshka_dimensions=a)
            for i, a in enumerate(allowed)}  # fmt: skip
    live["gen"] = SimpleNamespace(is_embedding=False, matryoshka_dimensions=None)
    return SimpleNamespace(live=live)


def test_dimensions_need_every_embedding_worker_to_allow_them() -> None:
    check_dimensions(_workers([], [16, 32]), 16)  # (the generative worker is not asked)
    with pytest.raises(ApiError, match="not one of the model's matryoshka sizes"):
        check_dimensions(_workers([], [16, 32]), 8)
    with pytest.raises(ApiError, match="no matryoshka representation"):
        check_dimensions(_workers([], None), 16)


def test_a_cut_embedding_is_normalised_again_and_encoded_both_ways() -> None:
    full = np.array([0.6, 0.0, 0.8, 0.0], dtype="<f4").tobytes()
    part = cut(np.array([3.0, 4.0, 12.0], dtype="<f4").tobytes(), 2)
    assert np.frombuffer(part, dtype="<f4").tolist() == pytest.approx([0.6, 0.8])
    with pytest.raises(ApiError, match="more than the model's 4"):
        cut(full, 5)
    floats = response_item(3, full, "float")
    assert floats == {"object": "embedding", "index": 3,
                      "embedding": pytest.approx([0.6, 0.0, 0.8, 0.0])}  # fmt: skip
    b64 = response_item(0, full, "base64")["embedding"]
    assert base64.b64decode(b64) == full


def test_chat_messages_become_one_prompt_without_a_generation_prompt() -> None:
    chat = [{"role": "system", "content": "Represent it"}, {"role": "user", "content": "hi"}]
    (sub,) = body(messages=chat).to_subrequests()
    assert sub.embed and sub.text is None and sub.input_ids is None
    assert [m.role for m in sub.messages] == ["system", "user"]
    assert sub.add_generation_prompt is False and sub.sampling_params == {"max_new_tokens": 0}
    (opened,) = body(messages=chat, add_generation_prompt=True).to_subrequests()
    assert opened.add_generation_prompt is True
    for bad, needle in (({"messages": chat, "input": "x"}, "exactly one"), ({}, "exactly one"),
                        ({"messages": chat, "add_generation_prompt": True,
                          "continue_final_message": True}, "continue_final_message")):  # fmt: skip
        with pytest.raises(ApiError, match=needle):
            body(**bad).to_subrequests()
    with pytest.raises(ApiError):
        body(messages=[])
