"""Gemma 3 text models (`Gemma3ForCausalLM`: gemma-3-270m, gemma-3-1b; model_type
gemma3_text), as transformers computes them.

What differs from the Llama family (engine/models/llama.py):
* RMSNorm scales by `1 + weight` in float32 before casting back (`GemmaRMSNorm`), and each
  layer has four: before and after attention, before and after the MLP; the residual is added
  after the post-norms;
* q and k get a per-head RMSNorm before rope; the softmax scale is
  `query_pre_attn_scalar ** -0.5`, not head_dim's;
* layers alternate sliding-window ("sliding_attention", rope base 10k) and full attention
  ("full_attention", rope base 1M, possibly scaled) as `config.layer_types` says, each layer
  type with its own rope table;
* the embedding is multiplied by sqrt(hidden_size) (rounded to the weights' dtype, as
  transformers does), the lm_head is tied, and a `final_logit_softcapping` (None in Gemma 3)
  is honoured;
* the MLP is GeGLU: `gelu_pytorch_tanh(gate) * up`.

The multimodal checkpoints (`Gemma3ForConditionalGeneration`, gemma-3-4b and up) are not
loaded: their text weights sit under a vision model's config.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import layer_sliding_windows
from engine.forward_batch import ForwardBatch
from engine.layers.attention import PagedAttention
from engine.layers.layernorm import GemmaRMSNorm
from engine.layers.linear import MergedLinear
from engine.layers.logits import LogitsProcessor
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.loader import load_named_weights
from engine.models.llama import STACKED_WEIGHTS

LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_rope(config, layer_type: str) -> dict:
    """The rope settings of one layer type (transformers 5 keys `rope_parameters` by type)."""
    raw = getattr(config, "rope_parameters", None) or {}
    if layer_type in raw:
        return rope_parameters(SimpleNamespace(rope_parameters=raw[layer_type]))
    return rope_parameters(config)


class Gemma3Attention(nn.Module):
    def __init__(
        self, config, layer_id: int, rotary: RotaryEmbedding, sliding_window: int | None
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(config.attention_bias)
        self.qkv_proj = MergedLinear(
            config.hidden_size, [("q", q_size), ("k", kv_size), ("v", kv_size)], bias=bias
        )
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        scaling = config.query_pre_attn_scalar**-0.5
        self.attn = PagedAttention(
            layer_id, self.num_heads, self.num_kv_heads, self.head_dim, scaling,
            sliding_window=sliding_window,
        )  # fmt: skip

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        qk = self.rotary(positions, torch.cat((q, k), dim=1))
        out = self.attn(qk[:, : self.num_heads], qk[:, self.num_heads :], v, forward_batch)
        return self.o_proj(out)


class Gemma3MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        if config.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"hidden_activation {config.hidden_activation!r} is not supported "
                "(Gemma 3 uses gelu_pytorch_tanh)"
            )
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [("gate", inter), ("up", inter)])
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, config, layer_id: int, rotary: RotaryEmbedding, sliding_window: int | None
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_id, rotary, sliding_window)
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), forward_batch)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3TextModel(nn.Module):
    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        layer_types = list(config.layer_types)
        unknown = set(layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"layer_types {sorted(unknown)} are not supported")
        # one rope table per layer type (shared by the layers of that type)
        self.rotary = nn.ModuleDict(
            {t: RotaryEmbedding(config.head_dim, max_position, layer_rope(config, t))
             for t in dict.fromkeys(layer_types)}
        )  # fmt: skip
        windows = layer_sliding_windows(config, config.num_hidden_layers)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # transformers multiplies by sqrt(hidden_size) rounded to the weights' dtype (the
        # loader builds the model under that default dtype); a Python float keeps the
        # multiply free of host tensors (CUDA graphs)
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.get_default_dtype(), device="cpu")
        self.embed_scale = float(scale)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, self.rotary[layer_types[i]], windows[i])
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        for layer in self.layers:
            hidden = layer(positions, hidden, forward_batch)
        return self.norm(hidden)


class Gemma3ForCausalLM(nn.Module):
    """`forward(input_ids, positions, forward_batch)` -> float32 logits."""

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__()
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if getattr(config, key, None):
                raise ValueError(f"{key}={getattr(config, key)!r} is not supported")
        self.config = config
        max_position = max(max_position or 0, config.max_position_embeddings)
        self.model = Gemma3TextModel(config, max_position)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, forward_batch)
        logits = self.logits_processor(hidden, self.model.embed_tokens.weight, forward_batch)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(
            self, weights, stacked=STACKED_WEIGHTS, transform=self._map_weight
        )

    @staticmethod
    def _map_weight(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.startswith("lm_head."):
            return None  # tied: the embedding is the head
        return name, tensor
