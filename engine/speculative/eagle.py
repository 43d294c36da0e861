"""EAGLE speculative decoding (SGLang's `--speculative-algorithm EAGLE` / `EAGLE3`, vLLM's
`eagle` / `eagle3` methods): drafts from a small head that reads the model's hidden states
(engine/models/llama_eagle.py), chained greedily (SGLang's `--speculative-eagle-topk 1`) or as
a tree of its likeliest paths (topk > 1: engine/speculative/tree_draft.py,
engine/speculative/tree.py).

**The model's side.** Every forward of the model keeps the hidden states the head reads, one
row per token, in a buffer indexed by the token's KV slot (`HiddenCapture`): the final normed
hidden state for EAGLE (the lm_head's input, written by the logits processor), the residual
stream entering three layers for EAGLE-3 (written by the Llama model's layer loop). Indexing
by slot makes the rows live exactly as long as the token's K/V: a cached prefix brings its
rows along (a hidden state depends on the prefix only), chunked prefills and verify steps
write theirs as they run, rejected drafts' rows go with their slots, and CUDA graphs (decode
and verify) capture the writes with the rest of the forward. The cost is the buffer: the
model's KV slots x the hidden size (EAGLE) or three times it (EAGLE-3), in the model's dtype,
taken out of the KV budget on a GPU (`hidden_bytes_per_token`).

**The head's side** is the draft model's (engine/speculative/draft_model.py: its own runner,
K/V pool of page size 1, a row per request) with two differences:

* Its position p reads token p + 1 with the model's hidden state of position p, so the tokens
  it reads are the request's from its second on (`_draft_tokens`). A request of L tokens has
  model hidden states for positions 0 .. L - 2 (position L - 1 is the last token, which the
  next verify step runs), exactly the positions of the tokens the head reads.
* The K/V of its drafts came from its own hidden states, not the model's: it is never kept.
  Each step's catch-up reruns the positions from the last step's first draft on, with the
  model's hidden states of the tokens the model accepted (SGLang's draft extend after
  verify), and its outputs at each request's last position seed the decode forwards, whose
  hidden input is the previous forward's output.

With CUDA graphs the head's decode forwards replay its decode graphs and its catch-ups of
at most k + 1 tokens a request (every one after a request's first) its verify graphs of that
width (engine/speculative/verify_graphs.py), both with static hidden-state inputs and outputs
beside the ids. The model's own forwards, verify steps included, replay theirs, the
hidden-state writes with them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.speculative.draft_model import DraftModelDrafter, _positions
from engine.speculative.draft_runner import draft_args, draft_pool_tokens

if TYPE_CHECKING:
    from engine.config import EngineArgs, ModelConfig
    from engine.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

# the head's class for each algorithm: an EAGLE checkpoint's config says LlamaForCausalLM
_HEAD_ARCHITECTURES = {"eagle": "LlamaForCausalLMEagle", "eagle3": "LlamaForCausalLMEagle3"}


class HiddenCapture:
    """The model's hidden states the head reads, [KV slots, width], row = the token's slot;
    `layers`: EAGLE-3's captured layers (None: the final hidden state)."""

    def __init__(
        self,
        num_slots: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        layers: tuple[int, ...] | None = None,
    ) -> None:
        self.buffer = torch.zeros(num_slots, width, dtype=dtype, device=device)
        self.layers = layers

    def store(self, hidden: torch.Tensor, forward_batch: ForwardBatch) -> None:
        loc = forward_batch.out_cache_loc
        self.buffer.index_copy_(0, loc.to(torch.int64), hidden.to(self.buffer.dtype))

    def store_layers(self, states: list[torch.Tensor], forward_batch: ForwardBatch) -> None:
        self.store(torch.cat(states, dim=-1), forward_batch)

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        return self.buffer.index_select(0, slots.to(torch.int64))


def _draft_hf_config(args: EngineArgs):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(args.speculative_draft_model_path)


def head_model_config(args: EngineArgs, context_length: int | None = None) -> ModelConfig:
    """The head's ModelConfig: the class for the algorithm, or for EAGLE on a DeepSeek-V3 or
    GLM-4.5 checkpoint its multi-token-prediction layer's (engine/models/mtp.py: one layer,
    SGLang's NextN classes); ValueError for such a checkpoint without MTP layers."""
    from engine.config import ModelConfig
    from engine.models.mtp import NEXTN_ARCHITECTURES, has_mtp_layer

    path = args.speculative_draft_model_path
    config = ModelConfig.from_pretrained(path, context_length=context_length)
    arch, algo = config.architecture, args.speculative_algorithm
    nextn = NEXTN_ARCHITECTURES.get(arch, arch if arch in NEXTN_ARCHITECTURES.values() else None)
    if algo != "eagle" or nextn is None:
        return dataclasses.replace(config, architecture=_HEAD_ARCHITECTURES[algo])
    if not getattr(config.hf_config, "num_nextn_predict_layers", None) or not has_mtp_layer(path):
        raise ValueError(
            f"EAGLE: {path} is a {arch} checkpoint without a multi-token-prediction layer "
            "(num_nextn_predict_layers, and its tensors after the decoder's) to draft with"
        )
    return dataclasses.replace(
        config, architecture=nextn, num_layers=1, sliding_windows=config.sliding_windows[:1]
    )


