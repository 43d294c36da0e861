"""BERT and (XLM-)RoBERTa encoders: embedding models (bge-*-en, e5, all-MiniLM, bge-m3,
multilingual-e5) and cross-encoders (ms-marco-MiniLM, bge-reranker-base, bge-reranker-v2-m3).

An encoder attends both ways: every token sees its whole prompt, later tokens included. So a
prompt runs in one piece (no chunked prefill), no prefix can be reused (a prefix's states
depend on what follows it), and nothing goes to the KV cache: attention runs over the batch's
own new tokens (`encoder_attention`). `resolve_model_kind` (engine/pooling.py) serves such a
model as a pooling model with chunking and the radix cache off.

The blocks are transformers': post-LayerNorm (residual, then LayerNorm), learned absolute
positions plus token-type embeddings (the second text of a BERT pair has type 1:
`forward_batch.token_type_ids`). RoBERTa numbers positions from `pad_token_id + 1` (a
literal pad token inside a prompt, which transformers would give the pad position, is not
special-cased). Parameter names are transformers' with q/k/v fused into `attention.qkv`.

Heads: an embedding model pools the last hidden states (engine/pooling.py; sentence-
transformers' pooling config says how). `BertForSequenceClassification` runs its pooler
(dense + tanh over [CLS]) and a `classifier` Linear; RoBERTa's classifier is `dense` + tanh +
`out_proj` over <s>. Both read the first token only, so their pooling is "cls".
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.layers.activation import get_activation
from engine.layers.layernorm import LayerNorm
from engine.layers.linear import MergedLinear
from engine.loader import load_named_weights
from engine.pooling import pool_hidden

STACKED_WEIGHTS = (
    (".attention.qkv.", ".attention.self.query.", "q"),
    (".attention.qkv.", ".attention.self.key.", "k"),
    (".attention.qkv.", ".attention.self.value.", "v"),
)
# checkpoint tensors no encoder here uses: position-id buffers, MLM and pretraining heads
_SKIPPED = ("embeddings.position_ids", "cls.", "lm_head.")


def encoder_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, num_heads: int
) -> torch.Tensor:
    """Bidirectional attention within each request's tokens: q, k, v [num_tokens, heads *
    head_dim] packed as the extend batch packs them -> the same shape.

    On the CPU each request runs on its own (SDPA's flash kernel, no padding: twice as fast
    as one padded batch, whose key mask sends SDPA to the math kernel and materialises every
    score); on a GPU one padded batch (one launch of the memory-efficient kernel, which takes
    the mask without materialising the scores)."""
    lens = fb.extend_seq_lens_cpu
    assert fb.forward_mode.is_extend() and lens is not None, "an encoder runs extend batches"
    assert not any(fb.extend_prefix_lens_cpu or ()), "an encoder prompt runs in one piece"
    if q.device.type == "cpu" or len(lens) == 1:
        return attend_each(q, k, v, lens, num_heads)
    return attend_padded(q, k, v, lens, num_heads)


def attend_each(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], num_heads: int
) -> torch.Tensor:
    """`encoder_attention`, one SDPA call per request."""
    outs = []
    for qi, ki, vi in zip(q.split(lens), k.split(lens), v.split(lens)):
        n, width = qi.shape
        qi, ki, vi = (x.view(n, num_heads, -1).transpose(0, 1) for x in (qi, ki, vi))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi).transpose(0, 1).reshape(n, width))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def attend_padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], num_heads: int
) -> torch.Tensor:
    """`encoder_attention`, the requests padded to the longest, the padding masked out of
    the keys."""
    width = q.shape[1]
    longest = max(lens)
    lens_t = torch.tensor(lens, device=q.device)
    valid = torch.arange(longest, device=q.device) < lens_t[:, None]  # [batch, longest]

    def padded(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(len(lens), longest, width)
        out[valid] = x
        return out.view(len(lens), longest, num_heads, -1).transpose(1, 2)

    mask = valid[:, None, None, :]
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask)
    return out.transpose(1, 2).reshape(len(lens), longest, width)[valid]


class DenseNorm(nn.Module):
    """transformers' BertSelfOutput / BertOutput: dense, then LayerNorm of it plus the
    residual (the add inside the LayerNorm: one kernel on CUDA)."""

    def __init__(self, in_features: int, config) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x), residual)[0]


class BertAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.qkv = MergedLinear(hidden, [("q", hidden), ("k", hidden), ("v", hidden)], bias=True)
        self.output = DenseNorm(hidden, config)

    def forward(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv(hidden).chunk(3, dim=-1)
        return self.output(encoder_attention(q, k, v, fb, self.num_heads), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = DenseNorm(config.intermediate_size, config)

    def forward(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.attention(hidden, fb)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertEmbeddings(nn.Module):
    def __init__(self, config, position_offset: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.position_offset = position_offset

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        if types is None:  # every token of type 0
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(types)
        x = x + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(x)


class BertModel(nn.Module):
    """An encoder embedding model: `forward(input_ids, positions, forward_batch)` -> each
    request's pooled last hidden states, float32 [batch, hidden]."""

    base_prefix = "bert."  # the body's prefix in a classifier's checkpoint
    has_pooler = False  # (its checkpoint's pooler, unused by an embedding model, is skipped)

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__()
        offset = self.position_offset(config)
        limit = config.max_position_embeddings - offset
        if max_position is not None and max_position > limit:
            raise ValueError(f"context length {max_position} exceeds the model's {limit} positions")
        self.config = config
        self.embeddings = BertEmbeddings(config, offset)
        self.encoder = BertEncoder(config)
        if self.has_pooler:
            self.pooler = nn.Module()
            self.pooler.dense = nn.Linear(config.hidden_size, config.hidden_size)

    @staticmethod
    def position_offset(config) -> int:
        return 0

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions, fb.token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, fb)
        return hidden

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        assert forward_batch.pooling is not None, "an encoder runs as a pooling model"
        hidden = self.hidden_states(input_ids, positions, forward_batch)
        return pool_hidden(hidden, forward_batch, forward_batch.pooling)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(self, weights, STACKED_WEIGHTS, self._map_weight)

    def _map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name = name.removeprefix(self.base_prefix)
        if name.startswith(_SKIPPED) or (name.startswith("pooler.") and not self.has_pooler):
            return None
        return name, tensor


