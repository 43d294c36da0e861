"""Drafts from a smaller model of the same vocabulary (SGLang's STANDALONE speculative
algorithm, vLLM's `draft_model` method).

The draft model runs on its own `ModelRunner` (engine/model_runner.py: the same loader,
attention backends and CUDA graphs as the model), with its own KV pool of page size 1 and a
row of its own `req_to_token` per request that has drafts. Each decode step of the scheduler:

1. **Catch up.** The draft's K/V of a request covers the positions it has seen: its tokens up
   to the previous step, then the drafts it made then (`_Draft`). The drafts the model
   accepted are the request's tokens now, so the draft's K/V is kept up to the first
   position where the request's tokens and what the draft saw differ, and the rest is given
   back. One extend forward (a prompt longer than a prefill chunk: several) runs every
   request's tokens from there to its last, whose logits give its first draft.
2. **Draft.** Decode forwards feed each request's previous draft; the greedy argmax of each
   (within the request's allowed_token_ids, after its logit_bias) is the next draft, until
   the request has `room` drafts (`Drafter.room`, at most `speculative_num_draft_tokens`).
   The drafts stay on the device from one forward to the next and are read once, after the
   last (`_decode`): the host prepares the next forward while the device runs this one.

With `--speculative-eagle-topk` > 1 the drafts are a tree instead (`_decode_tree`:
engine/speculative/tree_draft.py): each draft forward feeds every request's topk likeliest leaves,
whose K/V lives for the step only, and the likeliest of all candidates are verified.

With CUDA graphs the draft's decode forwards replay its decode graphs, and its catch-up
extends of at most k + 1 tokens a request (every one after a request's first) replay its
verify graphs of that width (engine/speculative/verify_graphs.py; every position's logits,
of which each request's last is read).

The model then verifies every request's drafts in one forward (engine/speculative/verify.py);
sampling at each position and accepting while the draft equals the sampled token keeps
outputs distributed as without drafts, whatever the draft model is (greedy and seeded
requests give the same tokens). So a draft model that agrees with the model pays: accept
lengths near k + 1 for k small forwards of the draft (one extend, k - 1 decodes) and one
of the model.

Memory: the draft's pool holds as many tokens as the model's, plus `k` per running request
(its last drafts); on a GPU the model's KV budget (`mem_fraction_static`) leaves room for the
draft's weights and that pool (`draft_memory`: engine/speculative/draft_runner.py, with the
draft's runner and arguments). A request whose draft K/V does not fit gets no
drafts that step, and its draft K/V is given back (it catches up later, when there is room).
Requests that leave the batch (finished, retracted) give theirs back. When the scheduler
gives its memory back while idle (`/release_memory_occupation`), the draft's goes too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.speculative.draft_runner import make_draft_runner
from engine.speculative.scheduling import Drafter, token_array
from engine.speculative.tree_draft import TreeDrafting

if TYPE_CHECKING:
    from engine.config import EngineArgs
    from engine.scheduler.req import Req

logger = logging.getLogger(__name__)

DEFAULT_DRAFT_CHUNK = 8192  # tokens per catch-up forward without a prefill chunk size


@dataclass
class _Draft:
    """The draft model's K/V of one request: positions 0 .. `length` - 1 in row `row` of its
    `req_to_token`; the first `confirmed` are the request's own tokens, the rest (`tail`) the
    tokens the draft fed after them (its last drafts), which the model may have rejected."""

    rid: str
    row: int
    length: int = 0
    confirmed: int = 0
    tail: list[int] = field(default_factory=list)
    # the request's row of the model's req_to_token (EAGLE reads the model's hidden states
    # of its positions through it; set each step)
    target_row: int = -1
    # the request's fixed constraints on its tokens as an additive bias [vocab] (its
    # allowed_token_ids, its logit_bias; None without): its drafts obey them too
    bias: torch.Tensor | None = None


class DraftModelDrafter(TreeDrafting, Drafter):
    # whether the K/V of the drafts the model accepted is kept (an EAGLE head's is not: it
    # was computed from its own hidden states, not the model's)
    reuses_tail = True

    def __init__(self, args: EngineArgs, runner: Any, context_len: int) -> None:
        super().__init__(args, context_len)
        self.runner = self._make_runner(args, runner)
        draft, target = self.runner.model_config, runner.model_config
        if draft.vocab_size != target.vocab_size:
            logger.warning(
                "draft model: vocabulary of %d, the model's %d: drafts come from the first %d",
                draft.vocab_size, target.vocab_size, min(draft.vocab_size, target.vocab_size),
            )  # fmt: skip
        self.vocab = min(draft.vocab_size, target.vocab_size)
        self.draft_context = draft.context_len
        chunk = args.chunked_prefill_size
        self.chunk = chunk if chunk is not None and chunk > 0 else DEFAULT_DRAFT_CHUNK
        self.drafts: dict[str, _Draft] = {}
        self.memory_drops = 0  # requests that got no drafts: their draft K/V did not fit
        # requests whose allowed tokens the draft cannot draft at all (none in its
        # vocabulary): they get no drafts, which would all be rejected
        self.undraftable: set[str] = set()
        # draft trees (engine/speculative/tree.py): tokens kept per forward, forwards a step
        self.topk = args.speculative_eagle_topk
        self.steps = args.speculative_num_steps or self.k

    # -- the scheduler's calls ------------------------------------------------------------------
    def room(self, r: Req) -> int:
        # the draft feeds its drafts but the last at positions seqlen .. seqlen + room - 2
        return max(0, min(super().room(r), self.draft_context - r.seqlen + 1))

    def propose(self, reqs: list[Req]) -> list[list[int]]:
        live = {r.rid for r in reqs}
        for rid in [rid for rid in self.drafts if rid not in live]:  # finished, retracted
            self._drop(rid)
        self.undraftable &= live
        tree = self.topk > 1
        todo = []  # (batch index, request's tokens, room, its draft state)
        limits = {}  # a tree's: batch index -> (its depth, its nodes) at most
        for i, r in enumerate(reqs):
            room = self.room(r) if r.rid not in self.undraftable else 0
            if room:
                tokens = self._draft_tokens(token_array(r))
                state = self._sync(r, tokens)
                if state is not None:  # (a tree's nodes have K/V of the step only)
                    todo.append((i, tokens, 1 if tree else room, state))
                    if tree:
                        limits[i] = (min(room, self.steps), self.tree_nodes(r))
        todo = self._allocate(todo)
        drafts: list[list[int]] = [[] for _ in reqs]
        if not todo:
            return drafts
        logits = self._catch_up(todo)
        bias = self._stacked_bias([state for _, _, _, state in todo], logits)
        if tree:
            self.last_parents = [[] for _ in reqs]
            self._decode_tree(todo, logits, bias, limits, drafts, self.last_parents)
        else:
            self._decode(todo, self._greedy(logits, bias), drafts)
        for i, tokens, room, state in todo:
            state.confirmed = len(tokens)
            state.tail = [] if tree else drafts[i][: room - 1]
            state.length = state.confirmed + len(state.tail)
        return drafts

    def _make_runner(self, args: EngineArgs, runner: Any) -> Any:
        return make_draft_runner(args, runner)

    def _draft_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """The tokens the draft reads, at positions 0, 1, ... (an EAGLE head: the request's
        from its second on, each beside the model's hidden state of the position before)."""
        return tokens

    def forget(self, req: Req) -> None:
        self.undraftable.discard(req.rid)
        if req.rid in self.drafts:
            self._drop(req.rid)

    def close(self) -> None:
        self._drop_all()
        self.runner.release_memory()

    def release_memory_occupation(self, tags: tuple[str, ...], backup_weights: bool) -> int:
        if "kv_cache" in tags:  # (requests retracted meanwhile may still hold draft K/V)
            self._drop_all()
        return self.runner.release_memory_occupation(tags, backup_weights)

    def resume_memory_occupation(self, tags: tuple[str, ...]) -> int:
        return self.runner.resume_memory_occupation(tags)

    def _drop_all(self) -> None:
        for rid in list(self.drafts):
            self._drop(rid)

    # -- the draft's K/V ------------------------------------------------------------------------
    def _sync(self, r: Req, tokens: np.ndarray) -> _Draft | None:
        """The request's draft state, its K/V kept up to where it still holds the request's
        `tokens` (never its last token, whose logits give the first draft); None without a
        free row."""
        state = self.drafts.get(r.rid)
        if state is None:
            bias = self._bias(r)
            if bias is not None and not bool(self._draft_bias(bias).isfinite().any()):
                self.undraftable.add(r.rid)  # (every token it may draft is disallowed)
                return None
            rows = self.runner.req_to_token_pool.alloc(1)
            if rows is None:
                return None
            state = self.drafts[r.rid] = _Draft(r.rid, rows[0], bias=bias)
        state.target_row = r.req_pool_idx
        keep = state.confirmed
        if self.reuses_tail:
            keep += _common_prefix(state.tail, tokens[state.confirmed :])
        self._trim(state, min(keep, len(tokens) - 1))
        return state

    def _bias(self, r: Req) -> torch.Tensor | None:
        """The request's allowed_token_ids and logit_bias as a bias on the draft's logits
        (penalties, which change with every token, are left to the model's sampling)."""
        params = r.sampling_params
        allowed, bias = params.allowed_token_ids, params.logit_bias_ids()
        if not allowed and not bias:
            return None
        out = torch.zeros(self.vocab, dtype=torch.float32)
        if allowed:
            out.fill_(float("-inf"))
            out[[t for t in allowed if t < self.vocab]] = 0.0
        for token, value in zip(bias, (params.logit_bias or {}).values(), strict=True):
            if token < self.vocab:
                out[token] += float(value)
        return out.to(self.runner.device)

    def _trim(self, state: _Draft, keep: int) -> None:
        if keep < state.length:
            row = self.runner.req_to_token_pool.req_to_token[state.row, keep : state.length]
            self.runner.allocator.free_runs([row])  # (page size 1: any run is page aligned)
        state.length = state.confirmed = keep
        state.tail = []

    def _drop(self, rid: str) -> None:
        state = self.drafts.pop(rid)
        self._trim(state, 0)
        self.runner.req_to_token_pool.free(state.row)

    def _allocate(self, todo: list) -> list:
        """Slots for each request's positions state.length .. len(tokens) + room - 2 (its
        unseen tokens and all its drafts but the last), written into its row; the requests
        that got them (one that did not has its draft K/V dropped: no drafts this step)."""
        allocator = self.runner.allocator
        needs = [len(tokens) + room - 1 - state.length for _, tokens, room, state in todo]
        if sum(needs) > allocator.available_size():
            kept, needs_kept, taken = [], [], 0
            for item, need in zip(todo, needs, strict=True):
                if taken + need <= allocator.available_size():  # (grows as others drop)
                    kept.append(item)
                    needs_kept.append(need)
                    taken += need
                else:
                    self.memory_drops += 1
                    self._drop(item[3].rid)
            todo, needs = kept, needs_kept
        if not todo:
            return todo
        starts = [state.length for _, _, _, state in todo]
        slots = allocator.alloc_extend(starts, [s + n for s, n in zip(starts, needs)], None)
        assert slots is not None, "draft allocator: room was checked"
        rows, cols = _positions([state.row for _, _, _, state in todo], starts, needs)
        req_to_token = self.runner.req_to_token_pool.req_to_token
        req_to_token[rows.to(req_to_token.device), cols.to(req_to_token.device)] = slots.to(
            req_to_token.dtype
        )
        for (_, _, _, state), start, need in zip(todo, starts, needs, strict=True):
            state.length = start + need  # (what the slots are for; `confirmed` is `start`)
        return todo

    # -- forwards -------------------------------------------------------------------------------
    def _catch_up(self, todo: list) -> torch.Tensor:
        """Extend forwards over each request's tokens from `confirmed` to its last (in pieces
        of at most `chunk` tokens a forward); each request's logits after its last token
        [len(todo), vocab], whence its first draft."""
        pending = [(state, tokens, state.confirmed) for _, tokens, _, state in todo]
        first: list[torch.Tensor | None] = [None] * len(todo)
        while any(start < len(tokens) for _, tokens, start in pending):
            budget, group, members = self.chunk, [], []
            for j, (state, tokens, start) in enumerate(pending):
                n = min(len(tokens) - start, budget)
                if n <= 0:
                    continue
                group.append((state, tokens, start, start + n))
                members.append(j)
                pending[j] = (state, tokens, start + n)
                budget -= n
                if not budget:
                    break
            logits = self._extend(group)
            for k, (j, (_, tokens, _, end)) in enumerate(zip(members, group, strict=True)):
                if end == len(tokens):
                    first[j] = logits[k]
        assert all(t is not None for t in first)
        return torch.stack(first)  # type: ignore[arg-type]

    def _decode(self, todo: list, first: torch.Tensor, drafts: list[list[int]]) -> None:
        """Decode forwards feeding each request's last draft (`first`, its catch-up's greedy
        token, on the device) until it has `room` drafts, without a host read between them:
        every forward runs the same requests (those with room for two drafts or more) and
        each one's positions, lengths and slots are known beforehand, so they go to the
        device in one copy; a forward's input ids are the previous one's greedy tokens, on
        the device; the drafts, first ones included, are read once, after the last forward.
        A request with fewer drafts to make than others repeats its last position in the
        forwards after it is done, writing its K/V to slot 0 (never handed out), and those
        tokens are dropped."""
        members = [j for j, (_, _, room, _) in enumerate(todo) if room > 1]
        if not members:
            for (i, _, _, _), token in zip(todo, first.tolist(), strict=True):
                drafts[i].append(token)
            return
        steps = max(todo[j][2] for j in members) - 1
        n = len(members)
        states = [todo[j][3] for j in members]
        # per forward s (draft s + 1 made) and request: its position, and whether it is real
        made = np.arange(1, steps + 1)[:, None]  # [steps, 1]
        rooms = np.asarray([todo[j][2] for j in members], dtype=np.int64)[None, :]
        base = np.asarray([len(todo[j][1]) - 1 for j in members], dtype=np.int64)[None, :]
        real = made < rooms  # [steps, n]
        pos = base + np.minimum(made, rooms - 1)
        rows = np.broadcast_to(np.asarray([st.row for st in states], dtype=np.int64), pos.shape)
        runner = self.runner
        req_to_token = runner.req_to_token_pool.req_to_token
        which = np.asarray(members, dtype=np.int64)
        host = torch.from_numpy(np.concatenate([rows.ravel(), pos.ravel(), real.ravel(), which]))
        dev = host.to(req_to_token.device)
        m = steps * n
        dev_rows, dev_pos = dev[:m].view(steps, n), dev[m : 2 * m].view(steps, n)
        loc = req_to_token[dev_rows, dev_pos].to(torch.int64) * dev[2 * m : 3 * m].view(steps, n)
        bias = self._stacked_bias(states, dev)
        tokens = first.index_select(0, dev[3 * m :].to(first.device))
        hidden = self._first_hidden(states)  # (an EAGLE head's; None for a draft model)
        out = []
        for s in range(steps):
            fb = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=n, input_ids=tokens,
                positions=dev_pos[s], out_cache_loc=loc[s], req_pool_indices=dev_rows[s],
                seq_lens=dev_pos[s] + 1, seq_lens_cpu=(pos[s] + 1).tolist(),
                req_to_token=req_to_token, kv_pool=runner.kv_pool,
                attn_backend=runner.attn_backend, spec_hidden=hidden,
            )  # fmt: skip
            tokens = self._greedy(runner.forward(fb), bias)
            hidden = fb.spec_hidden_out
            out.append(tokens)
        read = torch.cat([first, torch.stack(out).reshape(-1)]).tolist()  # the one host read
        for (i, _, _, _), token in zip(todo, read[: len(todo)], strict=True):  # first drafts
            drafts[i].append(token)
        made_tokens = read[len(todo) :]  # [steps, n], row-major
        for k, j in enumerate(members):
            i, room = todo[j][0], todo[j][2]
            drafts[i].extend(made_tokens[s * n + k] for s in range(room - 1))

    def _first_hidden(self, states: list[_Draft]) -> torch.Tensor | None:
        """The hidden states of the first decode forward's inputs (EAGLE: the head's own
        output at each request's last caught-up position)."""
        return None

    def _stacked_bias(self, states: list[_Draft], like: torch.Tensor) -> torch.Tensor | None:
        """The requests' biases as one [n, vocab] tensor (None: no request has one)."""
        biases = [state.bias for state in states]
        if all(b is None for b in biases):
            return None
        zero = torch.zeros(self.vocab, dtype=torch.float32, device=like.device)
        return torch.stack([zero if b is None else b for b in biases])

    def _greedy(self, logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Each row's greedy token over the shared vocabulary, after its bias (on the device)."""
        return self._token_ids(self._scores(logits, bias).argmax(-1))

    def _scores(self, logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The draft's logits over the tokens it may draft, after the requests' biases."""
        logits = logits[:, : self.vocab]
        return logits if bias is None else logits + bias  # (float32 at least)

    def _draft_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """A bias over the model's ids [..., vocab] on the draft's columns."""
        return bias

    def _token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """The model's token ids of columns of `_scores`."""
        return columns

    def _top(
        self, logits: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's `topk` best tokens and their log-probabilities under the draft."""
        scores = self._scores(logits, bias)
        logp = torch.log_softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), -1)
        values, columns = logp.topk(self.topk, dim=-1)
        return self._token_ids(columns), values

    def _extend(self, group: list[tuple[_Draft, Any, int, int]]) -> torch.Tensor:
        """One extend forward of the draft model over (state, tokens, start, end) per request
        (its tokens of positions start .. end - 1); each request's logits after its last
        position."""
        from engine.scheduler.schedule_batch import ModelWorkerBatch

        runner = self.runner
        ids: list[int] = []
        for _, tokens, start, end in group:
            ids.extend(tokens[start:end].tolist())
        graphs = runner.verify_graph_runner
        # (after a request's first catch-up, its next ones are the tokens of one verify step:
        # at most k + 1, the shape of the runner's verify graphs, which replay it)
        short = graphs is not None and all(
            end - start <= graphs.width for _, _, start, end in group
        )
        rows = [state.row for state, _, _, _ in group]
        starts = [start for _, _, start, _ in group]
        ends = [end for _, _, _, end in group]
        lens = [e - s for s, e in zip(starts, ends)]
        r, c = _positions(rows, starts, lens)  # (c: the tokens' positions)
        req_to_token = runner.req_to_token_pool.req_to_token
        out_cache_loc = req_to_token[r.to(req_to_token.device), c.to(req_to_token.device)]
        mwb = ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=ids,
            positions=c.tolist(),
            out_cache_loc=out_cache_loc,
            req_pool_indices=rows,
            seq_lens=ends,
            extend_prefix_lens=starts,
            extend_seq_lens=lens,
            sampling_params=[],
            output_ids=[],
            prompt_ids=[],
            # a short catch-up runs as a verify step (its graphs: every position's logits)
            spec_draft_lens=[n - 1 for n in lens] if short else None,
        )
        fb = runner.build_forward_batch(mwb)
        fb.return_all_logits = short
        fb.spec_hidden = self._extend_hidden(group)
        logits = runner.forward(fb)
        if short:  # each request's last token's
            logits = logits.index_select(0, fb.last_token_indices)
        self._extended(group, fb)
        return logits

    def _extend_hidden(self, group: list) -> torch.Tensor | None:
        """The hidden states a catch-up forward reads (EAGLE: the model's), or None."""
        return None

    def _extended(self, group: list, fb: ForwardBatch) -> None:
        """After a catch-up forward (EAGLE keeps its output hidden states)."""


def _common_prefix(a: list[int], b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if not n:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != b[:n])
    return int(diff[0]) if diff.size else n


def _positions(rows: list[int], starts: list[int], lens: list[int]) -> tuple:
    """(row, column) index tensors of positions starts[i] .. starts[i] + lens[i] - 1 of row
    rows[i], concatenated."""
    lens_a = np.asarray(lens, dtype=np.int64)
    r = np.repeat(np.asarray(rows, dtype=np.int64), lens_a)
    offsets = np.arange(int(lens_a.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(lens_a) - lens_a, lens_a
    )
    c = np.repeat(np.asarray(starts, dtype=np.int64), lens_a) + offsets
    return torch.from_numpy(r), torch.from_numpy(c)
