"""Speculative decoding: drafts (n-gram lookups, a smaller draft model's or an EAGLE head's
greedy tokens; chains, or trees: tree.py) verified by the model in one forward (see
scheduling.py for the scheduler's side, draft_model.py for the draft model, eagle.py for
EAGLE heads, verify.py for the model runner's side)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# "standalone" (SGLang's name; vLLM's method "draft_model"): a separate, smaller model of the
# same vocabulary drafts greedily (engine/speculative/draft_model.py); "eagle" / "eagle3": an
# EAGLE head reading the model's hidden states (engine/speculative/eagle.py)
SPECULATIVE_ALGORITHMS = ("ngram", "standalone", "eagle", "eagle3")
# the algorithms that draft with the model at speculative_draft_model_path
DRAFT_MODEL_ALGORITHMS = ("standalone", "eagle", "eagle3")
EAGLE_ALGORITHMS = ("eagle", "eagle3")  # (the model keeps hidden states for the head)
# (SGLang's NEXTN, and vLLM's MTP methods: an EAGLE head made of the model's own
# multi-token-prediction layer, engine/models/mtp.py)
_ALIASES = {"draft_model": "standalone", "nextn": "eagle", "mtp": "eagle",
            "deepseek_mtp": "eagle", "glm4_moe_mtp": "eagle"}  # fmt: skip
SPECULATIVE_ALGORITHM_NAMES = SPECULATIVE_ALGORITHMS + tuple(_ALIASES)  # (what flags accept)
# vLLM's --speculative-config keys -> EngineArgs fields
_VLLM_KEYS = {
    "method": "speculative_algorithm",
    "model": "speculative_draft_model_path",
    "num_speculative_tokens": "speculative_num_draft_tokens",
    "prompt_lookup_min": "speculative_ngram_min_match_window_size",
    "prompt_lookup_max": "speculative_ngram_max_match_window_size",
}


def from_vllm_config(config: dict[str, Any]) -> dict[str, Any]:
    """EngineArgs fields from vLLM's `speculative_config` ({"method": "ngram",
    "num_speculative_tokens": 5, "prompt_lookup_max": 4, ...}, or {"model": DIR,
    "num_speculative_tokens": 4} for a draft model); ValueError for keys or methods not
    served here. As in vLLM, a missing prompt_lookup_min is prompt_lookup_max, a config
    with a `model` but no `method` is a draft model's, and the MTP methods ("mtp",
    "deepseek_mtp", "glm4_moe_mtp") draft with the model's own MTP layers (EAGLE)."""
    if not isinstance(config, dict):
        raise ValueError("speculative config must be a JSON object")
    unknown = sorted(set(config) - set(_VLLM_KEYS))
    if unknown:
        raise ValueError(f"speculative config: unsupported keys {unknown} (known: "
                         f"{sorted(_VLLM_KEYS)})")  # fmt: skip
    method = config.get("method", "draft_model" if "model" in config else None)
    mtp = isinstance(method, str) and method.lower() in _MTP_METHODS
    if mtp and "model" in config:
        raise ValueError(f"speculative config: method {method!r} drafts with the model's own "
                         "MTP layers: no 'model'")  # fmt: skip
    if isinstance(method, str) and method.lower() in _ALIASES:
        method = _ALIASES[method.lower()]
    if not isinstance(method, str) or method.lower() not in SPECULATIVE_ALGORITHMS:
        raise ValueError(
            f"speculative config: method {method!r} not served (one of: "
            f"{', '.join(SPECULATIVE_ALGORITHMS)}, draft_model)"
        )
    if "model" in config and method.lower() not in DRAFT_MODEL_ALGORITHMS:
        raise ValueError(f"speculative config: method {method!r} takes no draft 'model'")
    if "model" not in config and method.lower() in DRAFT_MODEL_ALGORITHMS and not mtp:
        raise ValueError(f"speculative config: method {method!r} needs a draft 'model'")
    config = {**config, "method": method}
    if "prompt_lookup_max" in config and "prompt_lookup_min" not in config:
        config = {**config, "prompt_lookup_min": config["prompt_lookup_max"]}
    return {_VLLM_KEYS[k]: v for k, v in config.items()}


_MTP_METHODS = ("mtp", "deepseek_mtp", "glm4_moe_mtp")


