"""Speculative decoding: n-gram drafts verified by the model in one forward (see
scheduling.py for the scheduler's side, verify.py for the model runner's)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

SPECULATIVE_ALGORITHMS = ("ngram",)
# vLLM's --speculative-config keys -> EngineArgs fields
_VLLM_KEYS = {
    "method": "speculative_algorithm",
    "num_speculative_tokens": "speculative_num_draft_tokens",
    "prompt_lookup_min": "speculative_ngram_min_match_window_size",
    "prompt_lookup_max": "speculative_ngram_max_match_window_size",
}


def from_vllm_config(config: dict[str, Any]) -> dict[str, Any]:
    """EngineArgs fields from vLLM's `speculative_config` ({"method": "ngram",
    "num_speculative_tokens": 5, "prompt_lookup_max": 4, ...}); ValueError for keys or
    methods not served here. As in vLLM, a missing prompt_lookup_min is prompt_lookup_max."""
    if not isinstance(config, dict):
        raise ValueError("speculative config must be a JSON object")
    unknown = sorted(set(config) - set(_VLLM_KEYS))
    if unknown:
        raise ValueError(f"speculative config: unsupported keys {unknown} (known: "
                         f"{sorted(_VLLM_KEYS)})")  # fmt: skip
    method = config.get("method")
    if not isinstance(method, str) or method.lower() not in SPECULATIVE_ALGORITHMS:
        raise ValueError(
            f"speculative config: method {method!r} not served (one of: "
            f"{', '.join(SPECULATIVE_ALGORITHMS)})"
        )
    if "prompt_lookup_max" in config and "prompt_lookup_min" not in config:
        config = {**config, "prompt_lookup_min": config["prompt_lookup_max"]}
    return {_VLLM_KEYS[k]: v for k, v in config.items()}


def check_speculative_args(args: Any) -> None:
    """Validate and normalise the speculative arguments of a (frozen) EngineArgs. A verify step
    needs the accepted tokens before the next batch is planned: the overlap scheduler is
    turned off (as SGLang's first speculative versions did)."""
    algo = args.speculative_algorithm
    if algo is None:
        return
    algo = algo.lower()
    if algo not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"speculative_algorithm: {algo!r} not in {SPECULATIVE_ALGORITHMS}")
    object.__setattr__(args, "speculative_algorithm", algo)
    lo = args.speculative_ngram_min_match_window_size
    hi = args.speculative_ngram_max_match_window_size
    if args.speculative_num_draft_tokens < 1:
        raise ValueError("speculative_num_draft_tokens must be >= 1")
    if not 1 <= lo <= hi:
        raise ValueError(
            "speculative n-gram windows need 1 <= min <= max, got "
            f"min {lo}, max {hi}"
        )
    if not args.disable_overlap_schedule:
        logger.info("speculative decoding: the overlap scheduler is off")
        object.__setattr__(args, "disable_overlap_schedule", True)