def head_class(args: EngineArgs) -> type:
    from engine.models import get_model_class

    return get_model_class(head_model_config(args).architecture)


def head_memory(args: EngineArgs, dtype: torch.dtype, target: ModelConfig) -> tuple[int, int]:
    """What EAGLE adds to the draft's memory (`draft_runner.draft_memory`): (with tensor
    parallelism, rank 0's whole copy of the model's embedding and lm_head; the hidden states
    kept per KV slot of the model)."""
    per_token = head_class(args).hidden_width(target.hf_config) * dtype.itemsize
    copies = 0 if args.tp_size == 1 else 1 if target.tie_word_embeddings else 2
    rows = copies * target.vocab_size
    if args.speculative_token_map is not None:  # (its lm_head: a copy of the map's rows)
        rows += len(load_token_map(args.speculative_token_map, target.vocab_size))
    return rows * target.hidden_size * dtype.itemsize, per_token


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The token ids of an FR-Spec token map (SGLang's --speculative-token-map): a .pt file
    of a tensor or list of ids (torch.load, weights only), or a .json list; ValueError for
    anything else, or ids that are not distinct ids of the model's vocabulary."""
    import json
    import os

    if not os.path.isfile(path):
        raise ValueError(f"speculative_token_map: no file {path!r} (a local .pt or .json file)")
    try:
        if path.endswith(".json"):
            with open(path) as f:
                ids = torch.tensor(json.load(f), dtype=torch.int64)
        else:
            ids = torch.as_tensor(torch.load(path, weights_only=True)).to(torch.int64)
    except Exception as exc:  # (unpickling refused, JSON malformed, not a list of ids)
        raise ValueError(
            f"speculative_token_map {path!r}: not a list of token ids ({exc})"
        ) from exc
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"speculative_token_map {path!r}: a non-empty 1-D list of ids needed")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"speculative_token_map {path!r}: ids outside the model's vocabulary "
                         f"of {vocab_size}")  # fmt: skip
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"speculative_token_map {path!r}: repeated ids")
    return ids


def install_hidden_capture(runner: Any) -> HiddenCapture:
    """Make the model's forwards keep the hidden states the EAGLE head reads (before any CUDA
    graph is captured); ValueError where the model cannot give them."""
    from engine.models.deepseek import DeepseekModel
    from engine.models.llama import LlamaModel
    from engine.models.llama_eagle import eagle3_capture_layers

    args, model = runner.args, runner.model
    hf = runner.model_config.hf_config
    slots = runner.kv_pool.num_slots
    width = head_class(args).hidden_width(hf)
    if args.speculative_algorithm == "eagle":
        processor = getattr(model, "logits_processor", None)
        if processor is None or not hasattr(model, "lm_head_weight"):
            raise ValueError(f"EAGLE: {type(model).__name__} has no lm_head to draft over")
        capture = HiddenCapture(slots, width, runner.dtype, runner.device)
        processor.hidden_capture = capture
    else:
        inner = getattr(model, "model", None)
        if not isinstance(inner, LlamaModel | DeepseekModel):
            raise ValueError(
                f"EAGLE-3: the model must be of the Llama family (Llama, Qwen2/3, Mistral, "
                f"GLM-4.5, gpt-oss...) or DeepSeek's, not {type(model).__name__}"
            )
        layers = eagle3_capture_layers(hf, _draft_hf_config(args))
        capture = HiddenCapture(slots, width, runner.dtype, runner.device, layers)
        inner.aux_capture = capture
    logger.info(
        "%s: the model's hidden states kept per KV slot (%d x %d, %.1f MiB)",
        args.speculative_algorithm.upper(), slots, width,
        capture.buffer.numel() * capture.buffer.element_size() / 2**20,
    )  # fmt: skip
    return capture


