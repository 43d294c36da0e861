"""Speculative decoding: n-gram drafts verified by the model in one forward (see
scheduling.py for the scheduler's side, verify.py for the model runner's)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

SPECULATIVE_ALGORITHMS = ("ngram",)


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
    if args.hybrid_swa_memory:
        raise ValueError("speculative decoding does not run with hybrid_swa_memory yet")
    if not args.disable_overlap_schedule:
        logger.info("speculative decoding: the overlap scheduler is off")
        object.__setattr__(args, "disable_overlap_schedule", True)
