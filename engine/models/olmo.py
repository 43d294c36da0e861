"""OLMo 2 and OLMo 3 (`Olmo2ForCausalLM`, `Olmo3ForCausalLM`, AllenAI's open models).

Llama's projections and MLP, arranged otherwise:
* the norms come after each block, not before: h + norm(attn(h)), then h + norm(mlp(h)),
  with no input norm;
* q and k are RMS-normalised over their whole projection (all heads together: one norm of
  num_heads x head_dim, one of num_kv_heads x head_dim), before rope;
* OLMo 3 windows the layers `layer_types` marks "sliding_attention" (three of every four),
  each layer type with its own rope settings where the config keys them by type.
The whole-projection norms need every head's values, so tensor parallelism is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.layer_windows import layer_sliding_windows
from engine.layers.attention import PagedAttention
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import MergedLinear
from engine.layers.rotary import RotaryEmbedding
from engine.models.causal_lm import DecoderForCausalLM
from engine.models.gemma import layer_rope
from engine.models.llama import STACKED_WEIGHTS, LlamaMLP


class OlmoAttention(nn.Module):
    def __init__(
        self, config, layer_id: int, rotary: RotaryEmbedding, sliding_window: int | None
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = heads = config.num_attention_heads
        self.num_kv_heads = kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = d = getattr(config, "head_dim", None) or hidden // heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = MergedLinear(
            hidden, [("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)], bias=bias
        )
        self.o_proj = nn.Linear(heads * d, hidden, bias=bias)
        self.q_norm = RMSNorm(heads * d, config.rms_norm_eps)
        self.k_norm = RMSNorm(kv_heads * d, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(
            layer_id, heads, kv_heads, d, d**-0.5, sliding_window=sliding_window
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split((q_size, kv_size, kv_size), dim=-1)
        qk = torch.cat((self.q_norm(q.contiguous()), self.k_norm(k.contiguous())), dim=-1)
        qk = qk.view(hidden.shape[0], -1, self.head_dim)
        qk, stored = self.rotary.rotate_and_store(positions, qk, v, self.attn, forward_batch)
        out = self.attn(
            qk[:, : self.num_heads], qk[:, self.num_heads :], v, forward_batch, kv_stored=stored
        )
        return self.o_proj(out)


class OlmoDecoderLayer(nn.Module):
    def __init__(
        self, config, layer_id: int, rotary: RotaryEmbedding, sliding_window: int | None
    ) -> None:
        super().__init__()
        self.self_attn = OlmoAttention(config, layer_id, rotary, sliding_window)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(
            self.self_attn(positions, hidden, forward_batch)
        )
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class OlmoModel(nn.Module):
    def __init__(self, config, max_position: int, context_len: int) -> None:
        super().__init__()
        layers = config.num_hidden_layers
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * layers)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.rotary = nn.ModuleDict(
            {t: RotaryEmbedding(head_dim, max_position, layer_rope(config, t),
                                context_len=context_len)
             for t in dict.fromkeys(layer_types)}
        )  # fmt: skip
        windows = layer_sliding_windows(config, layers)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            OlmoDecoderLayer(config, i, self.rotary[layer_types[i]], windows[i])
            for i in range(layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden, forward_batch)
        return self.norm(hidden)


class Olmo2ForCausalLM(DecoderForCausalLM):
    supports_tensor_parallel = False
    stacked_weights = load_stacked = STACKED_WEIGHTS

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        context_len = max_position or config.max_position_embeddings
        max_position = max(max_position or 0, config.max_position_embeddings)
        self.model = OlmoModel(config, max_position, context_len)
        self.init_head(config)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    pass
