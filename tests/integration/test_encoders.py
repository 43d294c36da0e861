"""BERT and XLM-RoBERTa encoders (engine/models/bert.py) against transformers, in float32:
embeddings pooled as the checkpoint's sentence-transformers config says, a cross-encoder's
logits on the tokenizer's pairs (BERT's token types included), each prompt in one piece
whatever the chunk size, a prompt that fills the 512 positions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForSequenceClassification

from engine.engine import Engine
from engine.tokenizer import load_tokenizer
from tests.factories import tiny_model

ARCHS = ["bert", "xlm-roberta"]
TEXTS = [
    "the cache keeps the prefix",
    "a small model runs on the CPU, padded to the longest prompt of the batch",
    "你好 🙂",
    "x",
]
QUERY = "where does the scheduler keep the requests"
DOCS = ["the scheduler keeps a waiting queue", "paris is in france", "🙂 " * 5, TEXTS[1]]
TOL = 2e-5


def hf_batch(path: str, first: list[str], second: list[str] | None = None) -> dict:
    tok = load_tokenizer(path, padding_side="right")
    return tok(first, second, padding=True, return_tensors="pt", return_token_type_ids=True)


@torch.inference_mode()
def hf_embeddings(path: str, texts: list[str], pooling: str) -> torch.Tensor:
    batch = hf_batch(path, texts)
    hidden = AutoModel.from_pretrained(path, dtype=torch.float32)(**batch).last_hidden_state
    if pooling == "cls":
        return F.normalize(hidden[:, 0], dim=-1)
    mask = batch["attention_mask"][..., None].float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


@torch.inference_mode()
def hf_logits(path: str, first: list[str], second: list[str]) -> torch.Tensor:
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    return model(**hf_batch(path, first, second)).logits


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_embeddings_equal_sentence_transformers_pooling(arch: str, pooling: str) -> None:
    path = tiny_model(arch, pooling=pooling)
    with Engine(model_path=path, dtype="float32") as engine:  # (no is_embedding: an encoder)
        args = engine.args
        assert (args.is_embedding, args.pooling_type) == (True, pooling)  # (modules.json's)
        assert args.disable_radix_cache and args.chunked_prefill_size == -1
        got = torch.tensor([o["embedding"] for o in engine.encode(prompt=TEXTS)])
        alone = torch.tensor(engine.encode(prompt=TEXTS[1])["embedding"])
    want = hf_embeddings(path, TEXTS, pooling)
    assert (got - want).abs().max() < TOL
    assert (alone - want[1]).abs().max() < TOL  # (batched or not, the same)
    cosines = want @ want.T
    assert cosines[~torch.eye(len(TEXTS), dtype=torch.bool)].max() < 0.999  # (texts differ)


@pytest.mark.parametrize("arch", ARCHS)
def test_cross_encoder_logits_and_scores_equal_transformers(arch: str) -> None:
    path = tiny_model(arch, num_labels=1)
    want = hf_logits(path, [QUERY] * len(DOCS), DOCS)[:, 0]
    with Engine(model_path=path, dtype="float32") as engine:
        scores = torch.tensor(engine.score(QUERY, DOCS), dtype=torch.float32)
        tok = engine.tokenizer
        pairs = [tok(QUERY, d, return_token_type_ids=True) for d in DOCS]
        untyped = engine.encode(input_ids=[p["input_ids"] for p in pairs])
    assert (scores - torch.sigmoid(want)).abs().max() < TOL
    assert want.std() > 0.3  # the documents score apart
    without_types = torch.tensor([o["embedding"][0] for o in untyped])
    if arch == "bert":  # the second text's token type changes the logit: it reached the model
        assert (without_types - want).abs().min() > 1e-3
    else:  # (XLM-R has one token type)
        assert (without_types - want).abs().max() < TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_three_labels_batched(arch: str) -> None:
    path = tiny_model(arch, num_labels=3)
    tok = load_tokenizer(path)
    pairs = [tok(QUERY, d, return_token_type_ids=True) for d in DOCS]
    with Engine(model_path=path, dtype="float32") as engine:
        labels = engine.scheduler.model_runner.model_config.labels
        assert engine.args.pooling_type == "cls" and len(labels) == 3
        outs = engine.encode(input_ids=[p["input_ids"] for p in pairs],
                             token_type_ids=[p["token_type_ids"] for p in pairs])  # fmt: skip
    got = torch.tensor([o["embedding"] for o in outs])
    assert got.shape == (len(DOCS), 3)
    assert (got - hf_logits(path, [QUERY] * len(DOCS), DOCS)).abs().max() < TOL
    with pytest.raises(ValueError, match="reads the first token"):
        Engine(model_path=path, pooling_type="mean")


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prompt_runs_in_one_piece_and_may_fill_the_context(arch: str) -> None:
    """A chunk size below the prompt is overridden (a chunk would not see the tokens after
    it); a pooled prompt may take all 512 positions (a generated one leaves a token)."""
    path = tiny_model(arch)
    tok = load_tokenizer(path)
    words = " ".join(TEXTS * 200)
    full = tok(words, truncation=True, max_length=512)["input_ids"]
    assert len(full) == 512
    with Engine(model_path=path, dtype="float32", chunked_prefill_size=16) as engine:
        assert engine.args.chunked_prefill_size == -1
        assert engine.scheduler.context_len == 512  # (XLM-R: 514 positions from pad id + 1)
        got = torch.tensor([o["embedding"] for o in engine.encode(input_ids=[full, full[:40]])])
        with pytest.raises(ValueError, match="513 tokens"):
            engine.encode(input_ids=full + full[-1:])
    model = AutoModel.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        for row, ids in zip(got, (full, full[:40])):
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0, 0]
            assert (row - F.normalize(hidden, dim=-1)).abs().max() < TOL