def make_head_runner(args: EngineArgs, runner: Any) -> Any:
    """The head's ModelRunner: the draft model's arguments, the model's context length (head
    checkpoints often say 2048); its decode graphs are captured once it has the model's
    embedding (and lm_head)."""
    from engine.model_runner import ModelRunner

    path = args.speculative_draft_model_path
    config = head_model_config(args, runner.model_config.context_len)
    tokens = draft_pool_tokens(runner.max_total_tokens, args)
    head_args = dataclasses.replace(
        draft_args(args, tokens, runner.dtype),  # (a torch dtype: the model's, whatever it is)
        context_length=runner.model_config.context_len,
    )
    # (its catch-ups of at most k + 1 tokens a request, every one after a request's first,
    # replay verify graphs of that width: DraftModelDrafter._extend)
    width = args.speculative_num_draft_tokens + 1
    head = ModelRunner(config, dataclasses.replace(head_args, disable_cuda_graph=True),
                       verify_graph_width=width)  # fmt: skip
    if runner.tp.size > 1:  # (the model's rank holds part of them: whole ones from its files)
        head.model.share_tensors(*_whole_embedding_and_head(runner, head))
    else:
        head.model.share_from_target(runner.model)
    if args.speculative_token_map is not None:
        hot = load_token_map(args.speculative_token_map, runner.model_config.vocab_size)
        head.model.restrict_vocabulary(hot)
        logger.info("EAGLE head: drafts over %d tokens of the token map", hot.numel())
    head.args = head_args
    if head_args.use_cuda_graph and head.attn_backend.supports_cuda_graph:
        head.use_cuda_graph = True
        head.capture_cuda_graphs()
    logger.info(
        "%s head %s (%s): %d layer(s), KV pool of %d tokens",
        args.speculative_algorithm.upper(), path, config.architecture, config.num_layers, tokens,
    )  # fmt: skip
    return head


def _whole_embedding_and_head(runner: Any, head: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """With tensor parallelism (the head runs whole, on rank 0's device): the model's input
    embedding and lm_head read whole from its checkpoint (a tied model's head is its
    embedding), in the head's dtype on its device."""
    from engine.loader import iter_safetensors

    names = ("model.embed_tokens.weight", "lm_head.weight")
    found = dict(iter_safetensors(runner.model_config.path, names))
    embed, lm_head = (found.get(name) for name in names)
    if embed is None:
        raise ValueError(
            "EAGLE with tensor parallelism: the model's checkpoint has no "
            "model.embed_tokens.weight to give the head whole"
        )
    if lm_head is None or runner.model_config.tie_word_embeddings:
        lm_head = embed
    return (embed.to(head.device, head.dtype), lm_head.to(head.device, head.dtype))


class EagleDrafter(DraftModelDrafter):
    reuses_tail = False

    def __init__(self, args: EngineArgs, runner: Any, context_len: int) -> None:
        super().__init__(args, runner, context_len)
        self.capture: HiddenCapture = runner.hidden_capture
        self.target_req_to_token = runner.req_to_token_pool.req_to_token
        hot = getattr(self.runner.model, "hot_token_ids", None)
        # a smaller draft vocabulary (EAGLE-3's d2t, or an EAGLE head's token map): draft id
        # -> the model's id
        self.hot = None if hot is None else hot.to(self.runner.device)
        if self.hot is not None and int(self.hot.max()) >= runner.model_config.vocab_size:
            raise ValueError("EAGLE-3: the head's d2t maps past the model's vocabulary")
        self.vocab = runner.model_config.vocab_size  # (the biases are over the model's ids)
        if getattr(self.runner.model, "in_model_checkpoint", False):  # (an MTP layer)
            runner.weights_companion = self.runner
        self._last_hidden: dict[str, torch.Tensor] = {}

    def _make_runner(self, args: EngineArgs, runner: Any) -> Any:
        return make_head_runner(args, runner)

    def _draft_tokens(self, tokens: np.ndarray) -> np.ndarray:
        return tokens[1:]

    def propose(self, reqs):
        self._last_hidden.clear()
        try:
            return super().propose(reqs)
        finally:
            self._last_hidden.clear()

    def _extend_hidden(self, group: list) -> torch.Tensor:
        rows = [state.target_row for state, _, _, _ in group]
        starts = [start for _, _, start, _ in group]
        lens = [end - start for _, _, start, end in group]
        r, c = _positions(rows, starts, lens)
        table = self.target_req_to_token
        slots = table[r.to(table.device), c.to(table.device)]
        return self.capture.rows(slots)

    def _extended(self, group: list, fb: ForwardBatch) -> None:
        out = fb.spec_hidden_out.index_select(0, fb.last_token_indices)
        for k, (state, tokens, _, end) in enumerate(group):
            if end == len(tokens):  # (the request's last position: its decode's first input)
                self._last_hidden[state.rid] = out[k]

    def _first_hidden(self, states: list) -> torch.Tensor:
        return torch.stack([self._last_hidden[state.rid] for state in states])

    def _scores(self, logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.hot is None:
            return super()._scores(logits, bias)
        # (a graph replay's rows are as wide as the model's vocabulary: the draft's columns
        # come first, the rest were never written)
        logits = logits[:, : self.hot.shape[0]]
        return logits if bias is None else logits + self._draft_bias(bias)

    def _draft_bias(self, bias: torch.Tensor) -> torch.Tensor:
        # (the biases are over the model's ids: the draft vocabulary's columns of them)
        return bias if self.hot is None else bias[..., self.hot]

    def _token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        return columns if self.hot is None else self.hot[columns]
