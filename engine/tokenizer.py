"""The one way sluice loads a tokenizer: every service, the engine and the tests go through here.

Why not plain ``AutoTokenizer``: it picks a tokenizer *class* from ``config.json``'s
``model_type``, and some classes rebuild the pipeline instead of reading ``tokenizer.json``. In
transformers 5.x, ``model_type: qwen2`` is listed in ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``,
so ``AutoTokenizer`` always builds ``Qwen2Tokenizer`` -- whatever ``tokenizer_class`` says --
and that class takes only vocab and merges from ``tokenizer.json`` and installs its own NFC
normalizer, Qwen split regex and ByteLevel pre-tokenizer. The same folder then tokenizes one way
through ``AutoTokenizer`` and another through the file. ``load_tokenizer`` reads ``tokenizer.json``
exactly as saved (``PreTrainedTokenizerFast``, an alias of ``TokenizersBackend`` in 5.x), with the
special tokens and chat template from ``tokenizer_config.json``. The folders written by
``sluice make-tiny-model`` use, for qwen2/qwen3, exactly the pipeline ``Qwen2Tokenizer`` builds,
so both loaders agree on them (the unit tests check this for every architecture).
"""

from __future__ import annotations

import os
from typing import Any

# (not AutoTokenizer here: its import reads transformers' model configs, which import torch,
# 2-3 s more for every tokenizer and detokenizer process that never needs it)
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(path: str | os.PathLike[str], **kwargs: Any) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a Hugging Face folder exactly as its ``tokenizer.json`` says.

    Padding is on the left (what batched generation wants). Folders without a
    ``tokenizer.json`` (e.g. only a SentencePiece ``tokenizer.model``) fall back to
    ``AutoTokenizer``, which converts them. ``kwargs`` go to ``from_pretrained``.
    """
    kwargs.setdefault("padding_side", "left")
    if os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
        return PreTrainedTokenizerFast.from_pretrained(os.fspath(path), **kwargs)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(path), **kwargs)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    **template_kwargs: Any,
) -> list[int]:
    """Render ``messages`` (and ``tools``) with the tokenizer's own chat template and return
    the token ids; ``template_kwargs`` are extra template variables (``enable_thinking``).
    ``continue_final_message`` ends the text with the last message's content, its turn left
    open (an assistant's prefill), as transformers does.

    The template writes every special token itself (bos included where the model wants one),
    so the text is encoded without adding special tokens, as transformers does (unless
    ``add_special_tokens``, vLLM's option of its tokenize endpoint).
    """
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools or None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **template_kwargs,
    )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def bad_words_ids(tokenizer: PreTrainedTokenizerBase, words: list[str]) -> list[list[int]]:
    """vLLM's `bad_words` as the token sequences that spell them: each word as it would start
    the text and, where that tokenizes differently, after a space (as inside a sentence); a
    spelling that only adds a token in front of the other is left out. Raises ValueError for
    anything but a list of strings, or a word that is empty or only spaces."""
    if not isinstance(words, list):
        raise ValueError("bad_words: must be a list of strings")
    out: list[list[int]] = []
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"bad_words: words must be non-empty strings, got {word!r}")
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (plain, spaced):
            if ids and ids not in out and not (ids is spaced and ids[1:] == plain):
                out.append(ids)
    return out
