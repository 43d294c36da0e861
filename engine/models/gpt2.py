"""GPT-2: learned position embeddings, pre-LayerNorm blocks, gelu_new MLP, tied lm_head.

HF stores GPT-2's projections as `Conv1D` weights of shape [in, out]; ours are `nn.Linear`
([out, in]), so the loader transposes them. Parameter names otherwise match HF's
(`transformer.h.{i}.attn.c_attn`, ...), and checkpoints saved without the `transformer.`
prefix are accepted.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.layers.activation import get_activation, linear_gelu_tanh
from engine.layers.attention import PagedAttention
from engine.layers.layernorm import LayerNorm
from engine.layers.logits import LogitsProcessor
from engine.loader import load_named_weights

_CONV1D_WEIGHTS = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        hidden, num_heads = config.n_embd, config.n_head
        head_dim = hidden // num_heads
        scaling = head_dim**-0.5 if config.scale_attn_weights else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scaling /= layer_id + 1
        self.hidden = hidden
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.attn = PagedAttention(layer_id, num_heads, num_heads, head_dim, scaling)

    def forward(self, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).split(self.hidden, dim=-1)
        return self.c_proj(self.attn(q, k, v, forward_batch))


class GPT2MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, inner)
        self.act = get_activation(config.activation_function)
        # HF's gelu_new and gelu_pytorch_tanh are one function: on CUDA it runs in c_fc's
        # GEMM epilogue
        self.gelu_tanh = config.activation_function in ("gelu_new", "gelu_pytorch_tanh")
        self.c_proj = nn.Linear(inner, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu_tanh:
            return self.c_proj(linear_gelu_tanh(x, self.c_fc, self.act))
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_id)
        self.ln_2 = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual stream before it): the residual adds happen inside the next
        LayerNorm (one kernel on CUDA), with HF's sums and roundings."""
        x, residual = self.ln_1(hidden, residual)
        x, residual = self.ln_2(self.attn(x, forward_batch), residual)
        return self.mlp(x), residual


class GPT2Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        # the token and position embeddings are summed by the first LayerNorm, as HF sums them
        hidden, residual = self.wte(input_ids), self.wpe(positions)
        for block in self.h:
            hidden, residual = block(hidden, residual, forward_batch)
        return self.ln_f(hidden, residual)[0]


class GPT2LMHeadModel(nn.Module):
    """`forward(input_ids, positions, forward_batch)` -> float32 logits.

    Positions must stay below `config.n_positions` (learned embeddings do not extrapolate);
    `max_position` beyond it is rejected.
    """

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__()
        if max_position is not None and max_position > config.n_positions:
            raise ValueError(
                f"context length {max_position} exceeds GPT-2's n_positions {config.n_positions}"
            )
        self.config = config
        self.transformer = GPT2Model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.tie_word_embeddings:
            return self.transformer.wte.weight
        return self.lm_head.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.transformer(input_ids, positions, forward_batch)
        return self.logits_processor(hidden, self.lm_head_weight, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(self, weights, transform=self._map_weight)

    def _map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return None  # causal-mask buffers of old checkpoints
        if name.startswith("lm_head."):
            return None if self.tie_word_embeddings else (name, tensor)
        if not name.startswith("transformer."):
            name = "transformer." + name
        if name.endswith(_CONV1D_WEIGHTS):
            tensor = tensor.t()
        return name, tensor
