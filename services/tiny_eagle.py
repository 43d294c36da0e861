"""An EAGLE draft head for a model folder, in the checkpoints' own format (speculative
decoding, engine/speculative/eagle.py), and a plain-torch reference of its forward.

    sluice make-tiny-model HEAD_DIR --eagle-of MODEL_DIR [--eagle3 [--eagle-draft-vocab N]]
        [--eagle-copy-layers N]

No EAGLE head can be downloaded here, and a random head agrees with a random model on
nothing (training one does not help: a tiny random model's greedy text is a hash of its
context). So there are two kinds:

* random (the default; EAGLE or EAGLE-3): for the engine's correctness, whatever it drafts;
* derived (`--eagle-copy-layers N`, EAGLE only): a head that computes the model's first N
  layers. Its first layer passes `fc`'s output through unchanged (its o_proj and down_proj
  are zero) and `fc` takes the embedding only, so the residual stream of its next layers,
  copies of the model's first N, is the model's over the tokens from the second on (rope is
  relative: one token fewer at the start). Its logits are the model's lm_head over that
  stream without the final norm: the model's own argmax when the final norm's weight is 1 and
  the later layers change little (benchmarks/speculative_draft.py builds such a model), as
  the first N layers of the model would draft (services/tiny_draft.py). It reads none of the
  model's hidden states: the reference test (tests/integration/test_speculative_eagle.py)
  checks that path with random heads.

Formats (as the published checkpoints):
* EAGLE: `config.json` of the model's family (`architectures` as the model's: the engine
  picks the head's class from the algorithm), `fc.weight` [H, 2H], `layers.{i}.*` with no
  input norm in layer 0, `embed_tokens.weight` (a copy of the model's); no final norm and no
  lm_head (the model's).
* EAGLE-3: `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, `fc.weight`
  [H, 3H], `midlayer.*` (q/k/v over 2H, `hidden_norm`), `norm.weight`, `lm_head.weight`
  [draft vocab, H], `d2t` (draft id -> model id - draft id) and `t2d` (a mask over the
  model's ids); the draft vocabulary is a random sorted subset of the model's ids.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "chat_template.jinja", "generation_config.json")  # fmt: skip


def default_aux_layer_ids(num_layers: int) -> list[int] | None:
    """EAGLE-3's `eagle_aux_hidden_state_layer_ids` for a model of `num_layers` (None: the
    default, layers 2, L // 2 and L - 3, are distinct and exist)."""
    if len({2, num_layers // 2, num_layers - 3}) == 3 and num_layers >= 5:
        return None
    if num_layers < 3:
        raise ValueError("EAGLE-3 needs a model of three layers or more")
    return [-1, num_layers // 2 - 1, num_layers - 2]  # (+1: the inputs of 0, L // 2, L - 1)


def aux_layers(num_layers: int, ids: list[int] | None) -> list[int]:
    if ids is None:
        return sorted([2, num_layers // 2, num_layers - 3])
    return sorted(i + 1 for i in ids)


def model_states(model, input_ids: torch.Tensor, eagle3: bool, layers: list[int] | None):
    """The model's logits [T, V] and the hidden states the head reads at each position
    ([T, H]: the final normed one; EAGLE-3: [T, 3H], the residual stream entering `layers`)
    for one sequence, from transformers' hidden states (index i: layer i's input; the last:
    after the final norm)."""
    out = model(input_ids[None], output_hidden_states=True)
    states = out.hidden_states
    if eagle3:
        # (index L of transformers' tuple is normed, not the stream after the last layer)
        if max(layers) >= model.config.num_hidden_layers:
            raise ValueError("the reference reads the inputs of layers 0 .. L - 1 only")
        hidden = torch.cat([states[i][0] for i in layers], dim=-1)
    else:
        hidden = states[-1][0]
    return out.logits[0], hidden


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.to(torch.float64)[:, None] * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[:, None]
    half = d // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def _attention(w: dict, p: str, x: torch.Tensor, positions: torch.Tensor, cfg) -> torch.Tensor:
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    t = x.shape[0]
    q = (x @ w[p + "q_proj.weight"].T).view(t, heads, d)
    k = (x @ w[p + "k_proj.weight"].T).view(t, kv_heads, d)
    v = (x @ w[p + "v_proj.weight"].T).view(t, kv_heads, d)
    theta = float(getattr(cfg, "rope_theta", None) or
                  (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    q, k = _rope(q, positions, theta), _rope(k, positions, theta)
    rep = heads // kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, heads * d)
    return out @ w[p + "o_proj.weight"].T


def _mlp(w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T
    return (F.silu(gate) * up) @ w[p + "down_proj.weight"].T


def head_forward(w: dict, cfg, embed: torch.Tensor, head: torch.Tensor, input_ids: torch.Tensor,
                 hidden_in: torch.Tensor, positions: torch.Tensor, eagle3: bool,
                 own: torch.Tensor | None = None):
    """The head over one sequence, full causal attention: (logits [T, draft vocab], output
    hidden [T, H]). `w`: the checkpoint's tensors by name; `embed`, `head`: the model's input
    embedding and the lm_head the head uses (its own for EAGLE-3 with a draft vocabulary);
    `hidden_in` [T1, width]: the model's states of the first T1 positions; `own` [T - T1, H]:
    the head's own outputs read by the positions after (its drafts)."""
    eps = cfg.rms_norm_eps
    e = embed[input_ids]
    if eagle3:
        h = hidden_in @ w["fc.weight"].T
        if own is not None:
            h = torch.cat([h, own], 0)
        p = "midlayer."
        x = torch.cat([_rms(e, w[p + "input_layernorm.weight"], eps),
                       _rms(h, w[p + "hidden_norm.weight"], eps)], -1)
        h = h + _attention(w, p + "self_attn.", x, positions, cfg)
        h = h + _mlp(w, p + "mlp.", _rms(h, w[p + "post_attention_layernorm.weight"], eps))
        return _rms(h, w["norm.weight"], eps) @ head.T, h
    if own is not None:
        hidden_in = torch.cat([hidden_in, own], 0)
    h = torch.cat([e, hidden_in], -1) @ w["fc.weight"].T
    if "fc.bias" in w:
        h = h + w["fc.bias"]
    for i in range(len({k.split(".")[1] for k in w if k.startswith("layers.")})):
        p = f"layers.{i}."
        x = h if i == 0 else _rms(h, w[p + "input_layernorm.weight"], eps)
        h = h + _attention(w, p + "self_attn.", x, positions, cfg)
        h = h + _mlp(w, p + "mlp.", _rms(h, w[p + "post_attention_layernorm.weight"], eps))
    return h @ head.T, h


def _random_head(cfg, eagle3: bool, draft_vocab: int, generator: torch.Generator) -> dict:
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or hidden // heads

    def lin(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=generator) / math.sqrt(inp)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=generator)

    p = "midlayer." if eagle3 else "layers.0."
    qkv_in = 2 * hidden if eagle3 else hidden
    w = {
        "fc.weight": lin(hidden, (3 if eagle3 else 2) * hidden),
        p + "self_attn.q_proj.weight": lin(heads * d, qkv_in),
        p + "self_attn.k_proj.weight": lin(kv_heads * d, qkv_in),
        p + "self_attn.v_proj.weight": lin(kv_heads * d, qkv_in),
        p + "self_attn.o_proj.weight": lin(hidden, heads * d),
        p + "mlp.gate_proj.weight": lin(inter, hidden),
        p + "mlp.up_proj.weight": lin(inter, hidden),
        p + "mlp.down_proj.weight": lin(hidden, inter),
        p + "post_attention_layernorm.weight": norm(),
    }
    if eagle3:
        w[p + "input_layernorm.weight"] = norm()
        w[p + "hidden_norm.weight"] = norm()
        w["norm.weight"] = norm()
        w["lm_head.weight"] = lin(draft_vocab, hidden) * 4.0  # (peaked logits)
    return w


_LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral")
# targets of other families a random head is written for: the head is a Llama of their
# width (SGLang's EAGLE-3 heads of DeepSeek-V3 / Kimi-K2 are LlamaForCausalLMEagle3 too)
_OTHER_TARGETS = ("deepseek_v3",)


def _llama_head_config(cfg):
    """A Llama config of the target's width, vocabulary and depth for its head (GQA-free
    attention of hidden / heads per head, default rope)."""
    from transformers import LlamaConfig

    heads = cfg.num_attention_heads
    return LlamaConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=cfg.hidden_size // heads, num_hidden_layers=cfg.num_hidden_layers,
        vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=getattr(cfg, "pad_token_id", None), architectures=["LlamaForCausalLM"],
    )  # fmt: skip


def make_eagle_head(
    src: str,
    out_dir: str,
    eagle3: bool = False,
    draft_vocab: int | None = None,
    copy_layers: int = 0,
    seed: int = 0,
) -> str:
    """Write an EAGLE (or EAGLE-3) head for the model of folder `src` to `out_dir`: random, or
    derived from its first `copy_layers` layers (see the module's note). Returns `out_dir`."""
    cfg = AutoConfig.from_pretrained(src)
    if cfg.model_type not in _LLAMA_FAMILY:
        if cfg.model_type not in _OTHER_TARGETS or copy_layers:
            raise ValueError(f"EAGLE head: a model of the Llama family (or a random head of "
                             f"{_OTHER_TARGETS}), not {cfg.model_type}")  # fmt: skip
        cfg = _llama_head_config(cfg)
    if copy_layers and (eagle3 or not 1 <= copy_layers <= cfg.num_hidden_layers):
        raise ValueError(f"EAGLE head: copy_layers {copy_layers}: an EAGLE head (not EAGLE-3) "
                         f"of 1 .. {cfg.num_hidden_layers} of the model's layers")  # fmt: skip
    model = load_file(os.path.join(src, "model.safetensors"))  # (a tiny model's one file)
    vocab = cfg.vocab_size
    draft_vocab = min(draft_vocab or vocab, vocab) if eagle3 else vocab
    generator = torch.Generator().manual_seed(seed)
    w = _random_head(cfg, eagle3, draft_vocab, generator)
    tensors = {k: v.contiguous() for k, v in w.items()}
    head_cfg = cfg.to_dict()
    head_cfg.update(num_hidden_layers=1 + copy_layers, tie_word_embeddings=False)
    for key in ("layer_types", "auto_map", "_name_or_path"):
        head_cfg.pop(key, None)
    if eagle3:
        head_cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                        target_hidden_size=cfg.hidden_size, model_type="llama")
        ids = default_aux_layer_ids(cfg.num_hidden_layers)
        if ids is not None:
            head_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
        hot = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
        tensors["d2t"] = hot - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[hot] = True
        tensors["t2d"] = t2d
    else:
        tensors["embed_tokens.weight"] = model["model.embed_tokens.weight"].clone()
        if copy_layers:
            _derive(tensors, model, cfg, copy_layers)
    dtype = model["model.embed_tokens.weight"].dtype  # (the model's)
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(head_cfg, f, indent=2)
    for name in _COPIED:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(out_dir, name))
    return out_dir


def _derive(tensors: dict, model: dict, cfg, copy_layers: int) -> None:
    """The head's layer 0 an identity (zero outputs), `fc` the embedding alone, its layers
    1 .. N the model's 0 .. N - 1."""
    hidden = cfg.hidden_size
    fc = torch.zeros(hidden, 2 * hidden)
    fc[:, :hidden] = torch.eye(hidden)
    tensors["fc.weight"] = fc
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        tensors[name] = torch.zeros_like(tensors[name])
    for i in range(copy_layers):
        prefix = f"model.layers.{i}."
        for key, value in model.items():
            if key.startswith(prefix):
                tensors[f"layers.{i + 1}." + key[len(prefix):]] = value.float().clone()


def load_head(path: str) -> tuple[dict, object]:
    """(the head's tensors by checkpoint name, its config) as float64, for `head_forward`."""
    w = load_file(os.path.join(path, "model.safetensors"))
    w = {k: (v.double() if v.is_floating_point() else v) for k, v in w.items()}
    return w, AutoConfig.from_pretrained(path)
