"""Phi-3, Phi-3.5 and Phi-4 (`Phi3ForCausalLM`): the Llama layer with Phi's checkpoint layout.

What differs from Llama is all in the config or the checkpoint:
* the checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` tensor (rows
  [q; k; v] and [gate; up]). They are split into Llama's parts as they load, so tensor
  parallelism takes each part's rows as for Llama, and an FP8 checkpoint's scales follow
  their rows;
* Phi-4-mini rotates the first `partial_rotary_factor` (0.75) of each head;
* Phi-3.5 and Phi-4-mini scale rope with LongRoPE (`engine.layers.rotary`), whose long or
  short factor set is chosen by the served context length;
* Phi-3-mini-4k windows every layer at `sliding_window` (2047), as transformers does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.layers.fp8 import QuantizedWeight
from engine.models.llama import LlamaForCausalLM

Weights = Iterable[tuple[str, torch.Tensor]]


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(split_fused_weights(weights, self.fused_parts()))

    def fused_parts(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Checkpoint name part -> (Llama name part, rows) of each piece, in row order."""
        config = self.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        q, kv, inter = heads * head_dim, kv_heads * head_dim, config.intermediate_size
        return {
            ".qkv_proj.": ((".q_proj.", q), (".k_proj.", kv), (".v_proj.", kv)),
            ".gate_up_proj.": ((".gate_proj.", inter), (".up_proj.", inter)),
        }


def split_fused_weights(
    weights: Weights, parts: dict[str, tuple[tuple[str, int], ...]]
) -> Iterator[tuple[str, object]]:
    """Each fused checkpoint tensor (a name holding a key of `parts`) as its pieces, renamed;
    weights and biases are split by rows, an FP8 weight's per-tensor scale goes to every piece
    and its block scales by block rows; other tensors pass through."""
    for name, tensor in weights:
        fused = next((key for key in parts if key in name), None)
        if fused is None:
            yield name, tensor
            continue
        pieces = parts[fused]
        rows = sum(size for _, size in pieces)
        if tensor.shape[0] != rows:
            sizes = " + ".join(f"{piece.strip('.')} {size}" for piece, size in pieces)
            raise ValueError(f"weight {name!r}: {tensor.shape[0]} rows, expected {rows} ({sizes})")
        start = 0
        for piece, size in pieces:
            yield name.replace(fused, piece), _rows(tensor, start, size, name)
            start += size


def _rows(tensor: object, start: int, size: int, name: str) -> object:
    if not isinstance(tensor, QuantizedWeight):
        return tensor[start : start + size]
    data, scale = tensor.data[start : start + size], tensor.scale
    if scale.numel() > 1:  # one scale per block of rows and columns
        block_rows = tensor.block[0] if tensor.block else 1
        if start % block_rows or size % block_rows:
            raise ValueError(
                f"weight {name!r}: its pieces of {size} rows do not start on its "
                f"{block_rows}-row scale blocks"
            )
        scale = scale[start // block_rows : (start + size) // block_rows]
    return QuantizedWeight(data, scale, tensor.block)
