"""Sequence classifiers (`*ForSequenceClassification`): a causal model's body with a `score`
head in place of the lm_head, as transformers builds them (cross-encoders and rerankers such
as bge-reranker-v2-gemma or Qwen3-Reranker converted to a classifier, reward models,
sentiment models).

transformers' classifier runs the body, applies `score` (Linear(hidden, num_labels), no bias)
to every position and keeps the last non-padding token's logits. Here the body's final hidden
states are pooled first (engine/pooling.py: the last token's by default), then the head is
applied to the pooled rows only. The head has no bias, so applying it to a mean-pooled sum
chunk by chunk is exact too.

`sequence_classifier(base)` makes the classifier class of any causal model class of the
registry: its checkpoint has the base's body weights (`model.*`, GPT-2's `transformer.*`) and
`score.weight`, and no lm_head.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.hf_overrides import token_head_method, token_head_rows

# classifier architecture -> the causal architecture whose body it has
CLASSIFIER_BASES = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "MixtralForSequenceClassification": "MixtralForCausalLM",
    "Qwen2MoeForSequenceClassification": "Qwen2MoeForCausalLM",
    "Qwen3MoeForSequenceClassification": "Qwen3MoeForCausalLM",
    "Gemma2ForSequenceClassification": "Gemma2ForCausalLM",
    "Gemma3TextForSequenceClassification": "Gemma3ForCausalLM",
    "GPT2ForSequenceClassification": "GPT2LMHeadModel",
}


def token_head_weight(config, lm_head: torch.Tensor) -> torch.Tensor:
    """The score head [num_labels, hidden] made from the lm_head rows of the config's
    `classifier_from_token` (looked up in the tokenizer of the model's folder)."""
    from engine.tokenizer import load_tokenizer

    ids, two_way = token_head_rows(config, load_tokenizer(config.name_or_path))
    if max(ids) >= lm_head.shape[0]:
        raise ValueError(f"classifier_from_token: ids {ids} beyond the lm_head's rows")
    rows = lm_head[ids].float()
    return (rows[1:] - rows[:1]) if two_way else rows


@functools.cache
def sequence_classifier(base: type[nn.Module]) -> type[nn.Module]:
    """The sequence classifier class over the causal model class `base`."""

    class SequenceClassifier(base):  # type: ignore[misc, valid-type]
        def __init__(self, config, max_position: int | None = None) -> None:
            super().__init__(config, max_position)
            if hasattr(self, "lm_head"):
                del self.lm_head  # (never in a classifier's checkpoint)
            hidden = getattr(config, "hidden_size", None) or config.n_embd
            self.score = nn.Linear(hidden, int(config.num_labels), bias=False)

        @property
        def lm_head_weight(self) -> torch.Tensor:
            return self.score.weight  # (unused: the forward pools before any head)

        def forward(
            self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
        ) -> torch.Tensor:
            """Per request of the extend batch, its chunk's pooled logits, float32
            [batch, num_labels]."""
            assert forward_batch.pooling is not None, "a classifier runs as a pooling model"
            pooled = super().forward(input_ids, positions, forward_batch)  # float32
            return F.linear(pooled, self.score.weight.to(pooled.dtype))

        def _map_weight(self, name: str, tensor: torch.Tensor):
            if name.startswith("score."):
                return name, tensor
            if name.startswith("lm_head."):
                return None
            return super()._map_weight(name, tensor)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            """A classifier's checkpoint; or, with `classifier_from_token` (engine/
            hf_overrides.py), a causal LM's, whose lm_head rows (the input embedding's when
            tied) of those tokens become the score head."""
            if token_head_method(self.config) is None:
                return super().load_weights(weights)
            lm_head: list[torch.Tensor] = []

            def body(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator:
                for name, tensor in stream:
                    if name == "lm_head.weight":
                        lm_head.append(tensor)
                    yield name, tensor

            loaded = super().load_weights(body(weights))
            rows = lm_head[0] if lm_head else base.lm_head_weight.fget(self)  # (tied)
            self.score.weight.data.copy_(token_head_weight(self.config, rows))
            return loaded | {"score.weight"}

    SequenceClassifier.__name__ = SequenceClassifier.__qualname__ = (
        base.__name__.replace("ForCausalLM", "").replace("LMHeadModel", "")
        + "ForSequenceClassification"
    )
    return SequenceClassifier
