"""``sluice make-tiny-model --num-labels N``: a tiny sequence classifier
(`*ForSequenceClassification`, engine/models/classification.py) from a tiny causal model.

The classifier keeps the causal model's body (the same shaped random weights) and gets a
`score` head of N rows: the first N rows of the causal model's output embedding, scaled so
that its logits have a standard deviation of about SCORE_SCALE (peaked enough to rank
documents apart, not so peaked that every sigmoid is 0 or 1).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification, PretrainedConfig

SCORE_SCALE = 2.0  # standard deviation of the classifier's logits (the causal model's: 8)


def to_classifier(
    causal: torch.nn.Module, config: PretrainedConfig, num_labels: int, logit_scale: float
) -> torch.nn.Module:
    """The sequence classifier with `causal`'s body and a `num_labels`-row score head;
    `logit_scale` is the standard deviation of `causal`'s logits."""
    if num_labels < 1:
        raise ValueError(f"num_labels must be >= 1, got {num_labels}")
    if num_labels > config.vocab_size:
        raise ValueError(f"num_labels {num_labels} is more than the vocabulary")
    config.num_labels = num_labels  # (also sets id2label / label2id: LABEL_0, ...)
    model = AutoModelForSequenceClassification.from_config(config, dtype=causal.dtype)
    model.base_model.load_state_dict(causal.base_model.state_dict())
    rows = causal.get_output_embeddings().weight[:num_labels]
    with torch.no_grad():
        model.score.weight.copy_(rows * (SCORE_SCALE / logit_scale))
    return model