class BertForSequenceClassification(BertModel):
    """A BERT cross-encoder: [CLS]'s state through the pooler, then `classifier` -> the
    request's logits, float32 [batch, num_labels]."""

    has_pooler = True

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__(config, max_position)
        self.classifier = nn.Linear(config.hidden_size, int(config.num_labels))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        first = super().forward(input_ids, positions, forward_batch)  # ("cls" pooling)
        pooled = torch.tanh(F.linear(first, self.pooler.dense.weight.float(),
                                     self.pooler.dense.bias.float()))  # fmt: skip
        return F.linear(pooled, self.classifier.weight.float(), self.classifier.bias.float())

    def _map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.startswith("classifier."):
            return name, tensor
        return super()._map_weight(name, tensor)


class RobertaModel(BertModel):
    base_prefix = "roberta."

    @staticmethod
    def position_offset(config) -> int:
        return int(config.pad_token_id) + 1


class RobertaForSequenceClassification(RobertaModel):
    """A RoBERTa cross-encoder: <s>'s state through `classifier.dense` + tanh and
    `classifier.out_proj`."""

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__(config, max_position)
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier.out_proj = nn.Linear(config.hidden_size, int(config.num_labels))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        first = super().forward(input_ids, positions, forward_batch)  # ("cls" pooling)
        head = self.classifier
        x = torch.tanh(F.linear(first, head.dense.weight.float(), head.dense.bias.float()))
        return F.linear(x, head.out_proj.weight.float(), head.out_proj.bias.float())

    def _map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.startswith("classifier."):
            return name, tensor
        return super()._map_weight(name, tensor)

