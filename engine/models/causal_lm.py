"""What the decoder-only models built from `model.embed_tokens` share: the lm_head (or the
tied embedding), the logits, and loading through `load_named_weights`."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch
from torch import nn

from engine.distributed import current_tp
from engine.forward_batch import ForwardBatch
from engine.layers.logits import LogitsProcessor
from engine.layers.parallel import ParallelLMHead
from engine.loader import load_named_weights


class DecoderForCausalLM(nn.Module):
    """`forward(input_ids, positions, forward_batch)` -> float32 logits (LogitsProcessor).

    A subclass builds `self.model` (with `embed_tokens`) and calls `init_head`; `load_stacked`
    rows `(ours, theirs, shard)` send checkpoint names to stacked parameters (see
    `load_named_weights`); `_map_weight` renames or skips checkpoint tensors.
    """

    load_stacked: tuple[tuple[str, str, Hashable], ...] = ()

    def init_head(self, config, divisor: float | None = None) -> None:
        """The lm_head: none where tied (the embedding's rows; with tensor parallelism this
        rank's part of them), this rank's vocabulary rows under tensor parallelism."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        tp = current_tp()
        if self.tie_word_embeddings:
            pass
        elif tp.size > 1:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_processor = LogitsProcessor(config.vocab_size, tp=tp, divisor=divisor)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(hidden, self.lm_head_weight, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        config = getattr(self, "config", None)

        def transform(name: str, tensor: torch.Tensor):
            if is_mtp_weight(config, name):
                return None  # a multi-token-prediction layer's: not served (SGLang's default)
            return self._map_weight(name, tensor)

        return load_named_weights(self, weights, stacked=self.load_stacked, transform=transform)

    def _map_weight(self, name: str, tensor: torch.Tensor):
        if "rotary_emb.inv_freq" in name:
            return None  # derived, stored by old checkpoints
        if self.tie_word_embeddings and name.startswith("lm_head."):
            return None  # tied: the embedding is the head
        return name, tensor


def is_mtp_weight(config, name: str) -> bool:
    """Whether checkpoint tensor `name` is a multi-token-prediction weight: ERNIE 4.5's
    `model.mtp_*` block, or one of the layers DeepSeek-V3 and GLM-4.5 checkpoints store after
    the decoder's (`model.layers.{i}` for `num_hidden_layers <= i < num_hidden_layers +
    num_nextn_predict_layers`)."""
    if name.startswith("model.mtp_"):
        return True
    extra = getattr(config, "num_nextn_predict_layers", None) or 0
    if not extra or not name.startswith("model.layers."):
        return False
    index = name.split(".", 3)[2]
    first = config.num_hidden_layers
    return index.isdigit() and first <= int(index) < first + extra
