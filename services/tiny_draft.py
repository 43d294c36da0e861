"""A draft model for speculative decoding derived from a model folder: its first layers (a
smaller, faster model of the same vocabulary and tokenizer), its weights perturbed by
relative noise, or both. No draft model can be downloaded here, and a random draft model
agrees with a random target on nothing; one derived from the target agrees with it on part
of its tokens, as a real draft does.

    sluice make-tiny-model DRAFT_DIR --draft-of MODEL_DIR [--num-layers N] [--draft-noise X]
"""

from __future__ import annotations

import os
import shutil

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# files of a model folder that are not its weights or config (copied as they are)
_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt")  # fmt: skip


def make_draft_model(
    src: str, out_dir: str, num_layers: int | None = None, noise: float = 0.0, seed: int = 0
) -> str:
    """Write to `out_dir` the model of folder `src` with only its first `num_layers` decoder
    layers (None: all) and every weight w + noise * std(w) * N(0, 1). Returns `out_dir`."""
    config = AutoConfig.from_pretrained(src)
    total = config.num_hidden_layers
    if num_layers is not None and not 1 <= num_layers <= total:
        raise ValueError(f"draft model: num_layers {num_layers} not in 1..{total}")
    if noise < 0:
        raise ValueError(f"draft model: noise {noise} < 0")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    if num_layers is not None and num_layers < total:
        decoder = model.get_decoder()
        decoder.layers = decoder.layers[:num_layers]
        model.config.num_hidden_layers = num_layers
        layer_types = getattr(model.config, "layer_types", None)  # (windowed models)
        if layer_types is not None:
            model.config.layer_types = layer_types[:num_layers]
    if noise:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.numel() > 1 and p.is_floating_point():
                    std = float(p.std())
                    p.add_(torch.randn(p.shape, generator=generator) * (noise * std))
    os.makedirs(out_dir, exist_ok=True)
    dtype = getattr(config, "dtype", None) or torch.float32  # (the checkpoint's)
    model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in _COPIED:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(out_dir, name))
    for name in os.listdir(out_dir):  # written through a 0600 temporary file
        os.chmod(os.path.join(out_dir, name), 0o644)
    return out_dir