def mtp_draft_path(model_path: str) -> str | None:
    """The model's own folder where its checkpoint has multi-token-prediction layers an MTP
    head is made of (its config's `num_nextn_predict_layers`, an architecture of
    engine/models/mtp.py): SGLang's default draft model for EAGLE on DeepSeek-V3 or GLM-4.5."""
    import json
    import os

    from engine.models.mtp import NEXTN_ARCHITECTURES, has_mtp_layer

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    arch = (config.get("architectures") or [""])[0]
    declared = int(config.get("num_nextn_predict_layers") or 0) > 0
    mtp = arch in NEXTN_ARCHITECTURES and declared and has_mtp_layer(model_path)
    return model_path if mtp else None


def check_speculative_args(args: Any) -> None:
    """Validate and normalise the speculative arguments of a (frozen) EngineArgs. A verify step
    needs the accepted tokens before the next batch is planned: the overlap scheduler is
    turned off (as SGLang's first speculative versions did)."""
    algo = args.speculative_algorithm
    draft = args.speculative_draft_model_path
    if algo is None:
        if draft is not None:
            raise ValueError(
                "speculative_draft_model_path needs speculative_algorithm 'standalone', "
                "'eagle' or 'eagle3'"
            )
        return
    algo = _ALIASES.get(algo.lower(), algo.lower())
    if algo not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"speculative_algorithm: {algo!r} not in {SPECULATIVE_ALGORITHMS}")
    object.__setattr__(args, "speculative_algorithm", algo)
    if algo == "eagle" and draft is None:  # (a model with MTP layers drafts with them)
        draft = mtp_draft_path(args.model_path)
        object.__setattr__(args, "speculative_draft_model_path", draft)
    if (algo in DRAFT_MODEL_ALGORITHMS) != (draft is not None):
        raise ValueError(
            f"speculative_algorithm {algo!r} needs speculative_draft_model_path (the draft "
            "model's folder; EAGLE on a model with MTP layers, DeepSeek-V3 or GLM-4.5, "
            "drafts with them)" if draft is None
            else f"speculative_draft_model_path is for {DRAFT_MODEL_ALGORITHMS}, not {algo!r}"
        )
    lo = args.speculative_ngram_min_match_window_size
    hi = args.speculative_ngram_max_match_window_size
    if args.speculative_num_draft_tokens < 1:
        raise ValueError("speculative_num_draft_tokens must be >= 1")
    _check_tree_args(args, algo)
    if args.speculative_token_map is not None and algo != "eagle":
        raise ValueError(
            "speculative_token_map is for speculative_algorithm 'eagle' (an EAGLE-3 head "
            f"maps its own draft vocabulary with d2t), not {algo!r}"
        )
    if not 1 <= lo <= hi:
        raise ValueError(
            "speculative n-gram windows need 1 <= min <= max, got "
            f"min {lo}, max {hi}"
        )
    if not args.disable_overlap_schedule:
        logger.info("speculative decoding: the overlap scheduler is off")
        object.__setattr__(args, "disable_overlap_schedule", True)


def _check_tree_args(args: Any, algo: str) -> None:
    """topk and steps: a chain of num_draft_tokens drafts (topk 1), or a tree of that many
    nodes (engine/speculative/tree.py), whose steps default to num_draft_tokens // topk."""
    n, topk, steps = (args.speculative_num_draft_tokens, args.speculative_eagle_topk,
                      args.speculative_num_steps)  # fmt: skip
    if topk < 1:
        raise ValueError("speculative_eagle_topk must be >= 1")
    if topk == 1:
        if steps is not None and steps == n - 1:  # SGLang's count (the last token in it)
            logger.info("speculative: %d steps of topk 1 with %d draft tokens (SGLang's "
                        "count): a chain of %d drafts", steps, n, steps)  # fmt: skip
            object.__setattr__(args, "speculative_num_draft_tokens", steps)
        elif steps is not None and steps != n:
            raise ValueError(
                f"speculative_num_steps {steps} with speculative_eagle_topk 1: a chain of "
                f"speculative_num_draft_tokens ({n}) drafts takes {n} steps (here the draft "
                "tokens exclude the last token; SGLang's count, steps + 1, is taken too)"
            )
        object.__setattr__(args, "speculative_num_steps", args.speculative_num_draft_tokens)
        return
    steps = max(1, n // topk) if steps is None else steps
    if not 1 <= steps <= n:
        raise ValueError(f"speculative_num_steps must be in 1..{n} (the tree's nodes)")
    # (a draft model keeps topk leaves of topk children each per forward; n-gram trees are
    # topk matches' continuations)
    candidates = topk * steps if algo == "ngram" else topk + (steps - 1) * topk * topk
    if n > candidates:
        raise ValueError(
            f"a draft tree of {steps} steps with topk {topk} has {candidates} candidate "
            f"nodes, fewer than speculative_num_draft_tokens ({n})"
        )
    object.__setattr__(args, "speculative_num_steps", steps)
