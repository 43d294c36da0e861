"""Draft trees (SGLang's `--speculative-eagle-topk` > 1): a request's drafts are the nodes of a
tree rooted at its last token instead of a chain.

A verify step runs the request's last token and its n draft nodes as one extend of 1 + n
tokens, in the order the drafter gives them: node j (1 <= j <= n) has a parent `parents[j - 1]`
< j (0: the last token), so that every node comes after its ancestors. Node j sits at position
kv + depth(j), sees the request's cached tokens and its ancestors (itself included: the
ancestor mask, `ancestor_mask`), and its K/V goes to the slot allocated for position kv + j.

The model samples a token at every node, as the request's token would be sampled after the
node's path (engine/speculative/verify.py). From the root, the step follows the child whose
draft equals the token sampled at the current node, while there is one (`accept_path`): the
tokens are those sampled along the path. Children of a node have distinct drafts, so at most
one matches; as for a chain, outputs are distributed as without drafts.

The accepted nodes' K/V (and an EAGLE model's kept hidden states) are then moved to the slots
of positions kv + 1, kv + 2, ... (`path_moves`), so that the request's K/V is contiguous again
and the rest is given back as for a chain.

A chain of k drafts is the tree whose parents are 0, 1, ..., k - 1.
"""

from __future__ import annotations

import numpy as np


def chain_parents(k: int) -> list[int]:
    return list(range(k))


def depths(parents: list[int]) -> list[int]:
    """Depth of every verify position (0: the request's last token)."""
    out = [0]
    for j, p in enumerate(parents, start=1):
        if not 0 <= p < j:
            raise ValueError(f"draft tree: node {j}'s parent {p} does not come before it")
        out.append(out[p] + 1)
    return out


def ancestor_mask(parents: list[int]) -> np.ndarray:
    """[1 + n, 1 + n] bool: row j sees column m iff m is j or one of its ancestors."""
    n = len(parents) + 1
    mask = np.zeros((n, n), dtype=bool)
    mask[0, 0] = True
    for j, p in enumerate(parents, start=1):
        mask[j] = mask[p]
        mask[j, j] = True
    return mask


def node_paths(parents: list[int]) -> list[list[int]]:
    """Per verify position, the nodes from the root's first child down to it ([] for the
    root)."""
    paths: list[list[int]] = [[]]
    for j, p in enumerate(parents, start=1):
        paths.append(paths[p] + [j])
    return paths


def accept_path(sampled: list[int], drafts: list[int], parents: list[int]) -> list[int]:
    """The accepted nodes, from the root down: `sampled[j]` is the token sampled at verify
    position j, `drafts[j - 1]` node j's draft."""
    children: dict[int, dict[int, int]] = {}
    for j, (p, d) in enumerate(zip(parents, drafts, strict=True), start=1):
        children.setdefault(p, {}).setdefault(d, j)
    path, node = [], 0
    while True:
        nxt = children.get(node, {}).get(sampled[node])
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt


def path_moves(path: list[int]) -> list[tuple[int, int]]:
    """(from verify position, to verify position) of the accepted nodes' K/V: the d-th node
    of the path goes to position d (those already there stay)."""
    return [(j, d) for d, j in enumerate(path, start=1) if j != d]


def select_nodes(
    scores: np.ndarray,
    parents: np.ndarray,
    depth: np.ndarray,
    n: int,
    usable: np.ndarray | None = None,
) -> list[int]:
    """The `n` best candidate nodes (cumulative log-probabilities `scores`; a candidate's
    `parents` index another candidate, or is -1 under the root), closed under parents: a
    child's score is at most its parent's, and ties go to the shallower node, so a node's
    parent is chosen before it. Only `usable` candidates are chosen (default: all).
    Returned in (depth, candidate) order, parents first."""
    order = np.lexsort((np.arange(len(scores)), depth, -scores))
    chosen: set[int] = set()
    for c in order.tolist():  # (a node whose parent was passed over is passed over too:
        if len(chosen) == n:  # only float rounding could order a child first)
            break
        p = int(parents[c])
        if (usable is None or usable[c]) and (p < 0 or p in chosen):
            chosen.add(c)
    return sorted(chosen, key=lambda c: (int(depth[c]), c))


def packed_masks(parents: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Every request's `ancestor_mask` flattened row-major into one uint8 array, and where
    each starts (the Triton extend kernel's tree mask)."""
    masks = [ancestor_mask(ps).reshape(-1) for ps in parents]
    sizes = np.asarray([m.size for m in masks], dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    return np.concatenate(masks).astype(np.uint8), starts
