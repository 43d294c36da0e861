"""EAGLE draft heads over a Llama-family model (SGLang's `--speculative-algorithm EAGLE` and
`EAGLE3`, vLLM's `eagle` and `eagle3` methods), in their checkpoints' formats.

A head drafts from the model's hidden states as well as its tokens. At draft position p it
reads the embedding of token p + 1 and a hidden state of position p: the model's (captured
by its forward, engine/speculative/eagle.py) for the positions the model has run, its own
output at p - 1 for the positions after (its drafts). Its logits at p give token p + 2.

* **EAGLE (1 and 2)**: `fc` ([embedding; the model's final normed hidden] -> hidden), then
  the head's decoder layers, the first without its input norm, and no final norm; the
  logits are the model's lm_head over the last layer's residual stream (`hidden +
  residual`), which is also the head's output hidden. Checkpoints store `fc.*`, `layers.*`
  (and maybe `embed_tokens.weight`) without the `model.` prefix.
* **EAGLE-3**: `fc` maps three of the model's hidden states (the residual stream entering
  layers 2, L // 2 and L - 3, or the config's `eagle_config.eagle_aux_hidden_state_layer_ids`
  + 1) to one; its one decoder layer (`midlayer`) attends over [input_layernorm(embedding);
  hidden_norm(hidden)] (q/k/v of twice the hidden size) with that hidden as its residual;
  a final norm, and a lm_head of its own over a smaller vocabulary (`draft_vocab_size`) whose
  ids map to the model's as `id + d2t[id]`. The output hidden is the residual stream before
  the final norm. A config without `draft_vocab_size` uses the model's lm_head.

Both heads take the model's input embedding, as SGLang does (the checkpoint's copy, if any,
is skipped), and the EAGLE head the model's lm_head: `share_from_target` sets them after
loading, as references (not parameters of the head); with tensor parallelism, whose ranks
hold parts of them, `share_tensors` takes whole copies read from the model's checkpoint.

The forward reads the hidden states from `forward_batch.spec_hidden` ([tokens, width]) and
leaves the head's output hidden in `forward_batch.spec_hidden_out` ([tokens, hidden]).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import MergedLinear
from engine.layers.logits import LogitsProcessor
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.loader import load_named_weights
from engine.models.llama import STACKED_WEIGHTS, LlamaDecoderLayer, LlamaForCausalLM


def eagle3_capture_layers(target_config, draft_config) -> tuple[int, ...]:
    """The model's layers whose input residual stream EAGLE-3 reads (a layer index equal to
    the number of layers: the stream after the last layer, before the final norm)."""
    num = target_config.num_hidden_layers
    eagle = getattr(draft_config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    layers = tuple(i + 1 for i in ids) if ids else (2, num // 2, num - 3)
    if len(set(layers)) != 3 or not all(0 <= i <= num for i in layers):
        raise ValueError(
            f"EAGLE-3: the model has {num} layers: no three distinct hidden states of layers "
            f"{list(layers)} (set eagle_config.eagle_aux_hidden_state_layer_ids in the draft's "
            "config)"
        )
    return tuple(sorted(layers))  # (concatenated in the model's layer order)


class _HeadBase(nn.Module):
    """What both heads share: the model's embedding (and maybe lm_head) by reference, the
    checkpoint's names mapped under `model.`, logits over the (draft) vocabulary."""

    load_stacked = STACKED_WEIGHTS
    uses_target_head = True

    def __init__(self, config, max_position: int | None) -> None:
        nn.Module.__init__(self)  # (not the model family's class, mixed in after: mtp.py)
        self.config = config
        self.max_position = max(max_position or 0, config.max_position_embeddings)
        self.context_len = max_position or config.max_position_embeddings
        # the width of the hidden states a decode forward reads (its own output's): the
        # static input of its CUDA graphs (engine/cuda_graph_runner.py)
        self.decode_hidden_width = config.hidden_size
        # and a catch-up forward (the model's states: its verify-shaped graphs' input)
        self.catchup_hidden_width = type(self).hidden_width(config)
        # (plain attributes, not submodules: the model's, set by share_from_target)
        self.__dict__["_embed"] = None
        self.__dict__["_target_head"] = None
        # a draft vocabulary (EAGLE-3's d2t, or a token map: `restrict_vocabulary`): draft id
        # -> the model's id; None: the model's ids
        self.hot_token_ids: torch.Tensor | None = None

    def _rotary(self) -> RotaryEmbedding:
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return RotaryEmbedding(
            head_dim, self.max_position, rope_parameters(c), context_len=self.context_len
        )

    def share_from_target(self, target: nn.Module) -> None:
        """Take the model's input embedding (and lm_head where the head has none)."""
        embed = getattr(getattr(target, "model", None), "embed_tokens", None)
        if embed is None or not hasattr(target, "lm_head_weight"):
            raise ValueError(f"EAGLE: {type(target).__name__} has no embed_tokens / lm_head")
        self._check_width(embed.weight)
        self.__dict__["_embed"] = embed
        if self.uses_target_head:
            self.__dict__["_target_head"] = target.lm_head_weight

    def share_tensors(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        """The model's input embedding and lm_head as whole tensors (with tensor parallelism
        its modules hold one rank's part)."""
        self._check_width(embed)
        self.__dict__["_embed"] = nn.Embedding.from_pretrained(embed, freeze=True)
        if self.uses_target_head:
            self.__dict__["_target_head"] = lm_head

    def _check_width(self, embed: torch.Tensor) -> None:
        if embed.shape[1] != self.config.hidden_size:
            raise ValueError(
                f"EAGLE: the draft's hidden size {self.config.hidden_size} is not the model's "
                f"embedding width {embed.shape[1]}"
            )

    @property
    def lm_head_weight(self) -> torch.Tensor | None:
        if self.uses_target_head:
            return self._target_head
        return self.lm_head.weight

    def restrict_vocabulary(self, hot: torch.Tensor) -> None:
        """Draft over the model's tokens `hot` only (SGLang's --speculative-token-map, FR-Spec):
        the lm_head is those rows of the model's (a copy), the logits one column each."""
        head = self._target_head
        assert head is not None, "share the model's lm_head first"
        hot = hot.to(head.device)
        self.__dict__["_target_head"] = head.index_select(0, hot).contiguous()
        self.logits_processor = LogitsProcessor(int(hot.shape[0]))
        self.hot_token_ids = hot

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self._embed is not None, "share_from_target first"
        return self._embed(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden_in = forward_batch.spec_hidden
        if hidden_in is None:
            raise ValueError("an EAGLE head's forward needs forward_batch.spec_hidden")
        to_logits, to_next = self.run(input_ids, positions, hidden_in, forward_batch)
        forward_batch.spec_hidden_out = to_next
        return self.logits_processor(to_logits, self.lm_head_weight, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def transform(name: str, tensor: torch.Tensor):
            name = name.removeprefix("model.")
            if name.startswith("embed_tokens.") or "rotary_emb.inv_freq" in name:
                return None  # the model's embedding is used (as in SGLang)
            if name.startswith("lm_head."):
                return None if self.uses_target_head else (name, tensor)
            if name in ("d2t", "t2d"):
                return self._vocab_map(name, tensor)
            return "model." + name, tensor

        return load_named_weights(self, weights, stacked=self.load_stacked, transform=transform)

    def _vocab_map(self, name: str, tensor: torch.Tensor) -> None:
        return None


class _EagleFirstLayer(LlamaDecoderLayer):
    """EAGLE's first decoder layer: no input norm (its input is `fc`'s output)."""

    def __init__(self, config, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_id, rotary, LlamaForCausalLM)
        del self.input_layernorm
        self.input_layernorm = nn.Identity()

    def _norm_in_gemv(self, proj: nn.Module | None, hidden: torch.Tensor) -> bool:
        # (the fused norm-in-GEMV path has a norm to apply: not for the identity)
        return proj is not self.self_attn.qkv_proj and super()._norm_in_gemv(proj, hidden)


class _EagleModel(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=bool(getattr(config, "bias", False)))
        self.layers = nn.ModuleList(
            _EagleFirstLayer(config, 0, rotary) if i == 0
            else LlamaDecoderLayer(config, i, rotary, LlamaForCausalLM)
            for i in range(config.num_hidden_layers)
        )  # fmt: skip


class LlamaForCausalLMEagle(_HeadBase):
    """EAGLE 1/2 head (SGLang's class of that name)."""

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__(config, max_position)
        self.model = _EagleModel(config, self._rotary())
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @staticmethod
    def hidden_width(target_config) -> int:
        """The width of the model's hidden states the head reads a position."""
        return target_config.hidden_size

    def run(self, input_ids, positions, hidden_in, forward_batch):
        embeds = self.embed(input_ids)
        hidden = self.model.fc(torch.cat([embeds, hidden_in.to(embeds.dtype)], dim=-1))
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        out = hidden + residual
        return out, out


class _Eagle3MidLayer(LlamaDecoderLayer):
    def __init__(self, config, rotary: RotaryEmbedding) -> None:
        super().__init__(config, 0, rotary, LlamaForCausalLM)
        attn = self.self_attn
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        bias = LlamaForCausalLM.attention_biases(config)[0]
        # q/k/v over [normed embedding; normed hidden]
        attn.qkv_proj = MergedLinear(
            2 * config.hidden_size, [("q", q), ("k", kv), ("v", kv)], bias=bias
        )
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, embeds, hidden, forward_batch):
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn = self.self_attn(positions, x, forward_batch)
        attn, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(attn), residual


class _Eagle3Model(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or hidden
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=bool(getattr(config, "bias", False)))
        self.midlayer = _Eagle3MidLayer(config, rotary)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)


class LlamaForCausalLMEagle3(_HeadBase):
    """EAGLE-3 head (SGLang's class of that name)."""

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__(config, max_position)
        if int(getattr(config, "num_hidden_layers", 1)) != 1:
            raise ValueError("EAGLE-3: a head of one decoder layer (num_hidden_layers 1)")
        self.model = _Eagle3Model(config, self._rotary())
        draft_vocab = getattr(config, "draft_vocab_size", None)
        self.uses_target_head = draft_vocab is None
        vocab = config.vocab_size if draft_vocab is None else int(draft_vocab)
        if not self.uses_target_head:
            self.lm_head = nn.Linear(config.hidden_size, vocab, bias=False)
        self.logits_processor = LogitsProcessor(vocab)

    @staticmethod
    def hidden_width(target_config) -> int:
        """(given the head's own config: its `target_hidden_size`, the model's width)"""
        hidden = getattr(target_config, "target_hidden_size", None) or target_config.hidden_size
        return 3 * hidden

    def _vocab_map(self, name: str, tensor: torch.Tensor) -> None:
        if name == "d2t":  # (t2d, the reverse, is not needed)
            ids = tensor.to(torch.int64) + torch.arange(tensor.shape[0], dtype=torch.int64)
            self.hot_token_ids = ids
        return None

    def run(self, input_ids, positions, hidden_in, forward_batch):
        embeds = self.embed(input_ids)
        hidden = hidden_in.to(embeds.dtype)
        if hidden.shape[-1] != embeds.shape[-1]:  # the model's three states: first step
            hidden = self.model.fc(hidden)
        out, residual = self.model.midlayer(positions, embeds, hidden, forward_batch)
        to_logits, to_next = self.model.norm(out, residual)
        return to_logits, to_next
