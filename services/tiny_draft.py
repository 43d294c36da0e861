"""A draft model for speculative decoding derived from a model folder: its first layers (a
smaller, faster model of the same vocabulary and tokenizer), its weights perturbed by
relative noise, or both. No draft model can be downloaded here, and a random draft model
agrees with a random target on nothing; one derived from the target agrees with it on part
of its tokens, as a real draft does.

    sluice make-tiny-model DRAFT_DIR --draft-of MODEL_DIR [--num-layers N] [--draft-noise X]

(`add_args` / `run`: the command line of these and of EAGLE heads, services/tiny_eagle.py.)
"""

from __future__ import annotations

import argparse
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


def add_args(parser: argparse.ArgumentParser) -> None:
    """`make-tiny-model`'s options for a drafter derived from a model folder."""
    parser.add_argument("--draft-of", metavar="MODEL_DIR", default=None,
                        help="instead of a random model: a draft model for speculative decoding "
                        "derived from MODEL_DIR (its first --num-layers layers, its weights "
                        "plus --draft-noise x their std of noise; services/tiny_draft.py)")
    parser.add_argument("--draft-noise", type=float, default=0.0)
    parser.add_argument("--eagle-of", metavar="MODEL_DIR", default=None,
                        help="instead of a random model: an EAGLE draft head for MODEL_DIR, in "
                        "the checkpoints' format (services/tiny_eagle.py)")
    parser.add_argument("--eagle3", action="store_true", help="with --eagle-of: an EAGLE-3 head")
    parser.add_argument("--eagle-draft-vocab", type=int, default=None,
                        help="with --eagle3: its draft vocabulary (default: the model's)")
    parser.add_argument("--eagle-copy-layers", type=int, default=0,
                        help="with --eagle-of (EAGLE): a head derived from the model's first N "
                        "layers, which agrees with it on part of its tokens (0: random)")


def run(args: argparse.Namespace) -> str | None:
    """The drafter `args` ask for, written to `args.out_dir` (its path); None: none asked."""
    if args.draft_of is not None:
        return make_draft_model(
            args.draft_of, args.out_dir, args.num_layers, args.draft_noise, args.seed
        )
    if args.eagle_of is not None:
        from services.tiny_eagle import make_eagle_head

        return make_eagle_head(args.eagle_of, args.out_dir, args.eagle3, args.eagle_draft_vocab,
                               args.eagle_copy_layers, args.seed)  # fmt: skip
    return None
