"""How a router picks one of the live workers that can take a request (`--policy`).

* `cache_aware` (the default, as in SGLang's router): the router remembers, in one
  approximate radix tree over prompt text (`PrefixTree`), which prompts it sent to which
  worker. A request goes to the worker holding the longest prefix of its prompt when that
  prefix is more than `--cache-threshold` of it, so the worker's prefix cache serves it;
  otherwise to the least loaded worker, of equally loaded ones the one whose tree is smallest
  (the most room in its cache for a new prefix; SGLang's router goes by the tree alone).
  While the workers' loads are too far apart (the most loaded carries over
  `--balance-abs-threshold` requests more than the least loaded and over
  `--balance-rel-threshold` times its load) the least loaded takes it, whatever it holds.
  Each worker's share of the tree is bounded by `--max-tree-size` characters, its least
  recently routed prefixes forgotten first. A worker that leaves (or restarts: a new pid)
  is forgotten, and `/flush_cache` or a weights update forgets everything.
* `shortest_queue`: the least loaded (ties: lower token usage, then id).
* `round_robin`, `random`, `power_of_two` (the less loaded of two drawn at random).

The tree is the router's own guess, not the workers' caches: each router of a deployment
keeps its own, and a worker may have evicted what the tree remembers. The prompt is keyed as
the router sees it (a chat's messages, not its rendered template; token ids as characters),
with the LoRA adapter first: a worker caches each adapter's prefixes apart.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from shared.messages import WorkerLoadMsg
from shared.settings import ROUTING_POLICIES, RouterSettings


class _Node:
    __slots__ = ("label", "parent", "children", "tenants")

    def __init__(self, label: str, parent: _Node | None) -> None:
        self.label = label  # the text on the edge from the parent
        self.parent = parent
        self.children: dict[str, _Node] = {}  # by the first character of their label
        self.tenants: dict[str, int] = {}  # worker -> when it was last routed through here


def _common_len(label: str, key: str, at: int) -> int:
    """How many leading characters of `label` equal `key[at:]`'s."""
    if key.startswith(label, at):
        return len(label)
    lo, hi = 0, min(len(label), len(key) - at)  # label[:lo] matches; label[:hi + 1] does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key.startswith(label[:mid], at):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    """A radix tree over strings whose nodes record which workers ("tenants") hold them.

    A tenant on a node is on every node above it (inserting marks the whole path; eviction
    takes a tenant off leaves first), so a walk down the tree narrows the tenants holding
    the prefix walked so far. `size(t)` is the characters tenant `t` holds.
    """

    def __init__(self) -> None:
        self.root = _Node("", None)
        self._sizes: Counter[str] = Counter()
        self._ticks = itertools.count(1)

    def size(self, tenant: str) -> int:
        return self._sizes[tenant]

    def insert(self, key: str, tenant: str) -> None:
        tick = next(self._ticks)
        node, at = self.root, 0
        node.tenants[tenant] = tick
        while at < len(key):
            child = node.children.get(key[at])
            if child is None:
                child = _Node(key[at:], node)
                node.children[key[at]] = child
                n = len(child.label)
            else:
                n = _common_len(child.label, key, at)
                if n < len(child.label):
                    child = self._split(child, n)
            if tenant not in child.tenants:
                self._sizes[tenant] += len(child.label)
            child.tenants[tenant] = tick
            node, at = child, at + n

    def match(self, key: str, allowed: Sequence[str]) -> tuple[list[str], int]:
        """The tenants among `allowed` holding the longest prefix of `key`, and its length."""
        best: list[str] = []
        matched, node, at = 0, self.root, 0
        while at < len(key):
            child = node.children.get(key[at])
            if child is None:
                break
            holders = [t for t in allowed if t in child.tenants]
            if not holders:
                break
            n = _common_len(child.label, key, at)
            best, matched = holders, at + n
            if n < len(child.label):
                break
            node, at = child, at + n
        return best, matched

    def evict(self, tenant: str, target: int) -> None:
        """Forget `tenant`'s least recently routed prefixes until it holds `target` chars."""
        heap = [(n.tenants[tenant], id(n), n) for n in self._leaves(tenant)]
        heapq.heapify(heap)
        while heap and self._sizes[tenant] > target:
            _, _, node = heapq.heappop(heap)
            parent = self._drop(node, tenant)
            if parent is not None and parent is not self.root and not any(
                tenant in c.tenants for c in parent.children.values()
            ):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))

    def remove(self, tenant: str) -> None:
        """Forget everything `tenant` holds."""
        stack = [self.root]
        order = []
        while stack:
            node = stack.pop()
            if tenant in node.tenants:
                order.append(node)
                stack.extend(node.children.values())
        for node in reversed(order):  # children before their parents
            if node is self.root:
                node.tenants.pop(tenant, None)
            else:
                self._drop(node, tenant)
        self._sizes.pop(tenant, None)

    def clear(self) -> None:
        self.root = _Node("", None)
        self._sizes.clear()

    def _leaves(self, tenant: str) -> list[_Node]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            below = [c for c in node.children.values() if tenant in c.tenants]
            if below:
                stack.extend(below)
            elif node is not self.root:
                leaves.append(node)
        return leaves

    def _drop(self, node: _Node, tenant: str) -> _Node | None:
        """Take `tenant` off `node` (a leaf of its); unlink the node if no tenant is left.
        Returns the node's parent."""
        del node.tenants[tenant]
        self._sizes[tenant] -= len(node.label)
        parent = node.parent
        if not node.tenants and parent is not None:
            del parent.children[node.label[0]]
            node.parent = None
        return parent

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut `node`'s edge after `n` characters; the new upper node (same tenants)."""
        parent = node.parent
        assert parent is not None and 0 < n < len(node.label)
        upper = _Node(node.label[:n], parent)
        upper.tenants = dict(node.tenants)
        parent.children[upper.label[0]] = upper
        node.label = node.label[n:]
        node.parent = upper
        upper.children[node.label[0]] = node
        return upper


