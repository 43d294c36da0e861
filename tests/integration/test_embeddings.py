"""Embedding models (`is_embedding`): each prompt's pooled final hidden states equal those of
transformers' base model on the same weights (last, mean, cls pooling), whether the prompt
runs whole, in chunks, in a batch of others or on a cached prefix; the KV comes back."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from engine.engine import Engine
from engine.sampling.sampling_params import SamplingParams
from tests.factories import assert_engine_clean, mixed_prompts, tiny_model


@functools.cache
def _hf_base(path: str):
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_embedding(path: str, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' reference: the base model's last hidden states (after its final norm),
    pooled and L2-normalised."""
    hidden = _hf_base(path)(torch.tensor([ids])).last_hidden_state[0]
    pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    return F.normalize(pooled, dim=-1)


def _prompts(path: str, n: int = 8, seed: int = 0) -> list[list[int]]:
    from engine.config import ModelConfig

    return mixed_prompts(ModelConfig.from_pretrained(path).vocab_size, n=n, seed=seed, max_len=90)


def _encode(path: str, prompts: list[list[int]], **kw) -> tuple[torch.Tensor, list[dict]]:
    with Engine(model_path=path, is_embedding=True, **kw) as engine:
        outs = engine.encode(input_ids=prompts)
        assert_engine_clean(engine)
    return torch.tensor([o["embedding"] for o in outs]), outs


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(got)), atol=1e-5)  # normalised
    assert (got - want).abs().max() < 2e-5, (got - want).abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gpt2"])
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_equal_transformers(arch: str, pooling: str) -> None:
    path = tiny_model(arch)
    prompts = _prompts(path)
    got, outs = _encode(path, prompts, pooling_type=pooling)
    want = torch.stack([hf_embedding(path, p, pooling) for p in prompts])
    _assert_close(got, want)
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(p) for p in prompts]
    # the same prompts in chunks of 16 tokens, on pages of 4
    chunked, _ = _encode(path, prompts, pooling_type=pooling, chunked_prefill_size=16,
                         page_size=4)  # fmt: skip
    _assert_close(chunked, want)


def test_last_pooling_keeps_the_prefix_cache() -> None:
    """A prompt whose prefix is cached computes only its tail, and its embedding is the same;
    mean pooling turns the cache off (a cached prefix has no hidden states)."""
    path = tiny_model("llama")
    prompts = _prompts(path, seed=3)
    with Engine(model_path=path, is_embedding=True) as engine:
        first = engine.encode(input_ids=prompts)
        again = engine.encode(input_ids=prompts)
        assert_engine_clean(engine)
    assert sum(o["meta_info"]["cached_tokens"] for o in again) > sum(len(p) for p in prompts) // 2
    got = torch.tensor([o["embedding"] for o in again])
    _assert_close(got, torch.tensor([o["embedding"] for o in first]))
    with Engine(model_path=path, is_embedding=True, pooling_type="mean") as engine:
        assert engine.args.disable_radix_cache
        engine.encode(input_ids=prompts)
        outs = engine.encode(input_ids=prompts)
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)


def test_encode_one_text_prompt() -> None:
    path = tiny_model("qwen3")
    with Engine(model_path=path, is_embedding=True) as engine:
        out = engine.encode(prompt="Hello embeddings")
        ids = engine.tokenizer.encode("Hello embeddings")
    _assert_close(torch.tensor([out["embedding"]]), hf_embedding(path, ids, "last")[None])


def test_refusals() -> None:
    path = tiny_model("llama")
    with Engine(model_path=path, is_embedding=True) as engine:
        with pytest.raises(ValueError, match="use encode"):
            engine.generate(input_ids=[5, 6, 7])
        with pytest.raises(ValueError, match="max_new_tokens must be 0"):
            engine.scheduler.add_request("r", [5, 6], SamplingParams(max_new_tokens=3))
    with Engine(model_path=path) as engine, pytest.raises(ValueError, match="generative"):
        engine.encode(input_ids=[5, 6, 7])
    with pytest.raises(ValueError, match="pooling_type"):
        Engine(model_path=path, is_embedding=True, pooling_type="max")
    with pytest.raises(ValueError, match="speculative"):
        Engine(model_path=path, is_embedding=True, speculative_algorithm="ngram")
