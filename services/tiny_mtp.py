"""Multi-token-prediction layers for a tiny DeepSeek-V3 or GLM-4.5 model folder, in the
published checkpoints' layout (speculative decoding with the model's own MTP layer:
engine/models/mtp.py), and a reference of the layer's forward built on transformers' own
decoder layer.

    sluice make-tiny-model DIR --arch deepseek_v3 --mtp-layers 1 [--mtp-derived]

The layer is stored as `model.layers.{num_hidden_layers}.*` beside the model's (`enorm`,
`hnorm`, `eh_proj`, `shared_head.norm`, `shared_head.head` and `embed_tokens` copies of the
model's lm_head and embedding, and a decoder layer whose feed-forward is the experts), and
the config says `num_nextn_predict_layers`. Two kinds:

* random (the default): the decoder layer of a one-layer random model of the same config
  (transformers' init, shaped as make-tiny-model shapes it), random enorm / hnorm / eh_proj:
  for the engine's correctness, whatever it drafts;
* derived (`--mtp-derived`): the model made nearly a bigram model (every attention and
  feed-forward output scaled so that they add DERIVED_RATIO of the embeddings to the residual
  stream, so each position's token is mostly decided by its input token's embedding through
  the final norm and the lm_head), and an MTP layer that computes
  the same from the next token (eh_proj takes the normed embedding only, shared_head.norm is
  the model's final norm, its decoder layer's outputs scaled alike): it drafts the model's
  next token but one, and most drafts are accepted. The model's text then is a walk of its
  bigram function, which is what the speed benchmarks need.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from safetensors.torch import load_file, save_file

# the families with MTP layers (make-tiny-model's --arch) -> the engine's head class
MTP_ARCHS = ("deepseek_v3", "glm4_moe")
# a derived model's layers add this much to the residual stream, relative to the embeddings
# (their attention and feed-forward outputs scaled to it: `_derived_scale`; at 0.08 the
# tiny and small models' tokens are their bigram function's at about 0.85 of positions)
DERIVED_RATIO = 0.08
_SCALED = (".o_proj.", "down_proj")  # the outputs that reach the residual stream


def add_mtp_layer(
    model_dir: str, derived: bool = False, seed: int = 0, random_layer: bool = False
) -> str:
    """Write one MTP layer into `model_dir`'s checkpoint and config (derived: and scale the
    model's layers, see the module's docstring; with `random_layer` the layer stays random
    over the derived model: a floor beside it); returns `model_dir`."""
    from services.tiny_model import NORM_JITTER

    config_path = os.path.join(model_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("model_type") not in MTP_ARCHS:
        raise ValueError(f"MTP layers are for {MTP_ARCHS}, not {config.get('model_type')!r}")
    file = os.path.join(model_dir, "model.safetensors")
    weights = load_file(file)
    hidden, index = config["hidden_size"], config["num_hidden_layers"]
    if any(name.startswith(f"model.layers.{index}.") for name in weights):
        raise ValueError(f"{model_dir} already has MTP layers")
    layer = _random_layer(config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dtype = weights["model.embed_tokens.weight"].dtype

    def jitter() -> torch.Tensor:
        return 1.0 + NORM_JITTER * (2 * torch.rand(hidden, generator=gen) - 1)

    embed = weights["model.embed_tokens.weight"]
    own = {
        "embed_tokens.weight": embed.clone(),
        "shared_head.head.weight": weights.get("lm_head.weight", embed).clone(),
        "enorm.weight": jitter(),
        "hnorm.weight": jitter(),
        "eh_proj.weight": 0.02 * torch.randn(hidden, 2 * hidden, generator=gen),
        "shared_head.norm.weight": layer.pop("norm.weight"),
    }
    scale = _derived_scale(model_dir) if derived else 1.0
    if derived:
        for name in weights:
            if name.startswith("model.layers.") and any(s in name for s in _SCALED):
                weights[name] = weights[name] * scale
    if derived and not random_layer:
        for name in layer:
            if any(s in name for s in _SCALED):
                layer[name] = layer[name] * scale
        own["enorm.weight"] = torch.ones(hidden)
        own["eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
        own["shared_head.norm.weight"] = weights["model.norm.weight"].clone()
    prefix = f"model.layers.{index}."
    for name, tensor in {**layer, **own}.items():
        weights[prefix + name] = tensor.to(dtype).contiguous()
    save_file(weights, file, metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return model_dir


def _derived_scale(model_dir: str) -> float:
    """The factor on the layers' outputs that makes what they add to the residual stream
    DERIVED_RATIO of the embeddings (measured with transformers over random tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=gen)
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    # (transformers' last state is after the final norm: the stream entering the last layer,
    # and what the layers before it added, times L / (L - 1))
    layers = model.config.num_hidden_layers
    if layers < 2:
        raise ValueError("a derived MTP model needs two layers or more")
    embeds = states[0]
    added = (states[-2] - embeds).pow(2).mean().sqrt() * layers / (layers - 1)
    return float(DERIVED_RATIO * embeds.pow(2).mean().sqrt() / added)


