"""Structured outputs (json_schema, regex, ebnf) on the engine (CPU, float32).

Greedy: each constrained request equals transformers' greedy decoding with the same grammar
applied by hand (a fresh xgrammar matcher per request, the logits of disallowed tokens at
-inf), under every loop and scheduler path that changes when the masks are built: the plain
loop, the overlap loop (deferred sampling) with both CPU executors, chunked prefill with mixed
chunk, and retraction. Unconstrained requests in the same batches still equal plain greedy
(the masks touch their own rows only). Seeded sampling: the overlap loop equals the plain one
token for token, and every output is in the grammar's language.
"""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest
import torch

from engine.engine import Engine
from engine.sampling.grammar_spec import JSON_OBJECT
from engine.tokenizer import load_tokenizer
from tests.factories import (
    TIE_EPS,
    _hf_model,
    assert_engine_clean,
    hf_greedy,
    mixed_prompts,
    tiny_model,
)

MAX_NEW = 48
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ("sunny", "rainy", "snow")
EBNF = "root ::= " + " | ".join(json.dumps(c) for c in CHOICES)
GRAMMARS = [
    {"json_schema": json.dumps(SCHEMA)},
    {"regex": REGEX},
    {"ebnf": EBNF},
    {},  # unconstrained, in the same batch
]

CONFIGS = {
    "plain": {"disable_overlap_schedule": True},
    "overlap_process": {},
    "overlap_thread": {"cpu_overlap_executor": "thread"},
    "mixed_chunk": {"chunked_prefill_size": 48, "enable_mixed_chunk": True, "page_size": 4},
    # grammars compiled inline: every request is waiting from the start, as the tight pool
    # needs to force a retraction (the other configs compile them in the background); a low
    # reservation for the running requests' output admits more than their decode can hold
    "retract": {"max_total_tokens": 320, "chunked_prefill_size": 128, "max_prefill_tokens": 256,
                "grammar_compile_threads": 0, "init_new_token_ratio": 0.05},
}


def in_language(grammar: dict, text: str) -> bool:
    if "json_schema" in grammar:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if "regex" in grammar:
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


@functools.cache
def _case(arch: str) -> tuple[str, list[list[int]]]:
    path = tiny_model(arch)
    from transformers import AutoConfig

    prompts = mixed_prompts(AutoConfig.from_pretrained(path).vocab_size, n=12, max_len=160)
    return path, prompts


@torch.inference_mode()
def _hf_constrained(path: str, prompt: list[int], grammar: dict) -> list[int]:
    """Greedy transformers decoding under `grammar`, with its own xgrammar matcher; ties
    under the mask (top-2 gap < TIE_EPS) are reported as None after the tied position."""
    import xgrammar as xgr

    if not grammar:
        return hf_greedy(path, prompt, MAX_NEW)
    model = _hf_model(path)
    tok = load_tokenizer(path)
    vocab = model.config.vocab_size
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info)
    ((kind, text),) = grammar.items()
    compiled = {
        "json_schema": compiler.compile_json_schema,
        "regex": compiler.compile_regex,
        "ebnf": compiler.compile_grammar,
    }[kind](text)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    out: list[int] = []
    while len(out) < MAX_NEW and not matcher.is_terminated():
        logits = model(torch.tensor([prompt + out])).logits[:, -1].double()
        matcher.fill_next_token_bitmask(bitmask)
        allowed = torch.zeros(1, vocab)  # xgrammar's own kernel (float32) says which
        xgr.apply_token_bitmask_inplace(allowed, bitmask)
        logits[allowed.isinf()] = float("-inf")
        top = logits[0].topk(2).values
        token = int(logits[0].argmax())
        if float(top[0] - top[1]) < TIE_EPS:
            return out + [token, None]  # type: ignore[list-item]
        assert matcher.accept_token(token)
        out.append(token)
    return out


@functools.cache
def _reference(arch: str) -> list[list[int]]:
    path, prompts = _case(arch)
    return [_hf_constrained(path, p, GRAMMARS[i % 4]) for i, p in enumerate(prompts)]


def _generate(path: str, prompts: list[list[int]], params: list[dict], **kwargs) -> list[dict]:
    with Engine(model_path=path, random_seed=0, **kwargs) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        stats = engine.get_stats()
        assert_engine_clean(engine)
    if "max_total_tokens" in kwargs:
        assert stats["num_retractions"] > 0, "the tiny KV pool should force retraction"
    return outs


def _greedy_params(i: int) -> dict:
    grammar = GRAMMARS[i % 4]
    # ignore_eos: an unconstrained request runs to MAX_NEW; a grammar still ends at its EOS
    return {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True, **grammar}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # byte-fallback and byte-level vocabs
