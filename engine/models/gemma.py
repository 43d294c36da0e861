"""Gemma 2 (`Gemma2ForCausalLM`: gemma-2-2b/9b/27b; model_type gemma2) and Gemma 3 text models
(`Gemma3ForCausalLM`: gemma-3-270m, gemma-3-1b; model_type gemma3_text), as transformers
computes them.

What differs from the Llama family (engine/models/llama.py):
* RMSNorm scales by `1 + weight` in float32 before casting back (`GemmaRMSNorm`), and each
  layer has four: before and after attention, before and after the MLP; the residual is added
  after the post-norms;
* the softmax scale is `query_pre_attn_scalar ** -0.5`, not head_dim's; Gemma 3 also puts a
  per-head RMSNorm on q and k before rope;
* attention scores are soft-capped, s -> c * tanh(s / c), where `attn_logit_softcapping` c is
  set (50 in Gemma 2, None in Gemma 3): every backend applies the layer's `logit_cap`;
* layers alternate sliding-window ("sliding_attention") and full attention ("full_attention")
  as `config.layer_types` says (Gemma 2 1:1, Gemma 3 5:1); Gemma 3 gives each layer type its
  own rope table (base 10k local, 1M global, possibly scaled), Gemma 2 shares one;
* the embedding is multiplied by sqrt(hidden_size) (rounded to the weights' dtype, as
  transformers does), the lm_head is tied, and the final logits are soft-capped where
  `final_logit_softcapping` is set (30 in Gemma 2, None in Gemma 3);
* the MLP is GeGLU: `gelu_pytorch_tanh(gate) * up`.

The multimodal checkpoints (`Gemma3ForConditionalGeneration`, gemma-3-4b and up) are served
as their text model: the config's `text_config` (engine/config.py) and the weights under
`language_model.` (or `model.language_model.`); the vision tower and projector are skipped,
and images are refused by the router.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.layer_windows import attn_logit_cap, layer_sliding_windows
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


class GemmaAttention(nn.Module):
    def __init__(
        self, config, layer_id: int, rotary: RotaryEmbedding, sliding_window: int | None,
        qk_norm: bool,
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
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        scaling = config.query_pre_attn_scalar**-0.5
        self.attn = PagedAttention(
            layer_id, self.num_heads, self.num_kv_heads, self.head_dim, scaling,
            sliding_window=sliding_window, logit_cap=attn_logit_cap(config),
        )  # fmt: skip

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim
        qk = qkv[:, :qk_size].view(num_tokens, -1, self.head_dim)  # q and k, read in place
        v = qkv[:, qk_size:]
        if self.qk_norm:
            q, k = self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])
            qk = torch.cat((q, k), dim=1)
        qk, stored = self.rotary.rotate_and_store(positions, qk, v, self.attn, forward_batch)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.attn(q, k, v, forward_batch, kv_stored=stored)
        return self.o_proj(out)


class GemmaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        if config.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"hidden_activation {config.hidden_activation!r} is not supported "
                "(Gemma 2 and 3 use gelu_pytorch_tanh)"
            )
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [("gate", inter), ("up", inter)])
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, config, layer_id: int, rotary: RotaryEmbedding, sliding_window: int | None,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GemmaAttention(config, layer_id, rotary, sliding_window, qk_norm)
        self.mlp = GemmaMLP(config)
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


class GemmaTextModel(nn.Module):
    def __init__(self, config, max_position: int, qk_norm: bool) -> None:
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
            GemmaDecoderLayer(config, i, self.rotary[layer_types[i]], windows[i], qk_norm)
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


class GemmaForCausalLM(nn.Module):
    """`forward(input_ids, positions, forward_batch)` -> float32 logits. The subclasses say
    whether q and k are normed."""

    qk_norm: bool
    stacked_weights = STACKED_WEIGHTS  # (fused, PEFT/HF name, shard): for LoRA too

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", None):
            raise ValueError("use_bidirectional_attention=True is not supported")
        self.config = config
        max_position = max(max_position or 0, config.max_position_embeddings)
        self.model = GemmaTextModel(config, max_position, self.qk_norm)
        soft_cap = getattr(config, "final_logit_softcapping", None)
        self.logits_processor = LogitsProcessor(config.vocab_size, soft_cap)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(hidden, self.model.embed_tokens.weight, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(
            self, weights, stacked=STACKED_WEIGHTS, transform=self._map_weight
        )

    @staticmethod
    def _map_weight(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.startswith("lm_head."):
            return None  # tied: the embedding is the head
        return name, tensor


class Gemma2ForCausalLM(GemmaForCausalLM):
    qk_norm = False


class Gemma3ForCausalLM(GemmaForCausalLM):
    qk_norm = True


# where a multimodal checkpoint keeps its text model's weights (transformers' saved layout, and
# the one of its own modules), and the parts that are not loaded
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_SKIPPED_PREFIXES = (
    "vision_tower.", "multi_modal_projector.", "model.vision_tower.",
    "model.multi_modal_projector.", "language_model.lm_head.", "lm_head.",
)  # fmt: skip


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """A multimodal Gemma 3 checkpoint (gemma-3-4b/12b/27b) served for text: its text model,
    built from `config.text_config`, without the vision tower."""

    @staticmethod
    def _map_weight(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        for prefix in _TEXT_PREFIXES:
            if name.startswith(prefix):
                return "model." + name.removeprefix(prefix), tensor
        if name.startswith(_SKIPPED_PREFIXES):
            return None
        return name, tensor  # not a text weight: the loader reports it
