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

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_batch import ForwardBatch

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

    SequenceClassifier.__name__ = SequenceClassifier.__qualname__ = (
        base.__name__.replace("ForCausalLM", "").replace("LMHeadModel", "")
        + "ForSequenceClassification"
    )
    return SequenceClassifier
