"""`sluice make-tiny-model DIR --draft-of MODEL` (services/tiny_draft.py): a draft model
derived from a model folder, its first layers and/or its weights plus relative noise, with
the model's tokenizer; what the draft-model tests and benchmark build their pairs from."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from services import cli
from services.tiny_draft import make_draft_model
from tests.factories import tiny_model


def test_first_layers_exactly_and_the_same_tokenizer(tmp_path: Path) -> None:
    src = Path(tiny_model("llama"))
    out = tmp_path / "draft"
    assert cli.main(["make-tiny-model", str(out), "--draft-of", str(src), "--num-layers", "1"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert json.loads((src / "config.json").read_text())["num_hidden_layers"] == 2
    assert filecmp.cmp(src / "tokenizer.json", out / "tokenizer.json", shallow=False)
    want, got = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(got) == {k for k in want if not k.startswith("model.layers.1.")}
    for key, value in got.items():
        assert value.dtype == want[key].dtype and value.equal(want[key]), key


def test_noise_is_relative_to_each_weight(tmp_path: Path) -> None:
    src = tiny_model("llama")
    want = load_file(Path(src) / "model.safetensors")
    out = make_draft_model(src, str(tmp_path / "n"), noise=0.1)
    got = load_file(Path(out) / "model.safetensors")
    assert set(got) == set(want)
    for key, w in want.items():
        if w.numel() > 1:
            ratio = float((got[key] - w).std() / w.std())
            assert 0.07 < ratio < 0.13, (key, ratio)  # 0.1 of the weight's std


def test_bad_arguments() -> None:
    src = tiny_model("llama")
    with pytest.raises(ValueError, match="num_layers 3 not in 1..2"):
        make_draft_model(src, "/nonexistent", num_layers=3)
    with pytest.raises(ValueError, match="noise"):
        make_draft_model(src, "/nonexistent", noise=-1.0)
