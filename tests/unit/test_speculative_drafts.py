"""N-gram drafts, vLLM's --speculative-config, and giving back a rejected draft's pages."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine.mem_cache.allocator import TokenToKVPoolAllocator
from engine.mem_cache.memory_pool import ReqToTokenPool
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.pools import MemoryPools
from engine.scheduler.req import Req
from engine.speculative import from_vllm_config
from engine.speculative.ngram import propose_ngram, propose_ngram_tree
from engine.speculative.scheduling import trim_kv


def test_longest_then_latest_match_is_continued() -> None:
    # "5 6" occurs twice before the end; "4 5 6" once: the longest match wins
    tokens = [4, 5, 6, 7, 8, 1, 5, 6, 9, 9, 4, 5, 6]
    assert propose_ngram(tokens, 3, min_n=1, max_n=3) == [7, 8, 1]
    # with windows of at most 2 tokens, the latest "5 6" wins
    assert propose_ngram(tokens, 3, min_n=1, max_n=2) == [9, 9, 4]
    # the draft stops at k, and is cut by nothing else
    assert propose_ngram(tokens, 1, min_n=1, max_n=3) == [7]


def test_no_match_and_minimum_window() -> None:
    assert propose_ngram([1, 2, 3, 4], 4, min_n=1, max_n=3) == []
    # only the last token recurs: not enough for min_n 2
    assert propose_ngram([7, 1, 2, 7], 4, min_n=2, max_n=3) == []
    assert propose_ngram([7, 1, 2, 7], 2, min_n=1, max_n=3) == [1, 2]
    assert propose_ngram([], 4, min_n=1, max_n=3) == []
    assert propose_ngram([5], 4, min_n=1, max_n=3) == []


def test_a_loop_is_continued_past_the_end() -> None:
    # period 2: the match ends one token before the end, the draft repeats the loop
    assert propose_ngram([3, 1, 2, 1, 2, 1, 2], 5, min_n=2, max_n=4) == [1, 2, 1, 2, 1]
    assert propose_ngram([9, 9, 9], 4, min_n=1, max_n=4) == [9, 9, 9, 9]


def test_ngram_trees_merge_the_matches_continuations() -> None:
    """Trees (topk > 1): the continuations of the longest, then latest, matches, merged into
    a trie whose node parents come before them; within the node and depth budgets."""
    tokens = [4, 5, 6, 7, 8, 1, 5, 6, 9, 9, 4, 5, 6]
    # "4 5 6" (longest) continues 7 8 1; then the latest "5 6" continues 9 9 4
    drafts, parents = propose_ngram_tree(tokens, 6, 3, 2, min_n=1, max_n=3)
    assert (drafts, parents) == ([7, 8, 1, 9, 9, 4], [0, 1, 2, 0, 4, 5])
    # one branch is the chain's draft
    drafts, parents = propose_ngram_tree(tokens, 6, 3, 1, min_n=1, max_n=3)
    assert drafts == propose_ngram(tokens, 3, min_n=1, max_n=3) and parents == [0, 1, 2]
    # the node budget cuts the second branch; the depth cuts both
    assert propose_ngram_tree(tokens, 4, 3, 2, min_n=1, max_n=3) == ([7, 8, 1, 9], [0, 1, 2, 0])
    assert propose_ngram_tree(tokens, 6, 1, 2, min_n=1, max_n=3) == ([7, 9], [0, 0])
    # continuations that agree share their nodes: "1 2" is followed by 3 5 1 (latest) and
    # by 3 4 1
    drafts, parents = propose_ngram_tree([1, 2, 3, 4, 1, 2, 3, 5, 1, 2], 8, 3, 3, 2, 2)
    assert (drafts, parents) == ([3, 5, 1, 4, 1], [0, 1, 2, 1, 4])
    assert propose_ngram_tree([1, 2, 3], 4, 3, 2, min_n=1, max_n=3) == ([], [])


def test_counts_per_draft_position() -> None:
    """A step's accepted drafts are its first ones: each counts at its position (vLLM's
    num_accepted_tokens_per_pos); requests without drafts count nowhere."""
    from engine.config import EngineArgs
    from engine.speculative.scheduling import Drafter

    drafter = Drafter(EngineArgs("m", speculative_algorithm="ngram"), 100)
    drafter.count([3, 0, 2], [2, 0, 0])
    drafter.count([4, 1], [4, 1])
    s = drafter.stats
    assert (s.num_drafts, s.draft_tokens, s.accepted_tokens) == (4, 10, 7)
    assert s.accepted_per_pos == [3, 2, 1, 1]
    assert s.accept_length == 1 + 7 / 4


def test_vllm_config() -> None:
    assert from_vllm_config({"method": "ngram", "num_speculative_tokens": 5,
                             "prompt_lookup_max": 4}) == {  # fmt: skip
        "speculative_algorithm": "ngram",
        "speculative_num_draft_tokens": 5,
        "speculative_ngram_max_match_window_size": 4,
        "speculative_ngram_min_match_window_size": 4,
    }
    # a draft model: "draft_model" is the method where only the model is given
    for config in ({"model": "/m", "num_speculative_tokens": 3},
                   {"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}):
        assert from_vllm_config(config) == {  # fmt: skip
            "speculative_algorithm": "standalone",
            "speculative_draft_model_path": "/m",
            "speculative_num_draft_tokens": 3,
        }
    for bad, why in [
        ({"method": "eagle"}, "needs a draft 'model'"),
        ({"num_speculative_tokens": 3}, "not served"),
        ({"method": "ngram", "model": "x"}, "takes no draft 'model'"),
        ({"method": "medusa", "model": "x"}, "not served"),
        ({"model": "x", "draft_tensor_parallel_size": 1}, "unsupported keys"),
        ([1], "JSON object"),
    ]:
        with pytest.raises(ValueError, match=why):
            from_vllm_config(bad)


def test_cli_flags() -> None:
    from services.engine_args import add_engine_args
    from services.serve import engine_flags

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--speculative-config", '{"method": "NGRAM", "prompt_lookup_min": 1}'])
    assert ns.speculative_algorithm == "NGRAM" and ns.speculative_ngram_min_match_window_size == 1
    # the worker gets the SGLang-named flags
    assert engine_flags(ns) == ["--speculative-algorithm", "NGRAM",
                                "--speculative-ngram-min-match-window-size", "1"]  # fmt: skip
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{not json"])
    ns = parser.parse_args(["--speculative-config", '{"model": "/d", "num_speculative_tokens": 2}'])
    assert engine_flags(ns) == ["--speculative-algorithm", "standalone",
                                "--speculative-draft-model-path", "/d",
                                "--speculative-num-draft-tokens", "2"]  # fmt: skip
    ns = parser.parse_args(["--speculative-algorithm", "DRAFT_MODEL",
                            "--speculative-draft-model-path", "/d"])  # fmt: skip
    assert ns.speculative_algorithm == "draft_model" and ns.speculative_draft_model_path == "/d"


@pytest.mark.parametrize("page_size", [1, 4])
def test_trim_gives_back_whole_pages_after_the_kept_length(page_size: int) -> None:
    allocator = TokenToKVPoolAllocator(64, page_size)
    rows = ReqToTokenPool(4, 32, "cpu")
    pools = MemoryPools(rows, allocator, None, page_size)
    req = Req("r", [1, 2, 3], SamplingParams())
    req.req_pool_idx = rows.alloc(1)[0]
    slots = pools.alloc_kv([0], [11], [-1])
    rows.req_to_token[req.req_pool_idx, :11] = slots.to(torch.int32)
    req.kv_allocated_len = 11
    free_before = allocator.available_size()
    trimmed = trim_kv(pools, req, 6)
    assert trimmed is not None and trimmed[1] == 0  # (no window released: all live)
    gone = trimmed[0]
    assert req.kv_allocated_len == 6
    kept_pages = -(-6 // page_size)
    # the pages of positions 0..5 stay; the rest of the 11 positions' pages are returned
    want = -(-11 // page_size) - kept_pages
    assert len(torch.unique(gone.long() // page_size)) == want
    allocator.free(gone.long())
    assert allocator.available_size() == free_before + want * page_size
    assert bool(allocator.is_allocated(slots[:6]).all())
    assert trim_kv(pools, req, 6) is None  # nothing more to give back


def test_the_drafters_token_copy_follows_the_output() -> None:
    from engine.speculative.scheduling import token_array

    req = Req("r", list(range(100, 150)), SamplingParams())
    assert token_array(req).tolist() == req.all_ids()
    for step in range(40):  # grows past its first capacity (2 x 50)
        req.output_ids.extend([step] * (1 + step % 3))
        assert token_array(req).tolist() == req.all_ids()
