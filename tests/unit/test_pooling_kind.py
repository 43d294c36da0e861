"""How a model is served (engine/pooling.py `resolve_model_kind`): which models pool, with
which pooling (the flag, the checkpoint's sentence-transformers config, the architecture's
default), and what an encoder turns off."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.config import EngineArgs
from engine.pooling import resolve_model_kind, sentence_pooling


def model_config(path: Path, encoder: bool = False, labels: tuple[str, ...] = ()) -> object:
    return SimpleNamespace(path=str(path), is_encoder=encoder, labels=labels)


def sentence_folder(path: Path, **modes: bool) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    (path / "1_Pooling").mkdir(parents=True)
    (path / "modules.json").write_text(json.dumps(modules))
    config = {"word_embedding_dimension": 8, **{f"pooling_mode_{m}": on for m, on in modes.items()}}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("modes", "want"),
    [({"cls_token": True, "mean_tokens": False}, "cls"), ({"mean_tokens": True}, "mean"),
     ({"lasttoken": True, "cls_token": False}, "last"), ({"cls_token": False}, None)],
)  # fmt: skip
def test_sentence_transformers_pooling_is_read(tmp_path: Path, modes: dict, want: str) -> None:
    assert sentence_pooling(str(sentence_folder(tmp_path, **modes))) == want


def test_unsupported_or_absent_pooling(tmp_path: Path) -> None:
    assert sentence_pooling(str(tmp_path)) is None  # (no modules.json)
    (tmp_path / "modules.json").write_text("not json")
    assert sentence_pooling(str(tmp_path)) is None
    folder = sentence_folder(tmp_path / "max", max_tokens=True)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens.*not supported"):
        sentence_pooling(str(folder))


def test_defaults_by_architecture_and_the_flag_wins(tmp_path: Path) -> None:
    args = EngineArgs(model_path=str(tmp_path))
    decoder = resolve_model_kind(args, model_config(tmp_path))
    assert (decoder.is_embedding, decoder.pooling_type) == (False, "last")
    assert not decoder.disable_radix_cache and decoder.chunked_prefill_size == 8192
    encoder = resolve_model_kind(args, model_config(tmp_path, encoder=True))
    assert (encoder.is_embedding, encoder.pooling_type) == (True, "cls")
    assert encoder.disable_radix_cache and encoder.chunked_prefill_size == -1
    assert encoder.disable_overlap_schedule  # (a pooling model runs no decode step)
    sentence_folder(tmp_path, mean_tokens=True)
    assert resolve_model_kind(args, model_config(tmp_path, encoder=True)).pooling_type == "mean"
    embedder = EngineArgs(model_path=str(tmp_path), is_embedding=True)
    mean = resolve_model_kind(embedder, model_config(tmp_path))
    assert mean.pooling_type == "mean" and mean.disable_radix_cache  # (every position read)
    flag = EngineArgs(model_path=str(tmp_path), is_embedding=True, pooling_type="LAST")
    last = resolve_model_kind(flag, model_config(tmp_path))
    assert last.pooling_type == "last" and not last.disable_radix_cache


def test_an_encoder_classifier_reads_its_first_token(tmp_path: Path) -> None:
    config = model_config(tmp_path, encoder=True, labels=("LABEL_0",))
    assert resolve_model_kind(EngineArgs(model_path="m"), config).pooling_type == "cls"
    with pytest.raises(ValueError, match="reads the first token"):
        resolve_model_kind(EngineArgs(model_path="m", pooling_type="last"), config)
    with pytest.raises(ValueError, match="pooling_type"):
        EngineArgs(model_path="m", pooling_type="max")


def test_hf_overrides_flags_reach_the_engine_args() -> None:
    import argparse

    from services.engine_args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    body = '{"architectures": ["Qwen3ForSequenceClassification"], "method": "no_post_processing"}'
    for flag in ("--hf-overrides", "--json-model-override-args"):
        args = engine_args_from(parser.parse_args(["--model", "m", flag, body]))
        assert json.loads(args.hf_overrides) == json.loads(body)
    assert engine_args_from(parser.parse_args(["--model", "m"])).hf_overrides is None


def test_a_generative_model_ignores_its_sentence_transformers_config(tmp_path: Path) -> None:
    sentence_folder(tmp_path, max_tokens=True)  # (refused for a pooling model)
    generative = resolve_model_kind(EngineArgs(model_path=str(tmp_path)), model_config(tmp_path))
    assert (generative.is_embedding, generative.pooling_type) == (False, "last")
    with pytest.raises(ValueError, match="not supported"):
        resolve_model_kind(EngineArgs(model_path=str(tmp_path)), model_config(tmp_path, True))
