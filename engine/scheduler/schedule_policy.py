"""Order of the waiting queue, and admission of waiting requests into a prefill batch."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

from engine.mem_cache.base import namespaced
from engine.mem_cache.no_cache import NoRadixCache
from engine.scheduler.req import CLIP_MAX_NEW_TOKENS, Req

# lpm sorts by cached prefix length; with a long queue the matching costs more than it saves.
LPM_FALLBACK_QUEUE_LEN = 128
# In-batch prefix de-prioritisation (SGLang's two thresholds): a request whose cached prefix
# is short (<= CHECK) but which shares >= DEPRIORITIZE tokens with a request already ahead of
# it in this pass waits, so that it hits the cache once the other one has been computed.
IN_BATCH_PREFIX_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_DEPRIORITIZE_THRESHOLD = 32


class _PrefixSet:
    """Prompts seen so far in one scheduling pass; longest shared prefix with any of them."""

    def __init__(self) -> None:
        self.root: dict = {}

    def match_len(self, ids: list[int], limit: int) -> int:
        node, n = self.root, 0
        for t in ids[:limit]:
            if t not in node:
                break
            node, n = node[t], n + 1
        return n

    def insert(self, ids: list[int], limit: int) -> None:
        node = self.root
        for t in ids[:limit]:
            node = node.setdefault(t, {})


class SchedulePolicy:
    def __init__(
        self, policy: str, tree_cache: Any, seed: int = 0, priority_sign: int = 0
    ) -> None:
        # Prefix-aware orders mean nothing without a cache (and de-prioritising sharers would
        # hold them back for hits that never come), as in SGLang.
        if isinstance(tree_cache, NoRadixCache) and policy in ("lpm", "dfs-weight"):
            policy = "fcfs"
        self.policy = policy
        self.tree_cache = tree_cache
        self.rng = random.Random(seed)
        # requests that share a long prefix with one ahead of them in this pass: they wait for
        # the next round (when the prefix is cached) unless the batch would otherwise be empty
        self.deprioritized: set[str] = set()
        self.matched_all = False  # calc_priority already matched every waiting request
        # priority scheduling: -1 larger `priority` values first, 1 smaller first, 0 off
        self.priority_sign = priority_sign

    def rank(self, req: Req) -> int:
        """Where `req`'s priority puts it: smaller goes first (0 without priorities)."""
        return self.priority_sign * req.priority

    def calc_priority(self, waiting: list[Req]) -> None:
        """Sort `waiting` in place: by priority first, with priority scheduling (then by
        arrival under fcfs, else in the policy's order). Prefix-aware policies match the
        cache for every request (which also sets up each request's next-round input)."""
        self._policy_order(waiting)
        if not self.priority_sign:
            return
        if self.policy == "fcfs":
            waiting.sort(key=lambda r: (self.rank(r), r.arrival))
        else:
            waiting.sort(key=self.rank)  # stable: the policy's order within a priority

    def preemption_victims(
        self,
        top: Req,
        running: Any,
        max_running: int,
        chunk: int | None,
        new_token_ratio: float,
        threshold: int,
    ) -> list[Req]:
        """The requests of the running batch to preempt so that the waiting request `top`
        (its next-round input set up) can be admitted, as `PrefillAdder` would count it."""
        pools = running.pools
        page = pools.page_size
        input_len = top.extend_input_len if chunk is None else min(top.extend_input_len, chunk)
        need = -(-input_len // page) * page
        if chunk is None or top.extend_input_len <= chunk:
            need += min(top.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS)
        room = (
            pools.allocator.available_size()
            + pools.tree_cache.evictable_size()
            - running.running_need_tokens(new_token_ratio)
        )
        slots_full = (
            len(running) >= max_running or pools.req_to_token_pool.available_size() == 0
        )
        return preemption_victims(
            top, running.reqs, self.rank, threshold, need, room, slots_full, new_token_ratio
        )

    def _policy_order(self, waiting: list[Req]) -> None:
        policy = self.policy
        self.deprioritized = set()
        self.matched_all = False
        if policy == "lpm" and len(waiting) > LPM_FALLBACK_QUEUE_LEN:
            policy = "fcfs"
        if policy == "fcfs":
            return
        if policy == "random":
            self.rng.shuffle(waiting)
            return
        deprioritized = self.deprioritized = self._match_all(waiting)
        self.matched_all = True
        if policy == "lpm":
            # (a prefix in host memory, hierarchical cache, is loaded back: it counts too)
            waiting.sort(
                key=lambda r: (r.rid in deprioritized, -len(r.prefix_indices) - r.host_hit_len)
            )
        else:
            self._sort_dfs_weight(waiting)

    def _match_all(self, waiting: list[Req]) -> set[str]:
        seen = _PrefixSet()
        deprioritized: set[str] = set()
        for r in waiting:
            r.init_next_round_input(self.tree_cache)
            if len(r.prefix_indices) + r.host_hit_len <= IN_BATCH_PREFIX_CHECK_THRESHOLD:
                limit = IN_BATCH_PREFIX_DEPRIORITIZE_THRESHOLD
                ids = namespaced(r.origin_input_ids[:limit], r.cache_namespace)
                if seen.match_len(ids, limit) >= limit:
                    deprioritized.add(r.rid)
                else:
                    seen.insert(ids, limit)
        return deprioritized

    def _sort_dfs_weight(self, waiting: list[Req]) -> None:
        """Depth-first over the radix tree, heavier subtrees (more waiting requests) first, so
        requests sharing a prefix run together."""
        by_node: dict[int, list[Req]] = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        nodes: dict[int, Any] = {}
        for r in waiting:
            by_node[id(r.last_node)].append(r)
            node = r.last_node
            while node is not None:
                nodes[id(node)] = node
                weight[id(node)] += 1
                node = node.parent
        root = self.tree_cache.root_node
        out: list[Req] = []
        stack = [root]
        while stack:
            node = stack.pop()
            out.extend(by_node.get(id(node), ()))
            kids = [c for c in node.children.values() if weight.get(id(c), 0) > 0]
            kids.sort(key=lambda c: weight[id(c)])  # heaviest popped first
            stack.extend(kids)
        placed = {id(r) for r in out}
        out.extend(r for r in waiting if id(r) not in placed)
        waiting[:] = out


def preemption_victims(
    top: Req,
    running: list[Req],
    rank: Any,
    threshold: int,
    need: float,
    room: float,
    slots_full: bool,
    new_token_ratio: float,
) -> list[Req]:
    """The running requests to send back to waiting so that `top` can be admitted: those
    whose rank is worse than its by more than `threshold`, worst first (then the latest to
    arrive, which lose the least work). `need` is what admitting `top` takes of the token
    budget, `room` what the budget has; `slots_full`: no request slot is free. [] if `top`
    fits already, or if preempting every request it may would not make room (estimated:
    a victim gives back its KV tokens and what it reserved for its remaining output)."""
    if need < room and not slots_full:
        return []
    candidates = [
        r
        for r in running
        if r.finished_reason is None and r.to_abort is None and rank(r) - rank(top) > threshold
    ]
    candidates.sort(key=lambda r: (rank(r), r.arrival), reverse=True)
    victims: list[Req] = []
    for r in candidates:
        if need < room and (victims or not slots_full):
            return victims
        victims.append(r)
        reserved = min(r.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * new_token_ratio
        room += r.kv_allocated_len + reserved
    return victims if need < room and victims else []
