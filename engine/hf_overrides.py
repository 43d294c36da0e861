"""vLLM's `--hf-overrides` (SGLang's `--json-model-override-args`): fields of the checkpoint's
config replaced before the model is built, as a JSON object.

`architectures` serves a checkpoint as another architecture of its family. With
`classifier_from_token`, a causal LM becomes a sequence classifier whose score head is made
from its lm_head rows of those tokens, as vLLM does for rerankers that answer "yes" or "no"
with their language-model head:

* `method` "from_2_way_softmax" (or `is_original_qwen3_reranker: true`), two tokens
  [false, true]: one label whose logit is lm_head[true] - lm_head[false] at the last token,
  so its sigmoid is p(true) / (p(true) + p(false)), the two-way softmax the model's card
  scores with. The original Qwen3-Reranker: `{"architectures":
  ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
  "is_original_qwen3_reranker": true}` (the client formats the prompt as its card says).
* otherwise ("no_post_processing"): one label per token, its lm_head row's logit.

The tokens are looked up in the model's tokenizer (each must be one token of its vocabulary).
"""

from __future__ import annotations

import json
from typing import Any

TWO_WAY = "from_2_way_softmax"
METHODS = (TWO_WAY, "no_post_processing")


def parse_hf_overrides(value: Any) -> dict[str, Any]:
    """The overrides as a dict (from a dict, or a JSON object's text)."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"hf_overrides: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"hf_overrides: a JSON object is needed, got {type(value).__name__}")
    arch = value.get("architectures")
    if arch is not None and (not isinstance(arch, list) or not arch
                             or not all(isinstance(a, str) for a in arch)):  # fmt: skip
        raise ValueError("hf_overrides: architectures must be a list of names")
    return dict(value)


def apply_hf_overrides(hf: Any, overrides: dict[str, Any]) -> None:
    """Set the overrides on the transformers config `hf`; a token head sets the labels."""
    for key, value in overrides.items():
        setattr(hf, key, value)
    tokens = getattr(hf, "classifier_from_token", None)
    if tokens is None:
        return
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError("hf_overrides: classifier_from_token must be a list of tokens")
    method = token_head_method(hf)
    if method == TWO_WAY:
        if len(tokens) != 2:
            raise ValueError(f"hf_overrides: {TWO_WAY} takes two tokens [false, true]")
        hf.num_labels = 1
        hf.id2label = {0: tokens[1]}
    else:
        hf.num_labels = len(tokens)
        hf.id2label = dict(enumerate(tokens))
    hf.label2id = {name: i for i, name in hf.id2label.items()}


def token_head_method(hf: Any) -> str | None:
    """How a token head is made from the lm_head (None: the config has none)."""
    if not getattr(hf, "classifier_from_token", None):
        return None
    method = getattr(hf, "method", None)
    if method is None:
        method = TWO_WAY if getattr(hf, "is_original_qwen3_reranker", False) else METHODS[1]
    if method not in METHODS:
        raise ValueError(f"hf_overrides: method {method!r} not in {METHODS}")
    return method


def token_head_rows(hf: Any, tokenizer: Any) -> tuple[list[int], bool]:
    """The vocabulary ids of the head's tokens, and whether their rows are differenced (the
    two-way softmax: true minus false)."""
    ids = []
    for token in hf.classifier_from_token:
        found = tokenizer.convert_tokens_to_ids(token)
        if found is None or (found == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise ValueError(f"classifier_from_token: {token!r} is not a token of the vocabulary")
        ids.append(int(found))
    return ids, token_head_method(hf) == TWO_WAY
