"""The tokenizer's text pairs (a cross-encoder's query and document, `/v1/score` and
`/v1/rerank`): joined as the model's tokenizer joins a pair, and with
`truncate_prompt_tokens` cut the way transformers truncates pairs (both texts keep their
start); an embedding prompt with `truncate_prompt_tokens: -1` keeps what the context takes."""

from __future__ import annotations

import pytest

from engine.tokenizer import load_tokenizer
from services.tokenize_request import RequestError, RequestTokenizer
from shared.messages import MessageError, TokenizeReqMsg
from tests.factories import tiny_model

CONTEXT = 64
QUERY = "what is the capital of france"
DOC = "paris is the capital and the largest city of france " * 8


@pytest.fixture(scope="module")
def service() -> RequestTokenizer:
    tokenizer = load_tokenizer(tiny_model("llama"))
    return RequestTokenizer(tokenizer, len(tokenizer), CONTEXT)


def pair(**sp: object) -> TokenizeReqMsg:
    return TokenizeReqMsg("r", "rt", "w", text=QUERY, text_pair=DOC, embed=True,
                          sampling_params={"max_new_tokens": 0, **sp})  # fmt: skip


def test_a_pair_is_joined_as_the_tokenizer_joins_it(service: RequestTokenizer) -> None:
    tok = service.tokenizer
    whole = tok(QUERY, text_pair=DOC[:60])["input_ids"]
    msg = TokenizeReqMsg("r", "rt", "w", text=QUERY, text_pair=DOC[:60], embed=True,
                         sampling_params={"max_new_tokens": 0})  # fmt: skip
    ids = service.to_generate(msg).input_ids
    assert ids == whole
    assert ids.count(tok.bos_token_id) == 2  # (this tokenizer's pair: <s> A <s> B)
    assert ids != tok.encode(QUERY + DOC[:60])


def test_a_long_pair_is_cut_keeping_both_starts(service: RequestTokenizer) -> None:
    with pytest.raises(RequestError, match="context length"):
        service.to_generate(pair())  # too long without truncation
    tok = service.tokenizer
    query_ids = tok.encode(QUERY)
    for keep, want_len in ((40, 40), (-1, CONTEXT - 1)):
        ids = service.to_generate(pair(truncate_prompt_tokens=keep)).input_ids
        assert len(ids) == want_len
        assert ids[: len(query_ids)] == query_ids  # the query stays whole, first
        doc_start = tok.encode(DOC, add_special_tokens=False)[:5]
        rest = ids[len(query_ids) :]
        assert rest[0] == tok.bos_token_id and rest[1:6] == doc_start


def test_a_single_embedding_prompt_with_minus_one_fits(service: RequestTokenizer) -> None:
    msg = TokenizeReqMsg("r", "rt", "w", text=DOC, embed=True,
                         sampling_params={"max_new_tokens": 0, "truncate_prompt_tokens": -1})
    ids = service.to_generate(msg).input_ids
    assert len(ids) == CONTEXT - 1  # (the context's last slot: the length check's rule)
    assert ids == service.tokenizer.encode(DOC)[-(CONTEXT - 1) :]


def test_a_pair_needs_its_first_text() -> None:
    with pytest.raises(MessageError, match="text_pair needs text"):  # (checked on decoding)
        TokenizeReqMsg("r", "rt", "w", input_ids=[1], text_pair="b").validate()
