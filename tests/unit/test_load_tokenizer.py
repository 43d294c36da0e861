"""`engine.tokenizer.load_tokenizer` outside the folders with a tokenizer.json, and what it
imports: a tokenizer or detokenizer process never needs torch, and importing transformers'
AutoTokenizer would import it (2-3 s of every such process's start)."""

from __future__ import annotations

import json
import os
import shutil

from engine.tokenizer import load_tokenizer
from tests.factories import python_output, tiny_model


def test_a_folder_without_tokenizer_json_falls_back_to_auto_tokenizer(tmp_path) -> None:
    """BERT's folder with its WordPiece vocabulary as vocab.txt only: AutoTokenizer builds
    the tokenizer from it, which tokenizes as the tokenizer.json does."""
    src = tiny_model("bert")
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), tmp_path)
    with open(os.path.join(src, "tokenizer.json")) as f:
        vocab = json.load(f)["model"]["vocab"]
    words = sorted(vocab, key=vocab.__getitem__)
    (tmp_path / "vocab.txt").write_text("".join(w + "\n" for w in words))
    from_json, from_vocab = load_tokenizer(src), load_tokenizer(tmp_path)
    assert type(from_json) is not type(from_vocab)  # (the fallback did build it)
    for text in ("hello world", "The quick brown fox, 42 times."):
        assert from_vocab(text)["input_ids"] == from_json(text)["input_ids"]
    assert from_vocab.padding_side == "left"


def test_loading_and_using_a_tokenizer_does_not_import_torch() -> None:
    path = tiny_model("llama")
    code = (
        "import sys\n"
        "import services.tokenizer, services.detokenizer\n"
        "from engine.tokenizer import apply_chat_template, load_tokenizer\n"
        f"tok = load_tokenizer({path!r})\n"
        "ids = apply_chat_template(tok, [{'role': 'user', 'content': 'hi'}])\n"
        "assert ids and tok.decode(ids)\n"
        "print('torch' in sys.modules)\n"
    )
    assert python_output("-c", code).split()[-1] == "False"
