"""N-gram drafts: guess a request's next tokens from its own text (vLLM's `ngram` method,
"prompt lookup decoding"; SGLang's NGRAM algorithm draws from a cache shared by requests).

The last n tokens of the request (prompt + output) are looked up earlier in the same tokens,
n from `max_n` down to `min_n`; at the latest place where the longest of them occurs, the
tokens that followed it there are the draft. A copy goes on through its own draft: when the
match ends near the end (a loop of period p < k), the draft repeats the loop. Costs one
vectorised pass over the tokens per request and step; nothing is kept between steps. With
draft trees (topk > 1) the continuations of several matches are merged into one tree
(`propose_ngram_tree`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _matches(arr: np.ndarray, min_n: int, max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """(ends, lengths): every earlier place e whose last n tokens (n = lengths[i], at least
    min_n, at most max_n) equal the request's last n; e is the index of the last of them."""
    length = len(arr)
    empty = np.zeros(0, dtype=np.int64)
    if length < min_n + 1:
        return empty, empty
    # candidate ends e <= length - 2 of an earlier occurrence: arr[e] is the last token
    ends = np.flatnonzero(arr[: length - 1] == arr[length - 1])
    if ends.size == 0:
        return empty, empty
    matched = np.ones(ends.size, dtype=np.int64)  # n-gram length matched at each end so far
    alive = np.ones(ends.size, dtype=bool)
    for m in range(1, max_n):
        back = ends - m
        ok = alive & (back >= 0)
        ok[ok] = arr[back[ok]] == arr[length - 1 - m]
        if not ok.any():
            break
        matched[ok] += 1
        alive = ok
    keep = matched >= min_n
    return ends[keep], matched[keep]


def _continuation(arr: np.ndarray, start: int, k: int) -> list[int]:
    """The `k` tokens from `start` on (a copy that reaches the end goes on through itself)."""
    length = len(arr)
    draft: list[int] = []
    for j in range(k):
        i = start + j
        draft.append(int(arr[i]) if i < length else draft[i - length])
    return draft


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens to follow `tokens` ([] when the last `min_n` tokens occur
    nowhere earlier)."""
    if k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    ends, matched = _matches(arr, min_n, max_n)
    if ends.size == 0:
        return []
    best = int(matched.max())
    start = int(ends[np.flatnonzero(matched == best)[-1]]) + 1  # the latest longest match
    return _continuation(arr, start, k)


def propose_ngram_tree(
    tokens: Sequence[int], nodes: int, depth: int, branches: int, min_n: int, max_n: int
) -> tuple[list[int], list[int]]:
    """A draft tree (engine/speculative/tree.py) of at most `nodes` nodes and `depth` levels:
    the continuations of up to `branches` earlier matches of the request's last tokens,
    longest match first, then latest, merged where they agree (a trie, SGLang's n-gram
    drafts' shape). (drafts, parents), parents before their children."""
    if nodes <= 0 or depth <= 0:
        return [], []
    arr = np.asarray(tokens, dtype=np.int64)
    ends, matched = _matches(arr, min_n, max_n)
    if ends.size == 0:
        return [], []
    order = np.lexsort((-ends, -matched))[:branches]  # longest, then latest
    drafts: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (node, token) -> child node (0: the root)
    for c in order.tolist():
        node = 0
        for token in _continuation(arr, int(ends[c]) + 1, depth):
            child = children.get((node, token))
            if child is None:
                if len(drafts) == nodes:
                    break
                drafts.append(token)
                parents.append(node)
                child = children[(node, token)] = len(drafts)
            node = child
    return drafts, parents
