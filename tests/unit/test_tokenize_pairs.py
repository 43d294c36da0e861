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
    for keep, want_len in ((40, 40), (-1, CONTEXT)):  # (a pooled prompt may fill the context)
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
    assert len(ids) == CONTEXT  # (pooled, not generated from: the whole context is its own)
    assert ids == service.tokenizer.encode(DOC)[-CONTEXT:]
    generate = TokenizeReqMsg("r", "rt", "w", text=DOC, sampling_params={
        "max_new_tokens": 0, "truncate_prompt_tokens": -1})  # fmt: skip
    assert len(service.to_generate(generate).input_ids) == CONTEXT - 1  # (room for a token)


def test_a_pair_needs_its_first_text() -> None:
    with pytest.raises(MessageError, match="text_pair needs text"):  # (checked on decoding)
        TokenizeReqMsg("r", "rt", "w", input_ids=[1], text_pair="b").validate()


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta", "llama"])
def test_a_pairs_token_types_go_to_the_worker(arch: str) -> None:
    """BERT's second text has token type 1: the types travel with the ids (also when cut;
    the worker gives them to an encoder only); tokenizers whose pairs are all type 0, XLM-R's,
    send none."""
    path = tiny_model(arch)
    tokenizer = load_tokenizer(path)
    service = RequestTokenizer(tokenizer, len(tokenizer), 512)
    whole = tokenizer(QUERY, text_pair=DOC, return_token_type_ids=True)
    for keep, want in ((None, whole), (30, tokenizer(QUERY, text_pair=DOC, truncation=True,
                                                     max_length=30, return_token_type_ids=True))):
        cut = {} if keep is None else {"truncate_prompt_tokens": keep}
        msg = service.to_generate(pair(**cut))
        assert msg.input_ids == want["input_ids"]
        types = want["token_type_ids"]
        assert msg.token_type_ids == (types if any(types) else None)
        assert (arch == "bert") <= (0 < sum(types) < len(types))  # (a decoder ignores them)
        assert (arch == "xlm-roberta") <= (msg.token_type_ids is None)
    decoded = type(msg).from_msg(msg.to_msg())  # (the message carries them)
    assert decoded.token_type_ids == msg.token_type_ids
    single = TokenizeReqMsg("r", "rt", "w", text=QUERY, embed=True,
                            sampling_params={"max_new_tokens": 0})  # fmt: skip
    assert service.to_generate(single).token_type_ids is None