def routing_key(
    *,
    text: str | None = None,
    text_pair: str | None = None,
    input_ids: Sequence[int] | None = None,
    messages: Sequence[Any] | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> str:
    """A request's prompt as one string for the prefix tree: two prompts that share a
    beginning share a beginning here. The adapter comes first, then the cache salt if any
    (a worker shares cached prefixes only within a salt); token ids are characters."""
    head = f"{lora_name or ''}\x00"
    if cache_salt is not None:  # ("s": never the start of an unsalted key's prompt)
        head += f"s{cache_salt}\x00"
    if input_ids is not None:
        if input_ids and not 0 <= min(input_ids) <= max(input_ids) < 0x110000:
            input_ids = [t if 0 <= t < 0x110000 else 0xFFFD for t in input_ids]
        return head + "i" + "".join(map(chr, input_ids))
    if messages is not None:
        parts = [head, "m", json.dumps(tools, sort_keys=True) if tools else ""]
        for m in messages:
            calls = json.dumps(m.tool_calls, sort_keys=True) if m.tool_calls else ""
            parts.append(f"\x1e{m.role}\x1f{m.name or ''}\x1f{m.content}{calls}")
        return "".join(parts)
    return head + "t" + (text or "") + ("" if text_pair is None else "\x1d" + text_pair)


LoadFn = Callable[[str], int]


class Policy:
    """Picks one of `candidates` (never empty) for a request keyed `key`: the worker's id and
    why (cache_aware: `prefix`, `new_prefix`, `imbalanced` or `no_key`; the others: their
    name), as /metrics counts them (`sluice:router_routed_requests_total`)."""

    name = ""
    uses_key = False  # whether `pick` looks at the prompt (else the router builds no key)

    def pick(
        self, candidates: list[WorkerLoadMsg], key: str | None, load: LoadFn
    ) -> tuple[str, str]:
        raise NotImplementedError

    def forget(self, worker_id: str) -> None:
        """`worker_id` left, or restarted with an empty cache."""

    def forget_all(self) -> None:
        """Every worker's cache was emptied."""


def _least_loaded(candidates: list[WorkerLoadMsg], load: LoadFn) -> str:
    return min(candidates, key=lambda w: (load(w.worker_id), w.token_usage, w.worker_id)).worker_id


class ShortestQueue(Policy):
    name = "shortest_queue"

    def pick(
        self, candidates: list[WorkerLoadMsg], key: str | None, load: LoadFn
    ) -> tuple[str, str]:
        return _least_loaded(candidates, load), self.name


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(
        self, candidates: list[WorkerLoadMsg], key: str | None, load: LoadFn
    ) -> tuple[str, str]:
        ids = sorted(w.worker_id for w in candidates)
        return ids[next(self._turn) % len(ids)], self.name


class RandomChoice(Policy):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(
        self, candidates: list[WorkerLoadMsg], key: str | None, load: LoadFn
    ) -> tuple[str, str]:
        return self.rng.choice(candidates).worker_id, self.name


class PowerOfTwo(RandomChoice):
    name = "power_of_two"

    def pick(
        self, candidates: list[WorkerLoadMsg], key: str | None, load: LoadFn
    ) -> tuple[str, str]:
        drawn = self.rng.sample(candidates, min(2, len(candidates)))
        return _least_loaded(drawn, load), self.name


class CacheAware(Policy):
    name = "cache_aware"
    uses_key = True

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 1 << 24,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.tree = PrefixTree()

    def pick(
        self, candidates: list[WorkerLoadMsg], key: str | None, load: LoadFn
    ) -> tuple[str, str]:
        chosen, reason = self._choose(candidates, key, load)
        if key:
            self.tree.insert(key, chosen)
            if self.tree.size(chosen) > self.max_tree_size:  # evict a tenth more: amortised
                self.tree.evict(chosen, self.max_tree_size * 9 // 10)
        return chosen, reason

    def _choose(
        self, candidates: list[WorkerLoadMsg], key: str | None, load: LoadFn
    ) -> tuple[str, str]:
        if not key:
            return _least_loaded(candidates, load), "no_key"
        loads = [load(w.worker_id) for w in candidates]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return _least_loaded(candidates, load), "imbalanced"
        holders, matched = self.tree.match(key, [w.worker_id for w in candidates])
        if holders and matched / len(key) > self.cache_threshold:
            return _least_loaded([w for w in candidates if w.worker_id in holders], load), "prefix"
        # SGLang's router sends a new prefix to the smallest tree whatever the loads; the
        # least loaded first (then the smallest tree) kept unique prompts as fast as
        # shortest_queue (benchmarks/routing_policy.py), where the smallest tree alone was 8%
        # slower: it would pile a new prompt on a busy worker
        least = min(
            candidates,
            key=lambda w: (load(w.worker_id), self.tree.size(w.worker_id), w.worker_id),
        )
        return least.worker_id, "new_prefix"

    def forget(self, worker_id: str) -> None:
        self.tree.remove(worker_id)

    def forget_all(self) -> None:
        self.tree.clear()


def make_policy(settings: RouterSettings) -> Policy:
    """The policy `settings.policy` names, with its settings."""
    s = settings
    if s.policy == "cache_aware":
        return CacheAware(
            s.cache_threshold, s.balance_abs_threshold, s.balance_rel_threshold, s.max_tree_size
        )
    classes = {c.name: c for c in (ShortestQueue, RoundRobin, RandomChoice, PowerOfTwo)}
    if s.policy not in classes:
        raise ValueError(f"unknown routing policy {s.policy!r}; one of {ROUTING_POLICIES}")
    return classes[s.policy]()
