"""A causal LM served as a reranker through its language-model head (`hf_overrides` with
`classifier_from_token`, engine/hf_overrides.py; the original Qwen3-Reranker's way): the
score head is the lm_head rows of the tokens (two-way: true minus false), so the logits
equal transformers' causal LM's at the prompt's last token, in float32."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineArgs
from engine.engine import Engine
from engine.tokenizer import load_tokenizer
from tests.factories import tiny_model

PROMPTS = ["the cache keeps the prefix", "a small model runs on the CPU", "你好 🙂"]
TOL = 1e-4  # (logits of std 8)


@torch.inference_mode()
def last_logits(path: str, prompts: list[list[int]]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return torch.stack([model(input_ids=torch.tensor([ids])).logits[0, -1] for ids in prompts])


def head(path: str, ids: list[int], **extra: object) -> dict:
    tokens = load_tokenizer(path).convert_ids_to_tokens(ids)
    return {"architectures": [_classifier(path)], "classifier_from_token": tokens, **extra}


def _classifier(path: str) -> str:
    with open(f"{path}/config.json") as f:
        arch = json.load(f)["architectures"][0]
    return arch.replace("ForCausalLM", "ForSequenceClassification")


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # (tied and untied embeddings)
def test_two_way_head_is_true_minus_false(arch: str) -> None:
    path = tiny_model(arch)
    false_id, true_id = 300, 411
    overrides = head(path, [false_id, true_id], is_original_qwen3_reranker=True)
    tok = load_tokenizer(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    want = last_logits(path, prompts)
    with Engine(model_path=path, hf_overrides=overrides, dtype="float32") as engine:
        config = engine.scheduler.model_runner.model_config
        true_token = overrides["classifier_from_token"][1]
        assert engine.args.is_embedding and config.labels == (true_token,)
        got = torch.tensor([o["embedding"] for o in engine.encode(input_ids=prompts)])
        scores = engine.score(PROMPTS[0], PROMPTS[1:])
    assert got.shape == (len(PROMPTS), 1)
    assert (got[:, 0] - (want[:, true_id] - want[:, false_id])).abs().max() < TOL
    assert got.std() > 0.1
    pairs = [tok(PROMPTS[0], text_pair=d)["input_ids"] for d in PROMPTS[1:]]
    pair_logits = last_logits(path, pairs)
    two_way = pair_logits[:, [false_id, true_id]].softmax(-1)[:, 1]  # the card's score
    assert torch.tensor(scores) == pytest.approx(two_way.tolist(), abs=1e-5)


def test_one_label_per_token_without_post_processing() -> None:
    path = tiny_model("qwen3")
    ids = [17, 300, 411]
    tok = load_tokenizer(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    with Engine(model_path=path, hf_overrides=json.dumps(head(path, ids))) as engine:
        config = engine.scheduler.model_runner.model_config
        assert config.labels == tuple(tok.convert_ids_to_tokens(ids))
        got = torch.tensor([o["embedding"] for o in engine.encode(input_ids=prompts)])
    assert (got - last_logits(path, prompts)[:, ids]).abs().max() < TOL


def test_bad_overrides_are_refused() -> None:
    path = tiny_model("qwen3")
    with pytest.raises(ValueError, match="not JSON"):
        EngineArgs(model_path=path, hf_overrides="{no")
    with pytest.raises(ValueError, match="architectures must be a list"):
        EngineArgs(model_path=path, hf_overrides={"architectures": "Qwen3ForCausalLM"})
    bad = {"architectures": ["Qwen3ForSequenceClassification"],
           "classifier_from_token": ["no-such-token-here"]}  # fmt: skip
    with pytest.raises(ValueError, match="not a token of the vocabulary"):
        Engine(model_path=path, hf_overrides=bad)
    with pytest.raises(ValueError, match="two tokens"):
        Engine(model_path=path, hf_overrides={**bad, "method": "from_2_way_softmax"})
