"""Structured output pieces: the token bitmask and its application, the grammar backend on a
real tokenizer, the parameter checks, the sampler with masks, and the router's translation of
OpenAI's and vLLM's fields."""

from __future__ import annotations

import json

import pytest
import torch

from engine.sampling.grammar import GrammarBackend, apply_vocab_mask
from engine.sampling.grammar_spec import ANY_JSON
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.sampling.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from services.router_generate import GenerateRequest
from services.router_protocol import ApiError, ChatCompletionRequest, CompletionRequest
from tests.factories import tiny_model


def _allowed_ref(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bit by bit, in Python: [rows, vocab] bool."""
    words = mask.tolist()
    return torch.tensor(
        [[(w[v // 32] >> (v % 32)) & 1 == 1 for v in range(vocab)] for w in words]
    )


def test_apply_vocab_mask_matches_the_bits_and_leaves_other_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word's high bits are past the vocabulary
    logits = torch.randn(5, vocab, generator=gen)
    before = logits.clone()
    mask = torch.randint(-(2**31), 2**31, (2, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([3, 1])
    out = apply_vocab_mask(logits, rows, mask)
    assert torch.equal(logits, before), "the input logits must not change"
    allowed = _allowed_ref(mask, vocab)
    for j, row in enumerate(rows.tolist()):
        assert torch.equal(out[row][allowed[j]], before[row][allowed[j]])
        assert torch.all(out[row][~allowed[j]] == float("-inf"))
    for row in (0, 2, 4):
        assert torch.equal(out[row], before[row])


def test_sampler_never_picks_a_forbidden_token_and_logprobs_see_the_mask() -> None:
    vocab, batch = 64, 4
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0] = 0b1010  # row 0: tokens 1 and 3
    mask[1, 1] = 1 << 7  # row 2: token 39 only
    params = [SamplingParams(temperature=t) for t in (0.0, 1.0, 1.0, 0.0)]
    info = SamplingBatchInfo.from_params(params, vocab, "cpu").with_vocab_mask(
        (torch.tensor([0, 2]), mask), "cpu"
    )
    sampler = Sampler(seed=0)
    for _ in range(20):
        out = sampler(logits, info, return_logprob=True, top_logprobs_nums=[3] * batch)
        ids = out.next_token_ids.tolist()
        assert ids[0] == (1 if logits[0, 1] > logits[0, 3] else 3)
        assert ids[2] == 39 and out.logprobs[2].item() == pytest.approx(0.0, abs=1e-6)
        assert ids[3] == int(logits[3].argmax())  # unmasked rows are untouched
        top_ids, top_vals = out.top_logprobs[0]
        assert sorted(top_ids[:2]) == [1, 3] and top_vals[2] == torch.finfo(torch.float32).min


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    path = tiny_model("llama")
    tok = load_tokenizer(path)
    return GrammarBackend(tok, len(tok) + 5, [tok.eos_token_id])  # a padded model vocab


def test_a_regex_grammar_accepts_its_language_then_only_eos(backend: GrammarBackend) -> None:
    tok = load_tokenizer(tiny_model("llama"))
    grammar = backend.grammar(SamplingParams(regex="ab[0-9]"))
    vocab = tok.get_vocab()
    # one token per character: the piece itself, or its byte-fallback token
    ids = [vocab.get(ch, vocab.get(f"<0x{ord(ch):02X}>")) for ch in "ab7"]
    for t in ids:
        assert grammar.accept(t)
    rows, mask = backend.vocab_mask([None, grammar, None])
    assert rows.tolist() == [1]
    allowed = _allowed_ref(mask, backend.vocab_size)[0]
    assert allowed.nonzero().flatten().tolist() == [tok.eos_token_id]
    assert grammar.accept(tok.eos_token_id) and grammar.is_terminated()
    assert backend.vocab_mask([grammar]) is None  # a finished grammar: no row
    assert not backend.grammar(SamplingParams(regex="ab")).accept(ids[1])  # "b" first


def test_compile_errors_are_value_errors_without_the_cpp_location(
    backend: GrammarBackend,
) -> None:
    with pytest.raises(ValueError, match=r"^regex: Regex parsing error at position \d+: The par"):
        backend.grammar(SamplingParams(regex="(ab"))
    with pytest.raises(ValueError, match=r'^ebnf: EBNF parser error .*Rule "x" is not defined'):
        backend.grammar(SamplingParams(ebnf="root ::= x"))
    assert backend.grammar(SamplingParams()) is None
    assert backend.grammar(SamplingParams(json_schema=ANY_JSON)) is not None


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"regex": "a", "ebnf": "b"}, "ebnf only one of json_schema, regex, ebnf"),
        ({"structural_tag": "[]"}, "structural_tag must be a JSON object"),
        ({"regex": " "}, "regex must not be empty"),
        ({"json_schema": "{"}, "json_schema is not valid JSON"),
        ({"json_schema": "[1]"}, "json_schema must be a JSON object"),
    ],
)
def test_params_refuse_grammars_that_cannot_be_right(fields: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        SamplingParams.from_dict(fields).verify()


def test_params_take_grammars_as_strings_only() -> None:
    with pytest.raises(ValueError, match="json_schema has wrong type dict"):
        SamplingParams.from_dict({"json_schema": {"type": "object"}})
    params = SamplingParams.from_dict({"json_schema": json.dumps({"type": "object"})})
    params.verify()
    assert params.has_grammar and not SamplingParams().has_grammar


def _chat(**fields: object) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body).to_subrequests()[0].sampling_params


def _completion(**fields: object) -> dict:
    body = {"model": "m", "prompt": "hi", **fields}
    return CompletionRequest.model_validate(body).to_subrequests()[0].sampling_params


def test_router_translates_openai_sglang_and_vllm_fields() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert json.loads(_chat(response_format=fmt)["json_schema"]) == schema
    # JSON mode is a JSON object (OpenAI's, SGLang's and vLLM's: not any JSON value)
    assert _chat(response_format={"type": "json_object"})["json_schema"] == '{"type": "object"}'
    assert "json_schema" not in _chat(response_format={"type": "text"})
    assert _completion(response_format=fmt)["json_schema"] == json.dumps(schema)
    assert _completion(guided_json=schema)["json_schema"] == json.dumps(schema)
    assert _completion(guided_regex="a+")["regex"] == "a+"
    assert _completion(regex="a+")["regex"] == "a+"
    assert _completion(ebnf='root ::= "a"')["ebnf"] == 'root ::= "a"'
    assert _completion(guided_grammar='root ::= "a"')["ebnf"] == 'root ::= "a"'
    assert _completion(guided_choice=['say "hi"', "né"])["ebnf"] == (
        'root ::= "say \\"hi\\"" | "né"'
    )
    # vLLM's structured_outputs (its guided_* fields since v0.12), on both endpoints
    for make in (_chat, _completion):
        def so(**constraint: object) -> dict:
            return make(structured_outputs=constraint)  # noqa: B023

        assert so(json=schema)["json_schema"] == json.dumps(schema)
        assert so(json='{"type": "string"}')["json_schema"] == '{"type": "string"}'
        assert so(json_object=True)["json_schema"] == '{"type": "object"}'
        assert so(regex="a+")["regex"] == "a+"
        assert so(grammar='root ::= "a"')["ebnf"] == 'root ::= "a"'
        assert so(choice=["x", "y z"])["ebnf"] == 'root ::= "x" | "y z"'
        assert so(regex="a+", disable_fallback=True)["regex"] == "a+"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"regex": "a", "guided_json": {}}, "guided_json"),
        ({"response_format": {"type": "json_object"}, "ebnf": "x"}, "ebnf"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json": {}}, "regex": "a"}, "structured_outputs.json"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
         "structured_outputs.whitespace_pattern"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"structural_tag": "{"}}, "structured_outputs.structural_tag"),
        ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>"}],
                              "triggers": ["<"]}}, "response_format"),
        ({"response_format": {"type": "structural_tag", "structures": []}}, "response_format"),
    ],
)
def test_router_refuses_conflicting_or_malformed_fields(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        _completion(**fields)
    assert info.value.status == 400 and info.value.param == param


TAG_FORMAT = {"type": "tag", "begin": "<x>", "end": "</x>",
              "content": {"type": "json_schema", "json_schema": {"type": "integer"}}}  # fmt: skip


def test_router_takes_structural_tags_new_and_legacy() -> None:
    """xgrammar's structural tag (SGLang's and vLLM's response_format type "structural_tag";
    vLLM's structured_outputs.structural_tag), in its `format` form or the legacy one."""
    new = {"type": "structural_tag", "format": TAG_FORMAT}
    assert json.loads(_chat(response_format=new)["structural_tag"]) == new
    so = _completion(structured_outputs={"structural_tag": json.dumps({"format": TAG_FORMAT})})
    assert json.loads(so["structural_tag"]) == new
    legacy = {"type": "structural_tag", "triggers": ["<f="], "structures": [
        {"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"},
        {"begin": "<f=b>", "schema": '{"type": "integer"}', "end": "</f>"}]}  # fmt: skip
    fmt = json.loads(_chat(response_format=legacy)["structural_tag"])["format"]
    assert fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<f="]
    assert [(t["begin"], t["content"]["json_schema"]) for t in fmt["tags"]] == [
        ("<f=a>", {"type": "object"}), ("<f=b>", {"type": "integer"})]
    body = {"text": "hi", "sampling_params": {"structural_tag": json.dumps(legacy)}}
    (sub,) = GenerateRequest.model_validate(body).to_subrequests()  # SGLang's /generate
    assert json.loads(sub.sampling_params["structural_tag"])["format"] == fmt
    with pytest.raises(ValueError, match="must be a JSON object"):
        GenerateRequest.model_validate({"text": "hi", "sampling_params": {"structural_tag": "1"}})


def test_a_structural_tag_compiles_and_constrains(backend: GrammarBackend) -> None:
    tok = load_tokenizer(tiny_model("llama"))
    tag = json.dumps({"type": "structural_tag", "format": TAG_FORMAT})
    grammar = backend.grammar(SamplingParams(structural_tag=tag))
    assert grammar is not None
    vocab = tok.get_vocab()

    def chars(text: str) -> list[int]:  # one token per character, as in the regex test
        return [vocab.get(ch, vocab.get(f"<0x{ord(ch):02X}>")) for ch in text]

    assert all(grammar.accept(t) for t in chars("<x>42</x>"))
    assert grammar.accept(tok.eos_token_id) and grammar.is_terminated()
    refused = backend.grammar(SamplingParams(structural_tag=tag))
    assert not all(refused.accept(t) for t in chars("<x>a"))
    # the legacy form straight in the params (the offline Engine's path) compiles too
    legacy = {"structures": [{"begin": "<x>", "schema": {"type": "integer"}, "end": "</x>"}],
              "triggers": ["<x"]}  # fmt: skip
    triggered = backend.grammar(SamplingParams(structural_tag=json.dumps(legacy)))
    assert all(triggered.accept(t) for t in chars("hi <x>7</x>"))
    bad = json.dumps({"type": "structural_tag", "format": {"type": "nope"}})
    with pytest.raises(ValueError, match=r"^structural_tag: Invalid structural tag error: Fo"):
        backend.grammar(SamplingParams(structural_tag=bad))