def test_greedy_grammar_matches_transformers(arch: str, config: str) -> None:
    path, prompts = _case(arch)
    want = _reference(arch)
    outs = _generate(path, prompts, [_greedy_params(i) for i in range(len(prompts))],
                     **CONFIGS[config])  # fmt: skip
    tok = load_tokenizer(path)
    for i, (out, ref) in enumerate(zip(outs, want, strict=True)):
        got = out["output_ids"]
        grammar = GRAMMARS[i % 4]
        if None in ref:  # a tie under the mask: equal up to it
            cut = ref.index(None) - 1
            assert got[:cut] == ref[:cut], (i, got, ref)
            continue
        assert got == ref, (i, grammar, got, ref)
        reason = out["meta_info"]["finish_reason"]
        if grammar and len(got) < MAX_NEW:
            assert reason["type"] == "stop", reason
            text = tok.decode(got[:-1])  # without its EOS
            assert in_language(grammar, text), (grammar, text)


@pytest.mark.parametrize("loop", ["overlap_process", "overlap_thread"])
def test_seeded_grammar_overlap_equals_plain_and_stays_in_language(loop: str) -> None:
    path, prompts = _case("llama")
    params = [
        {"max_new_tokens": MAX_NEW, "temperature": 1.0, "top_p": 0.95, "sampling_seed": i,
         "repetition_penalty": 1.1 if i % 3 == 0 else 1.0, **GRAMMARS[i % 4]}
        for i in range(len(prompts))
    ]  # fmt: skip
    plain = _generate(path, prompts, params, **CONFIGS["plain"])
    overlap = _generate(path, prompts, params, **CONFIGS[loop])
    assert [o["output_ids"] for o in overlap] == [o["output_ids"] for o in plain]
    finished = 0
    for i, out in enumerate(plain):
        grammar = GRAMMARS[i % 4]
        if grammar and out["meta_info"]["finish_reason"]["type"] == "stop":
            finished += 1
            assert in_language(grammar, out["text"]), (grammar, out["text"])
    assert finished >= 6, "most constrained requests should complete their grammar"


def test_grammar_errors_and_edges() -> None:
    path, prompts = _case("llama")
    with Engine(model_path=path, disable_overlap_schedule=True) as engine:
        for bad, why in [
            ({"regex": "(ab"}, "regex: Regex parsing error"),
            ({"ebnf": "root ::= missing"}, "ebnf: EBNF parser error"),
            ({"json_schema": '{"type": "nonsense"}'}, "json_schema: Unsupported type"),
            ({"json_schema": "{bad"}, "json_schema is not valid JSON"),
            ({"regex": "a", "ebnf": 'root ::= "a"'},
             "only one of json_schema, regex, ebnf, structural_tag"),
        ]:
            with pytest.raises(ValueError, match=re.escape(why)):
                engine.generate(input_ids=prompts[0], sampling_params=bad)
        # a failing grammar in a batch fails the call; its other requests are aborted, not left
        with pytest.raises(ValueError, match=re.escape("regex: Regex parsing error")):
            engine.generate(input_ids=prompts[:2], sampling_params=[
                {"max_new_tokens": 64, "ignore_eos": True}, {"regex": "(cd"}])  # fmt: skip
        assert not engine.scheduler.has_work()
        # the engine goes on serving after refusing them
        out = engine.generate(input_ids=prompts[0], sampling_params={"regex": "[0-9]{4}"})
        assert re.fullmatch("[0-9]{4}", out["text"]) and out["meta_info"]["finish_reason"][
            "type"] == "stop"  # fmt: skip
        # the length limit before the grammar is complete: cut, as in SGLang and vLLM
        out = engine.generate(input_ids=prompts[0],
                              sampling_params={"regex": "[0-9]{40}", "max_new_tokens": 3})
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        assert out["text"].isdigit()
        # any JSON (OpenAI's json_object)
        out = engine.generate(input_ids=prompts[1], sampling_params={
            "json_schema": "$$ANY$$", "max_new_tokens": MAX_NEW, "temperature": 0.0})
        text = out["text"]
        assert text.lstrip()[:1] in "{[", text
        # a JSON object (OpenAI's json_object, as SGLang and vLLM decode it)
        out = engine.generate(input_ids=prompts[1], sampling_params={
            "json_schema": JSON_OBJECT, "max_new_tokens": MAX_NEW, "temperature": 0.0})
        assert out["text"].lstrip()[:1] == "{", out["text"]
