"""Attention and position facts of a transformers config, as transformers applies them: each
layer's sliding window, the attention-score soft cap, and the positions a model can read
(read by ModelConfig, by the models that build their layers from the config, and by the
tokenizer service, which imports no torch)."""

from __future__ import annotations

# Architectures whose transformers implementation applies `config.sliding_window` (Llama's
# and GPT-2's ignore it).
_SLIDING_WINDOW_TYPES = (
    "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3_text",
    "phi3", "ministral3", "smollm3", "olmo3", "gpt_oss",
)  # fmt: skip
# Architectures whose transformers implementation soft-caps attention scores by
# `config.attn_logit_softcapping`.
_SOFT_CAP_TYPES = ("gemma2", "gemma3_text")


def layer_sliding_windows(hf: object, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window as transformers applies it: `sliding_window` keys (the
    query's own included; 0 or None is no window), on the layers that `layer_types` marks
    "sliding_attention" where the config has that list (Qwen2 and Qwen3 derive it from
    `use_sliding_window` and `max_window_layers`, Gemma 3 alternates five windowed layers and
    a full one), else on every layer (Mistral, Mixtral, Qwen3-MoE, Phi-3)."""
    window = getattr(hf, "sliding_window", None)
    if getattr(hf, "model_type", None) not in _SLIDING_WINDOW_TYPES or not window:
        return (None,) * num_layers
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None:
        return (int(window),) * num_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def attn_logit_cap(hf: object) -> float | None:
    """The cap c of the attention scores (s -> c * tanh(s / c)) as transformers applies it,
    the same on every layer; None: not capped."""
    cap = getattr(hf, "attn_logit_softcapping", None)
    if getattr(hf, "model_type", None) not in _SOFT_CAP_TYPES or not cap:
        return None
    return float(cap)


def position_limit(model_type: str | None, max_position_embeddings: int, pad_id: int | None) -> int:
    """The positions a model reads: its position embeddings, less RoBERTa's first pad_id + 1
    (its positions start after the pad id: 514 embeddings, 512 positions)."""
    if model_type in ("roberta", "xlm-roberta"):
        return max_position_embeddings - (1 if pad_id is None else int(pad_id)) - 1
    return max_position_embeddings
