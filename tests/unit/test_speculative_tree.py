"""Draft trees (engine/speculative/tree.py): the tree's layout, the path a verify step
accepts, the nodes a drafter keeps, and the attention backends' tree masks against the
per-request reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.attention.base import create_attention_backend
from engine.forward_batch import ForwardMode
from engine.mem_cache.kv_pool import KVPool
from engine.speculative.tree import (
    accept_path,
    ancestor_mask,
    chain_parents,
    depths,
    node_paths,
    packed_masks,
    path_moves,
    select_nodes,
)
from kernels.reference import extend_attention_ref
from kernels.testing import make_paged_case
from tests.factories import paged_case_batch

# root 0; nodes 1, 2 under it; 3 under 1; 4 under 2; 5 under 3
PARENTS = [0, 0, 1, 2, 3]


def test_layout_of_a_tree() -> None:
    assert depths(PARENTS) == [0, 1, 1, 2, 2, 3]
    assert node_paths(PARENTS) == [[], [1], [2], [1, 3], [2, 4], [1, 3, 5]]
    mask = ancestor_mask(PARENTS)
    assert mask.tolist()[5] == [True, True, False, True, False, True]
    assert mask.tolist()[4] == [True, False, True, False, True, False]
    assert (mask == np.tril(mask)).all()  # (ancestors come first)
    assert ancestor_mask(chain_parents(3)).tolist() == np.tril(np.ones((4, 4), bool)).tolist()
    with pytest.raises(ValueError, match="does not come before"):
        depths([0, 2])
    masks, starts = packed_masks([PARENTS, []])
    assert starts.tolist() == [0, 36] and masks.dtype == np.uint8
    assert masks[:36].reshape(6, 6).astype(bool).tolist() == mask.tolist()
    assert masks[36:].tolist() == [1]


def test_the_accepted_path_follows_the_sampled_tokens() -> None:
    drafts = [10, 20, 11, 21, 12]  # (node j's draft: drafts[j - 1])
    # sampled at each verify position 0..5
    assert accept_path([20, 0, 21, 0, 99, 0], drafts, PARENTS) == [2, 4]
    assert accept_path([10, 11, 0, 12, 0, 7], drafts, PARENTS) == [1, 3, 5]
    assert accept_path([30, 0, 0, 0, 0, 0], drafts, PARENTS) == []
    assert path_moves([2, 4]) == [(2, 1), (4, 2)]
    assert path_moves([1, 3, 5]) == [(3, 2), (5, 3)]
    assert path_moves([1, 2]) == []  # (a chain's accepted drafts are in place)


def test_selected_nodes_are_the_best_and_closed_under_parents() -> None:
    #            0     1     2     3     4     5
    scores = np.array([-0.1, -0.5, -0.3, -0.2, -0.9, -0.6])
    parents = np.array([-1, -1, 0, 0, 1, 2])
    depth = np.array([1, 1, 2, 2, 2, 3])
    assert select_nodes(scores, parents, depth, 3) == [0, 2, 3]
    assert select_nodes(scores, parents, depth, 5) == [0, 1, 2, 3, 5]
    # a tie goes to the shallower node; an unusable node and its subtree are passed over
    tie = np.array([-0.1, -0.5, -0.5, -0.2, -0.9, -0.6])
    assert select_nodes(tie, parents, depth, 3) == [0, 1, 3]
    usable = np.array([True, True, False, True, True, True])
    assert select_nodes(scores, parents, depth, 4, usable) == [0, 1, 3, 4]
    # a child ranked before its parent (rounding) is passed over
    odd = np.array([-0.3, -0.5, -0.2, -0.4, -0.9, -0.6])
    assert select_nodes(odd, parents, depth, 2) == [0, 3]


class _Layer:
    layer_id = 0
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    scaling = 32**-0.5


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window"])
@pytest.mark.parametrize("backend_name", ["torch_native", "triton"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_backends_tree_masks_match_the_reference(
    backend_name: str, page_size: int, window: int | None
) -> None:
    """A verify batch of trees, a chain and a request without drafts (torch_native plans its
    one token as a decode row): each node sees the request's cached keys and its ancestors;
    in a sliding-window layer only those within the window of its position (the prefix
    length plus its depth). (Triton under the interpreter.)"""
    gen = torch.Generator().manual_seed(5)
    parents = [PARENTS, chain_parents(3), [],
               [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, 12)]]
    case = make_paged_case([9, 20, 4, 13], [len(p) + 1 for p in parents], 4, 2, 32, page_size,
                           seed=7)  # fmt: skip
    pool = KVPool(case.k_buffer.shape[0], 1, 2, 32, torch.float32, "cpu", page_size=page_size)
    pool.k_buffer[0].copy_(case.k_buffer)
    pool.v_buffer[0].copy_(case.v_buffer)
    backend = create_attention_backend(backend_name, device="cpu", kv_pool=pool)
    fb = paged_case_batch(case, ForwardMode.EXTEND, pool, backend)
    fb.spec_parents = parents
    fb.positions = torch.tensor([n + d for n, p in zip([9, 20, 4, 13], parents)
                                 for d in depths(p)])  # fmt: skip
    backend.init_forward_metadata(fb)
    q, k, v = (x.reshape(x.shape[0], -1) for x in (case.q, case.k, case.v))
    layer = _Layer()
    layer.sliding_window = window
    got = backend.forward(q, k, v, layer, fb).view_as(case.q)
    case.store_new_kv()
    args = (case.q, case.k, case.v, case.k_buffer, case.v_buffer, case.req_to_token,
            case.req_pool_indices, case.prefix_lens, case.extend_lens, case.extend_start_loc,
            case.scale)  # fmt: skip
    left = -1 if window is None else window - 1
    masks = [torch.from_numpy(ancestor_mask(p)) for p in parents]
    want = extend_attention_ref(*args, window_left=left, tree_masks=masks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    causal = extend_attention_ref(*args, window_left=left)
    assert (causal - want).abs().max() > 1e-2  # (the mask matters)
    if window is not None:  # (and the window)
        assert (extend_attention_ref(*args, tree_masks=masks) - want).abs().max() > 1e-2
