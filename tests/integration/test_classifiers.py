"""Sequence classifiers (`*ForSequenceClassification`: cross-encoders, rerankers): each
prompt's logits equal those of transformers' classifier on the same weights, whether the
prompt runs whole, in chunks or in a batch of others; the model is served as a pooling
model without being told (SGLang and vLLM decide by architecture) and its logits come back
raw."""

from __future__ import annotations

import functools

import pytest
import torch

from engine.engine import Engine
from engine.tokenizer import load_tokenizer
from tests.factories import assert_engine_clean, mixed_prompts, tiny_model

PAIRS = [
    ("what is the sky", "the sky is blue"),
    ("hello there", "a general greeting with many words in it, long enough for chunks"),
    ("def fibonacci(n):", "return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"),
]


@functools.cache
def _hf(path: str):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    return _hf(path)(torch.tensor([ids])).logits[0]


def pair_ids(path: str) -> list[list[int]]:
    tok = load_tokenizer(path)
    return [tok(a, text_pair=b)["input_ids"] for a, b in PAIRS]


def _logits(path: str, prompts: list[list[int]], **kw) -> torch.Tensor:
    with Engine(model_path=path, **kw) as engine:
        assert engine.args.is_embedding  # (not asked for: the architecture says it)
        with pytest.raises(ValueError, match="embedding model"):
            engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 1})
        outs = engine.encode(input_ids=prompts)
        assert_engine_clean(engine)
    return torch.tensor([o["embedding"] for o in outs])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gpt2", "qwen3_moe"])
def test_cross_encoder_logits_equal_transformers(arch: str) -> None:
    path = tiny_model(arch, num_labels=1)
    prompts = pair_ids(path)
    got = _logits(path, prompts)
    want = torch.stack([hf_logits(path, p) for p in prompts])
    assert got.shape == (len(PAIRS), 1)
    assert (got - want).abs().max() < 2e-5, (got, want)
    assert want.std() > 0.1  # the pairs score apart (a head of zeros would pass otherwise)


def test_many_labels_in_chunks_and_batches() -> None:
    path = tiny_model("llama", num_labels=3)
    vocab = load_tokenizer(path).vocab_size
    prompts = mixed_prompts(vocab, n=8, seed=3, max_len=90)
    want = torch.stack([hf_logits(path, p) for p in prompts])
    for kw in ({}, {"chunked_prefill_size": 16, "page_size": 4}, {"max_running_requests": 2}):
        got = _logits(path, prompts, **kw)
        assert got.shape == (8, 3)
        assert (got - want).abs().max() < 2e-5, kw
    assert not torch.allclose(got.norm(dim=-1), torch.ones(8))  # raw logits, not normalised


def test_the_label_names_come_from_the_config() -> None:
    from engine.config import ModelConfig

    assert ModelConfig.from_pretrained(tiny_model("llama", num_labels=3)).labels == (
        "LABEL_0", "LABEL_1", "LABEL_2")  # fmt: skip
    assert ModelConfig.from_pretrained(tiny_model("llama")).labels == ()


def test_offline_score_of_a_cross_encoder_and_of_an_embedding_model() -> None:
    path = tiny_model("qwen3", num_labels=1)
    queries, docs = [a for a, _ in PAIRS], [b for _, b in PAIRS]
    want = [torch.sigmoid(hf_logits(path, ids)).item() for ids in pair_ids(path)]
    with Engine(model_path=path) as engine:
        assert engine.score(queries, docs) == pytest.approx(want, abs=1e-6)
        one = engine.score(queries[0], docs)  # one query for every document
        assert one[0] == pytest.approx(want[0], abs=1e-6) and len(one) == 3
        with pytest.raises(ValueError, match="2 text_1 for 3 text_2"):
            engine.score(queries[:2], docs)
    with Engine(model_path=tiny_model("qwen3"), is_embedding=True) as engine:
        e = torch.tensor([o["embedding"] for o in engine.encode(prompt=[queries[0], *docs])])
        got = engine.score(queries[0], docs)
        assert got == pytest.approx((e[1:] @ e[0]).tolist(), abs=1e-5)
        assert engine.score(docs[0], docs[0]) == pytest.approx([1.0], abs=1e-6)
