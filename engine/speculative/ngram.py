"""N-gram drafts: guess a request's next tokens from its own text (vLLM's `ngram` method,
"prompt lookup decoding"; SGLang's NGRAM algorithm draws from a cache shared by requests).

The last n tokens of the request (prompt + output) are looked up earlier in the same tokens,
n from `max_n` down to `min_n`; at the latest place where the longest of them occurs, the
tokens that followed it there are the draft. A copy goes on through its own draft: when the
match ends near the end (a loop of period p < k), the draft repeats the loop. Costs one
vectorised pass over the tokens per request and step; nothing is kept between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens to follow `tokens` ([] when the last `min_n` tokens occur
    nowhere earlier)."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    # candidate ends e <= length - 2 of an earlier occurrence: arr[e] is the last token
    ends = np.flatnonzero(arr[: length - 1] == arr[length - 1])
    if ends.size == 0:
        return []
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
    best = int(matched.max())
    if best < min_n:
        return []
    start = int(ends[np.flatnonzero(matched == best)[-1]]) + 1  # the latest longest match
    draft: list[int] = []
    for j in range(k):
        i = start + j
        draft.append(int(arr[i]) if i < length else draft[i - length])
    return draft
