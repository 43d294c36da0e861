"""Draft trees from a draft model or an EAGLE head (`--speculative-eagle-topk` > 1; the tree's
layout and verification: engine/speculative/tree.py): the methods `DraftModelDrafter`
(engine/speculative/draft_model.py) drafts trees with, after its catch-up."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.speculative.tree import select_nodes


class TreeDrafting:
    """`_decode_tree` for a drafter with `topk`, `runner`, `memory_drops`, `_top` (each row's
    topk tokens and log-probabilities) and `_first_hidden` (`DraftModelDrafter`)."""

    topk: int
    runner: Any
    memory_drops: int

    def _decode_tree(
        self,
        todo: list,
        logits: torch.Tensor,
        bias: torch.Tensor | None,
        limits: dict[int, tuple[int, int]],
        drafts: list[list[int]],
        parents: list[list[int]],
    ) -> None:
        """Draft trees (SGLang's EAGLE with topk > 1): the `topk` best first tokens of each
        request (from `logits`, its catch-up's) are its first leaves; each further forward
        feeds every request's `topk` leaves at once (topk rows a request, each attending to
        the request's K/V and its own ancestors), and of the topk x topk children the `topk`
        whose paths are likeliest (summed log-probabilities) become the next leaves. Every
        leaf and child is a candidate; the request's tree is its best candidates
        (`tree.select_nodes`), within its depth and node limits (`limits`). The candidates
        stay on the device until the last forward (one host read); the leaves' K/V lives in
        slots of this step only, given back at the end."""
        k, n = self.topk, len(todo)
        runner = self.runner
        first_tokens, first_scores = self._top(logits, bias)  # [n, k]
        first_tokens = first_tokens.to(torch.int64)
        cand_tokens, cand_scores = [first_tokens], [first_scores]
        cand_parents = [torch.full_like(first_tokens, -1)]
        forwards = max(limits[i][0] for i, _, _, _ in todo) - 1
        slots = None
        if forwards > 0:
            slots = runner.allocator.alloc_extend([0], [forwards * n * k], None)
            if slots is None:  # (the pool leaves room for them: only when it is exhausted)
                self.memory_drops += n
                forwards = 0
        if forwards > 0:
            self._tree_forwards(todo, forwards, slots, bias, cand_tokens, cand_scores,
                                cand_parents)  # fmt: skip
            runner.allocator.free(slots)
        ids = torch.cat([torch.cat(cand_tokens, 1), torch.cat(cand_parents, 1)], 1).cpu()
        scores = torch.cat(cand_scores, 1).cpu().numpy()
        num = scores.shape[1]
        ids_np = ids.numpy()
        tokens, cand_parent = ids_np[:, :num], ids_np[:, num:]
        depth = np.concatenate([np.ones(k, dtype=np.int64)]
                               + [np.full(k * k, d + 2, dtype=np.int64)
                                  for d in range(forwards)])  # fmt: skip
        for b, (i, _, _, _) in enumerate(todo):
            max_depth, max_nodes = limits[i]
            usable = (depth <= max_depth) & np.isfinite(scores[b])
            chosen = select_nodes(scores[b], cand_parent[b], depth, max_nodes, usable)
            node = {c: j for j, c in enumerate(chosen, start=1)}
            drafts[i] = [int(tokens[b, c]) for c in chosen]
            parents[i] = [node.get(int(cand_parent[b, c]), 0) for c in chosen]

    def _tree_forwards(
        self,
        todo: list,
        forwards: int,
        slots: torch.Tensor,
        bias: torch.Tensor | None,
        cand_tokens: list[torch.Tensor],
        cand_scores: list[torch.Tensor],
        cand_parents: list[torch.Tensor],
    ) -> None:
        """`_decode_tree`'s forwards, appending each one's children to the candidates. Row
        b * topk + j of a forward is leaf j of request b. Its page table is a row of the
        draft's own `req_to_token` (topk rows a request kept for leaves: `draft_rows`, so
        that the forwards replay the draft's decode graphs): the request's row up to its
        caught-up tokens, then the slots of the leaf's ancestors and its own, reordered with
        the leaves after each forward (a leaf's prefix is its request's: only the ancestors'
        columns move)."""
        k, n = self.topk, len(todo)
        runner = self.runner
        pool = runner.req_to_token_pool
        dev = slots.device
        states = [state for _, _, _, state in todo]
        seen = np.asarray([len(tokens) for _, tokens, _, _ in todo], dtype=np.int64)
        own_table = pool.req_to_token
        width = min(int(seen.max()) + forwards, own_table.shape[1])
        own_rows = torch.tensor([st.row for st in states], dtype=torch.int64)
        prefixes = own_table[own_rows.to(own_table.device), :width].repeat_interleave(k, 0)
        rows = pool.alloc(n * k)
        try:
            if rows is not None:  # rows of the draft's own table: its graphs replay
                table = own_table
                leaves = torch.tensor(rows, dtype=torch.int64).to(table.device)
                table[leaves, :width] = prefixes
            else:  # (more leaves than rows kept for them: a table of their own, eager)
                table = prefixes.contiguous()
                leaves = torch.arange(n * k, device=table.device)
            hidden = self._first_hidden(states)
            if hidden is not None:
                hidden = hidden.repeat_interleave(k, 0)
            row_bias = None if bias is None else bias.repeat_interleave(k, 0)
            leaf_tokens = cand_tokens[0].reshape(-1)
            leaf_scores, leaf_cand = cand_scores[0], torch.arange(k, device=dev).expand(n, k)
            base = torch.from_numpy(np.repeat(seen - 1, k)).to(table.device)
            steps = torch.arange(1, forwards + 1, device=table.device)
            for step in range(1, forwards + 1):
                own = slots[(step - 1) * n * k : step * n * k]
                positions = base + step  # (a leaf of depth `step` at the head's position)
                table[leaves, positions] = own.to(table.dtype)
                fb = ForwardBatch(
                    forward_mode=ForwardMode.DECODE, batch_size=n * k, input_ids=leaf_tokens,
                    positions=positions, out_cache_loc=own, req_pool_indices=leaves,
                    seq_lens=positions + 1, seq_lens_cpu=np.repeat(seen + step, k).tolist(),
                    req_to_token=table, kv_pool=runner.kv_pool,
                    attn_backend=runner.attn_backend, spec_hidden=hidden,
                )  # fmt: skip
                child_tokens, child_logp = self._top(runner.forward(fb), row_bias)  # [n k, k]
                child_tokens = child_tokens.to(torch.int64)
                child_scores = (leaf_scores.reshape(-1, 1) + child_logp).view(n, k * k)
                offset = k + (step - 1) * k * k
                cand_tokens.append(child_tokens.view(n, k * k))
                cand_scores.append(child_scores)
                cand_parents.append(leaf_cand.repeat_interleave(k, 1))
                if step == forwards:
                    break
                leaf_scores, best = child_scores.topk(k, dim=-1)  # [n, k]
                leaf_tokens = child_tokens.view(n, k * k).gather(1, best).reshape(-1)
                leaf_cand = offset + best
                parent_rows = (torch.arange(n, device=dev)[:, None] * k + best // k).reshape(-1)
                cols = base[:, None] + steps[None, :step]  # the ancestors' columns (and own)
                parent_rows = parent_rows.to(table.device)
                table[leaves[:, None], cols] = table[leaves[parent_rows][:, None], cols]
                if hidden is not None:
                    hidden = fb.spec_hidden_out.index_select(0, parent_rows.to(dev))
        finally:
            if rows is not None:
                pool.free(rows)
