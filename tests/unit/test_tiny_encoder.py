"""``sluice make-tiny-model --arch bert|xlm-roberta``: encoder folders that transformers loads,
whose tokenizer every loader reads the same way, with outputs a test can tell apart."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from engine.tokenizer import load_tokenizer
from services import cli
from services.tiny_corpus import synthetic_corpus
from services.tiny_encoder import ENCODER_ARCHS, make_tiny_encoder, train_encoder_tokenizer
from services.tiny_model import make_tiny_model
from tests.factories import tiny_model

# Lines the classifier was not calibrated on (it used the first 64 non-empty ones).
LINES = [line for line in synthetic_corpus() if line.strip()][300:340]
EDGE_TEXTS = [
    "  Leading  spaces,\ttabs and\nnewlines ",
    "Café CRÈME brûlée, Größe, Dvořák in Łódź",
    "你好，世界！東京は日本の首都です。안녕하세요 🇫🇷 🦀",
    "Specials in text: [CLS] [SEP] [MASK] <s> </s> <mask>",
]
ST_FILES = ("modules.json", "1_Pooling/config.json", "sentence_bert_config.json")
# special token -> id; xlm-roberta's <mask> is the last id
SPECIAL_IDS = {
    "bert": {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4},
    "xlm-roberta": {"bos": 0, "pad": 1, "eos": 2, "unk": 3},
}


def _encoded_texts() -> list[tuple[str, ...]]:
    singles = [(text,) for text in LINES[:20] + EDGE_TEXTS]
    pairs = [(LINES[i], LINES[-1 - i]) for i in range(20)] + [(EDGE_TEXTS[0], EDGE_TEXTS[2])]
    return singles + pairs


@pytest.mark.parametrize("arch", ENCODER_ARCHS)
@pytest.mark.parametrize("loader", ["AutoTokenizer", "load_tokenizer"])
def test_loaders_tokenize_exactly_as_the_trained_tokenizer(arch: str, loader: str) -> None:
    """transformers 5 rebuilds the Bert / XLM-R pipeline from its class, sluice reads
    tokenizer.json: both must give the trained tokenizer's ids (and BERT's token types)."""
    path = tiny_model(arch)
    load = AutoTokenizer.from_pretrained if loader == "AutoTokenizer" else load_tokenizer
    tokenizer = load(path)
    raw = train_encoder_tokenizer(arch)
    for texts in _encoded_texts():
        want = raw.encode(*texts)
        got = tokenizer(*texts, return_token_type_ids=True)  # (as the tokenizer service asks)
        assert got["input_ids"] == want.ids, texts
        if arch == "bert":
            assert got["token_type_ids"] == want.type_ids, texts
    config = json.loads((Path(path) / "config.json").read_text())
    assert len(tokenizer) == config["vocab_size"] == raw.get_vocab_size()
    assert tokenizer.pad_token_id == config["pad_token_id"]
    for name, token_id in SPECIAL_IDS[arch].items():
        assert getattr(tokenizer, f"{name}_token_id") == token_id
    if arch == "xlm-roberta":
        assert tokenizer.mask_token_id == len(tokenizer) - 1


def test_bert_pairs_have_token_types_and_xlmr_pairs_a_double_separator() -> None:
    a, b = "the cache", "a small model"
    bert = AutoTokenizer.from_pretrained(tiny_model("bert"))
    a_ids, b_ids = (bert(t, add_special_tokens=False)["input_ids"] for t in (a, b))
    pair = bert(a, b)
    assert pair["input_ids"] == [2, *a_ids, 3, *b_ids, 3]
    assert pair["token_type_ids"] == [0] * (len(a_ids) + 2) + [1] * (len(b_ids) + 1)
    xlmr = AutoTokenizer.from_pretrained(tiny_model("xlm-roberta"))
    a_ids, b_ids = (xlmr(t, add_special_tokens=False)["input_ids"] for t in (a, b))
    assert xlmr(a, b)["input_ids"] == [0, *a_ids, 2, 2, *b_ids, 2]
    assert xlmr.convert_ids_to_tokens(a_ids)[0].startswith("\u2581")


@pytest.mark.parametrize("arch", ENCODER_ARCHS)
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_embedding_model(arch: str, pooling: str) -> None:
    path = Path(tiny_model(arch, pooling=pooling))
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [{"bert": "BertModel"}.get(arch, "XLMRobertaModel")]
    modules = json.loads((path / "modules.json").read_text())
    assert [(m["path"], m["type"].rsplit(".", 1)[1]) for m in modules] == [
        ("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]  # fmt: skip
    pool = json.loads((path / "1_Pooling" / "config.json").read_text())
    chosen = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens"}[pooling]
    assert {k for k, v in pool.items() if k.startswith("pooling_mode") and v} == {chosen}
    assert pool["word_embedding_dimension"] == config["hidden_size"] == 64
    st_config = json.loads((path / "sentence_bert_config.json").read_text())
    assert st_config == {"max_seq_length": 512, "do_lower_case": False}

    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = tokenizer(LINES[:16], padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(path).eval()(**batch).last_hidden_state
    assert hidden.shape == (16, batch["input_ids"].shape[1], 64)
    assert torch.isfinite(hidden).all()
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = hidden[:, 0] if pooling == "cls" else (hidden * mask).sum(1) / mask.sum(1)
    pooled = torch.nn.functional.normalize(pooled, dim=-1)
    cosine = pooled @ pooled.T
    # different sentences get clearly different embeddings (default init: cosine 1.000)
    assert cosine[~torch.eye(16, dtype=torch.bool)].mean() < 0.95


@pytest.mark.parametrize("arch", ENCODER_ARCHS)
@pytest.mark.parametrize("num_labels", [1, 3])
def test_classifier(arch: str, num_labels: int) -> None:
    path = Path(tiny_model(arch, num_labels=num_labels))
    config = json.loads((path / "config.json").read_text())
    kind = {"bert": "Bert"}.get(arch, "XLMRoberta")
    assert config["architectures"] == [f"{kind}ForSequenceClassification"]
    assert not any((path / name).exists() for name in ST_FILES)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    assert model.config.num_labels == num_labels
    batch = tokenizer(LINES[:16], LINES[16:32], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (16, num_labels)
    assert torch.isfinite(logits).all()
    # spread scores: sigmoids / softmaxes neither all 0.5 nor all 0 or 1
    assert (logits.std(dim=0) > 0.5).all(), logits
    assert (logits.mean(dim=0).abs() < 3.0).all(), logits


def _digest(path: Path, name: str) -> str:
    return hashlib.sha256((path / name).read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ENCODER_ARCHS)
def test_same_seed_same_folder(tmp_path: Path, arch: str) -> None:
    """The tokenizers trainers break ties in hash order; the folder must not."""
    dirs = [Path(make_tiny_encoder(tmp_path / name, arch, seed=seed, num_labels=1))
            for name, seed in (("a", 0), ("b", 0), ("c", 1))]  # fmt: skip
    tokenizers = {_digest(d, "tokenizer.json") for d in dirs}
    weights = [_digest(d, "model.safetensors") for d in dirs]
    assert len(tokenizers) == 1
    assert weights[0] == weights[1] != weights[2]


def test_command_line(tmp_path: Path) -> None:
    out = tmp_path / "xlmr"
    argv = ["make-tiny-model", str(out), "--arch", "xlm-roberta", "--pooling", "mean"]
    assert cli.main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["max_position_embeddings"]) == ("xlm-roberta", 514)
    assert (config["pad_token_id"], config["type_vocab_size"]) == (1, 1)
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"]
    assert not (out / "generation_config.json").exists()
    # decoder-only options are refused, not ignored
    assert cli.main(["make-tiny-model", str(tmp_path / "x"), "--arch", "bert",
                     "--dtype", "bfloat16"]) == 2  # fmt: skip
    with pytest.raises(ValueError, match="float32 presets"):
        make_tiny_model(tmp_path / "y", arch="bert", num_layers=1)