def _random_layer(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of a one-layer random model of `config` whose layer has the
    experts (its names under `model.layers.0.` without that prefix, and its final norm's as
    `norm.weight`: the gain that sizes the logits, for shared_head.norm)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.tiny_model import _shape_weights

    one = {**config, "num_hidden_layers": 1, "first_k_dense_replace": 0}
    one.pop("num_nextn_predict_layers", None)
    hf = AutoConfig.for_model(**one)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7)
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
        _shape_weights(model)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)  # (the checkpoint's names)
        saved = load_file(os.path.join(tmp, "model.safetensors"))
    out = {n.removeprefix("model.layers.0."): t for n, t in saved.items()
           if n.startswith("model.layers.0.")}  # fmt: skip
    out["norm.weight"] = saved["model.norm.weight"]
    return out


class MtpReference(torch.nn.Module):
    """The MTP layer of a folder's checkpoint, computed by transformers: its decoder layer
    is transformers' (a one-layer model of the family, loaded by transformers from the
    layer's tensors, whose final norm is shared_head.norm and lm_head shared_head.head, fed
    `eh_proj([enorm(embedding); hnorm(hidden)])` as its input embeddings), around it plain
    torch. `forward(ids, hidden)` over one sequence from position 0 -> (logits [T, V], the
    output hidden state [T, H])."""

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        prefix = f"model.layers.{config.num_hidden_layers}."
        w = {n.removeprefix(prefix): t for n, t in _load(model_dir).items()
             if n.startswith(prefix)}  # fmt: skip
        one = {**config.to_dict(), "num_hidden_layers": 1, "first_k_dense_replace": 0,
               "num_nextn_predict_layers": 0, "tie_word_embeddings": False}  # fmt: skip
        state = {"model.norm.weight": w["shared_head.norm.weight"],
                 "model.embed_tokens.weight": w["embed_tokens.weight"],
                 "lm_head.weight": w["shared_head.head.weight"],
                 **{"model.layers.0." + n: t for n, t in w.items() if not n.startswith(_OWN)}}
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(one, f)
            save_file({n: t.contiguous() for n, t in state.items()},
                      os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            # (eager experts: transformers' default grouped_mm has no float64)
            self.model = AutoModelForCausalLM.from_pretrained(
                tmp, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
            ).eval()
        self.w = {n: w[n].to(dtype) for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                               "embed_tokens.weight")}  # fmt: skip
        self.eps = config.rms_norm_eps

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor):
        w = self.w
        e = _rms(w["embed_tokens.weight"][ids], w["enorm.weight"], self.eps)
        h = _rms(hidden.to(e.dtype), w["hnorm.weight"], self.eps)
        x = torch.cat([e, h], -1) @ w["eh_proj.weight"].T
        out = self.model.model(inputs_embeds=x[None]).last_hidden_state[0]
        return self.model.lm_head(out), out


_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


def _load(model_dir: str) -> dict[str, torch.Tensor]:
    from engine.loader import iter_safetensors

    return dict(iter_safetensors(model_dir))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
