"""Embedding models (SGLang's `--is-embedding`, vLLM's pooling runner): each request's prompt
runs through the model once and comes back as one vector pooled from the final hidden
states (after the model's last norm), L2-normalised as OpenAI's embeddings are.

Pooling (`pooling_type`, vLLM's names): "last" takes the last prompt token's state (decoder
embedding models: Qwen3-Embedding, gte-Qwen2, e5-mistral), "mean" averages every position,
"cls" takes the first. A prompt may be prefilled in several chunks: each chunk's forward
pools its own tokens (`pool_hidden`, called by the LogitsProcessor in place of the lm_head),
and `PooledState` adds the chunks up per request. "last" only reads the final chunk, so a
prefix-cache hit changes nothing and the radix cache stays on; "mean" and "cls" need the
states of every position, which a cached prefix never computes, so they run without it.

A sequence classifier (`*ForSequenceClassification`: cross-encoders, rerankers, reward and
sentiment models) is served the same way: its `score` head maps the pooled state to one
logit per label (engine/models/classification.py), and those logits come back raw (not
normalised); the router turns them into probabilities or relevance scores. Such a model is
always a pooling model (`resolve_model_kind`), as in SGLang and vLLM.

An embedding engine runs no decode step: every request asks for no new tokens
(`max_new_tokens` 0) and ends with its prefill. The overlap scheduler (which samples ahead)
and speculative decoding are off.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

POOLING_TYPES = ("last", "mean", "cls")


CLASSIFIER_SUFFIX = "ForSequenceClassification"


def classifier_labels(architecture: str, hf_config: Any) -> tuple[str, ...]:
    """A sequence classifier's label names by index (its config's `id2label`), () for a model
    of any other architecture."""
    if not architecture.endswith(CLASSIFIER_SUFFIX):
        return ()
    num = int(hf_config.num_labels)
    names = getattr(hf_config, "id2label", None) or {}
    return tuple(str(names.get(i, names.get(str(i), f"LABEL_{i}"))) for i in range(num))


def resolve_model_kind(args: Any, model_config: Any) -> Any:
    """`args` for the model. A sequence classifier (`labels`) or an encoder is served as a
    pooling model whether or not `is_embedding` was given (SGLang and vLLM decide by
    architecture). The pooling is `pooling_type` when given, else what the checkpoint's
    sentence-transformers config says (`sentence_pooling`), else "cls" for an encoder and
    "last" for a decoder; an encoder classifier's head reads its first token ("cls"). An
    encoder runs each prompt in one piece, without the radix cache (engine/models/bert.py);
    "mean" and "cls" pooling read every position of the prompt, which a cached prefix never
    computes: no radix cache either."""
    encoder, labels = model_config.is_encoder, model_config.labels
    if not (args.is_embedding or labels or encoder):  # a generative model
        return dataclasses.replace(args, pooling_type=args.pooling_type or "last")
    changes: dict[str, Any] = {"is_embedding": True}
    if not args.is_embedding:
        kind = f"a sequence classifier ({len(labels)} labels)" if labels else "an encoder"
        logger.info("%s: served as a pooling model", kind)
    pooling = args.pooling_type or sentence_pooling(model_config.path)
    pooling = changes["pooling_type"] = pooling or ("cls" if encoder else "last")
    if encoder and labels and pooling != "cls":
        raise ValueError(f"pooling_type: {pooling!r}; this classifier's head reads the first "
                         "token (cls)")  # fmt: skip
    if encoder and args.chunked_prefill_size != -1:
        logger.info("encoder: each prompt runs in one piece (no chunked prefill)")
        changes["chunked_prefill_size"] = -1
    if (encoder or pooling != "last") and not args.disable_radix_cache:
        why = "an encoder's" if encoder else f"{pooling} pooling reads every position:"
        logger.info("%s prefix states depend on the whole prompt: radix cache off", why)
        changes["disable_radix_cache"] = True
    return dataclasses.replace(args, **changes)


def sentence_pooling(path: str) -> str | None:
    """The pooling of a sentence-transformers checkpoint (its `modules.json` names a Pooling
    module whose config.json sets one `pooling_mode_*`), as vLLM reads it; None for a folder
    without one."""
    try:
        with open(os.path.join(path, "modules.json")) as f:
            modules = json.load(f)
    except (OSError, ValueError):
        return None
    folder = next((m.get("path", "") for m in modules if isinstance(m, dict)
                   and str(m.get("type", "")).endswith("Pooling")), None)  # fmt: skip
    if folder is None:
        return None
    try:
        with open(os.path.join(path, folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    modes = [m for m, on in config.items() if m.startswith("pooling_mode_") and on]
    for mode, name in _SENTENCE_POOLING.items():
        if mode in modes:
            return name
    if modes:
        raise ValueError(f"{path}: sentence-transformers pooling {modes} is not supported; "
                         f"pass --pooling-type, one of {POOLING_TYPES}")  # fmt: skip
    return None


# sentence-transformers' pooling modes -> ours
_SENTENCE_POOLING = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}


def check_embedding_args(args: Any) -> None:
    """Validate and normalise the embedding arguments of a (frozen) EngineArgs; the pooling
    (None: the model's) is resolved with the model (`resolve_model_kind`)."""
    if args.pooling_type is not None:
        pooling = str(args.pooling_type).lower()
        if pooling not in POOLING_TYPES:
            raise ValueError(f"pooling_type: {args.pooling_type!r} not in {POOLING_TYPES}")
        object.__setattr__(args, "pooling_type", pooling)
    if not args.is_embedding:
        return
    if args.speculative_algorithm is not None:
        raise ValueError("speculative decoding does not apply to an embedding model")
    if not args.disable_overlap_schedule:
        logger.info("embedding model: the overlap scheduler is off (no decode steps)")
        object.__setattr__(args, "disable_overlap_schedule", True)


def pool_hidden(hidden: torch.Tensor, fb: ForwardBatch, pooling: str) -> torch.Tensor:
    """Each request's share of an extend batch's final hidden states [num_tokens, hidden], as
    float32 [batch, hidden]: its last new token's state ("last"), the sum of its new tokens'
    states ("mean": divided by the prompt length once all chunks are in), or its first new
    token's ("cls": the prompt's first token in the request's first chunk)."""
    assert fb.forward_mode.is_extend(), "embedding models run extend batches only"
    if pooling == "last":
        return hidden.index_select(0, fb.last_token_indices).float()
    if pooling == "cls":
        assert fb.extend_start_loc is not None
        return hidden.index_select(0, fb.extend_start_loc).float()
    lens = fb.extend_seq_lens
    if lens is None:
        lens = torch.tensor(fb.extend_seq_lens_cpu, device=hidden.device)
    owner = torch.repeat_interleave(torch.arange(fb.batch_size, device=hidden.device), lens)
    sums = torch.zeros(fb.batch_size, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    return sums.index_add_(0, owner, hidden.float())


@dataclass
class EmbeddingBatchResult:
    """What an embedding model's forward returns: per request of the batch, its chunk's
    pooled states (see `pool_hidden`), float32 [batch, hidden] on the CPU."""

    pooled: torch.Tensor


class PooledState:
    """One request's embedding (or a classifier's logits) as its prompt's chunks come in."""

    def __init__(self, pooling: str, normalize: bool = True) -> None:
        self.pooling = pooling
        self.normalize = normalize
        self.value: torch.Tensor | None = None
        self.positions = 0

    def add(self, pooled: torch.Tensor, num_positions: int) -> None:
        """Take one chunk's pooled states (`num_positions` new tokens)."""
        if self.value is None or self.pooling == "last":
            self.value = pooled.clone()
        elif self.pooling == "mean":
            self.value += pooled
        self.positions += num_positions  # ("cls": the first chunk's stays)

    def embedding(self) -> torch.Tensor:
        """The request's embedding, normalised (float32 [hidden]); a classifier's logits as
        they are (float32 [num_labels])."""
        assert self.value is not None, "no chunk of the prompt has run"
        value = self.value / self.positions if self.pooling == "mean" else self.value
        return F.normalize(value, dim=-1) if self.normalize else value


def matryoshka_dimensions(hf_config: Any) -> list[int] | None:
    """The sizes a matryoshka model's embeddings may be truncated to (vLLM reads the same
    config fields): None for a model without matryoshka representations, [] for any size
    (`is_matryoshka` without `matryoshka_dimensions`)."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return sorted(int(d) for d in dims)
    return [] if getattr(hf_config, "is_matryoshka", False) else None


def embedding_bytes(embedding: torch.Tensor) -> bytes:
    """float32 little-endian bytes of an embedding (the wire format, and OpenAI's base64)."""
    return embedding.to(torch.float32).numpy().astype("<f4", copy=False).tobytes()
