"""The router's routing policies: the cache-aware prefix tree against a brute-force answer,
its decisions (prefix, new prefix, imbalance), eviction, and workers leaving."""

from __future__ import annotations

import random

import pytest

from services.router_metrics import RouterMetrics
from services.router_policy import (
    CacheAware,
    PowerOfTwo,
    PrefixTree,
    RoundRobin,
    make_policy,
    routing_key,
)
from services.router_workers import WorkerTable
from shared.messages import ChatMessage
from shared.settings import ROUTING_POLICIES, RouterSettings
from tests.unit.test_router_workers_metrics import load


def _nodes(tree: PrefixTree):
    stack = [tree.root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _check_invariants(tree: PrefixTree) -> None:
    """Tenants nest (a child's are its parent's), ticks never grow downwards, no empty node
    hangs on, children are keyed by their first character, and sizes add up."""
    sizes: dict[str, int] = {}
    for node in _nodes(tree):
        for key, child in node.children.items():
            assert child.parent is node and child.label and child.label[0] == key
            assert child.tenants, "a node no worker holds stayed in the tree"
            for t, tick in child.tenants.items():
                assert t in node.tenants and node.tenants[t] >= tick
        if node is not tree.root:
            for t in node.tenants:
                sizes[t] = sizes.get(t, 0) + len(node.label)
    for t, n in sizes.items():
        assert tree.size(t) == n
    assert all(tree.size(t) == 0 for t in ("a", "b", "c") if t not in sizes)


def _brute_match(held: dict[str, set[str]], key: str, allowed: list[str]) -> tuple[set, int]:
    def lcp(a: str, b: str) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    best = {t: max((lcp(key, s) for s in held.get(t, ())), default=0) for t in allowed}
    top = max(best.values(), default=0)
    return ({t for t, n in best.items() if n == top} if top else set()), top


def test_tree_matches_brute_force_on_random_strings() -> None:
    rng = random.Random(0)
    tree = PrefixTree()
    held: dict[str, set[str]] = {}
    alphabet = "abc"  # small, so that keys share prefixes and edges split often
    for step in range(600):
        key = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        tenant = rng.choice("abc")
        if step % 2:
            allowed = rng.sample(["a", "b", "c"], rng.randint(1, 3))
            holders, n = tree.match(key, allowed)
            want, want_n = _brute_match(held, key, allowed)
            assert (set(holders), n) == (want, want_n), (key, allowed)
        else:
            tree.insert(key, tenant)
            held.setdefault(tenant, set()).add(key)
        if step % 50 == 0:
            _check_invariants(tree)
    _check_invariants(tree)


def test_eviction_forgets_the_least_recently_routed_first_and_keeps_the_tree_sound() -> None:
    tree = PrefixTree()
    for i in range(10):  # ten 20-char prompts with a shared 10-char system prompt
        tree.insert("S" * 10 + chr(ord("a") + i) * 10, "w")
    tree.insert("S" * 10 + "b" * 10, "w")  # touched again: now the most recent
    tree.insert("S" * 10 + "a" * 10, "x")  # another worker's copy is not the tenant's
    assert tree.size("w") == 10 + 10 * 10
    tree.evict("w", 40)
    assert tree.size("w") <= 40
    _check_invariants(tree)
    assert tree.match("S" * 10 + "b" * 10, ["w"]) == (["w"], 20)  # most recent: kept
    assert tree.match("S" * 10 + "j" * 10, ["w"]) == (["w"], 20)  # next most recent
    assert tree.match("S" * 10 + "c" * 10, ["w"]) == (["w"], 10)  # old: only the shared part
    assert tree.match("S" * 10 + "a" * 10, ["w", "x"]) == (["x"], 20)
    tree.evict("w", 0)
    assert tree.size("w") == 0 and tree.match("S" * 10, ["w"]) == ([], 0)
    assert tree.match("S" * 10 + "a" * 10, ["x"]) == (["x"], 20)
    _check_invariants(tree)


def test_removing_a_worker_prunes_its_nodes_only() -> None:
    tree = PrefixTree()
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")
    tree.insert("help", "a")
    tree.remove("a")
    _check_invariants(tree)
    assert tree.size("a") == 0
    assert tree.match("hello world", ["a", "b"]) == (["b"], 6)
    assert tree.match("help", ["a", "b"]) == (["b"], 3)


def policy_tree(table: WorkerTable) -> PrefixTree:
    assert isinstance(table.policy, CacheAware)
    return table.policy.tree


def test_cache_aware_follows_prefixes_and_spreads_new_ones() -> None:
    table = WorkerTable(CacheAware(cache_threshold=0.5))
    table.update({"a": load("a"), "b": load("b")})
    doc1, doc2 = "x" * 100, "y" * 100
    assert table.choose(key=doc1 + "q1").worker_id == "a"  # both empty: ties by id
    assert table.choose(key=doc2 + "q1").worker_id == "b"  # a holds more: b has room
    assert table.choose(key=doc1 + "q2, longer").worker_id == "a"  # 100/110 of it is on a
    assert table.choose(key=doc2 + "q2").worker_id == "b"
    # a match of at most the threshold is a new prefix: the smaller tree (b's) takes it,
    # though a holds the first half of it
    assert policy_tree(table).size("a") == 111 and policy_tree(table).size("b") == 103
    assert table.choose(key="x" * 50 + "z" * 50).worker_id == "b"
    assert table.routed == {
        ("a", "new_prefix"): 1, ("b", "new_prefix"): 2, ("a", "prefix"): 1, ("b", "prefix"): 1,
    }  # fmt: skip


def test_a_new_prefix_goes_to_the_least_loaded_then_the_smallest_tree() -> None:
    table = WorkerTable(CacheAware())
    table.update({"a": load("a"), "b": load("b")})
    assert table.choose(key="b" * 300).worker_id == "a"
    assert table.choose(key="c" * 100).worker_id == "b"  # equal loads: b holds less
    table.update({"a": load("a"), "b": load("b", running=1)})
    assert table.choose(key="d" * 50).worker_id == "a"  # though a holds more


def test_cache_aware_balances_load_when_workers_drift_apart() -> None:
    table = WorkerTable(CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5))
    table.update({"a": load("a"), "b": load("b")})
    doc = "d" * 200
    assert table.choose(key=doc).worker_id == "a"
    table.update({"a": load("a", running=5), "b": load("b", running=2)})  # 3 apart: stay
    assert table.choose(key=doc + "?").worker_id == "a"
    table.update({"a": load("a", running=7), "b": load("b", running=2)})  # 5 apart, 3.5x
    assert table.choose(key=doc + "!").worker_id == "b"
    assert table.routed[("b", "imbalanced")] == 1
    # once b was sent the prompt it holds it too: the less loaded holder takes the next one
    table.update({"a": load("a", running=3), "b": load("b", running=2)})
    assert table.choose(key=doc + "!").worker_id == "b"
    # a request without a prompt key (nothing to match) goes to the least loaded
    assert table.choose(key=None).worker_id == "b"
    assert table.routed[("b", "no_key")] == 1


def test_cache_aware_only_matches_allowed_workers_and_forgets_leavers() -> None:
    table = WorkerTable(CacheAware())
    table.update({"a": load("a", pid=1), "b": load("b")})
    doc = "p" * 100
    assert table.choose(key=doc).worker_id == "a"
    assert table.choose(key=doc, exclude=["a"]).worker_id == "b"  # (a retry elsewhere)
    tree = table.policy.tree
    assert tree.match(doc, ["a", "b"])[1] == 100
    table.update({"a": load("a", pid=2), "b": load("b")})  # a restarted: its cache is empty
    assert tree.match(doc, ["a"]) == ([], 0) and tree.match(doc, ["b"]) == (["b"], 100)
    table.update({"a": load("a", pid=2)})  # b left
    assert tree.size("b") == 0
    table.policy.forget_all()  # /flush_cache
    assert tree.size("a") == 0 and table.policy.tree.match(doc, ["a"]) == ([], 0)


def test_cache_aware_bounds_what_it_remembers_per_worker() -> None:
    policy = CacheAware(max_tree_size=1000)
    table = WorkerTable(policy)
    table.update({"a": load("a")})
    rng = random.Random(1)
    for _ in range(200):
        table.choose(key="".join(rng.choice("abcdefgh") for _ in range(60)))
        assert policy.tree.size("a") <= 1000
    _check_invariants(policy.tree)


def test_routing_keys_keep_prompt_prefixes_as_string_prefixes() -> None:
    sys_msg = ChatMessage("system", "You are terse.")
    turn1 = [sys_msg, ChatMessage("user", "Hi")]
    turn2 = [*turn1, ChatMessage("assistant", "Hello."), ChatMessage("user", "More?")]
    k1, k2 = routing_key(messages=turn1), routing_key(messages=turn2)
    assert k2.startswith(k1) and len(k2) > len(k1)
    ids = routing_key(input_ids=[1, 2, 3])
    assert routing_key(input_ids=[1, 2, 3, 4]).startswith(ids)
    assert routing_key(input_ids=[5, -1, 0x110000])  # out of range ids do not raise
    assert routing_key(text="abc", lora_name="sql") != routing_key(text="abc")
    assert not routing_key(text="abc", lora_name="sql").startswith(routing_key(text="ab"))
    assert not routing_key(text="abc").startswith(routing_key(input_ids=[97]))
    # a cache salt: its own prefixes (a worker shares cached K/V only within a salt)
    salted = routing_key(text="abc", cache_salt="t1")
    assert salted != routing_key(text="abc") and salted != routing_key(text="abc", cache_salt="t")
    assert routing_key(text="abcd", cache_salt="t1").startswith(salted)
    assert not routing_key(text="tabc").startswith(routing_key(text="", cache_salt="t"))
    assert not salted.startswith(routing_key(text="", lora_name="sql"))
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert routing_key(messages=turn1, tools=tools) != k1


def test_other_policies() -> None:
    loads = [load("a", running=3), load("b", running=0), load("c", running=9)]
    rr = RoundRobin()
    picks = [rr.pick(loads, None, lambda w: 0)[0] for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    p2 = PowerOfTwo(random.Random(0))
    by_id = {w.worker_id: w.num_running_reqs for w in loads}
    for _ in range(30):
        chosen, why = p2.pick(loads, "k", by_id.__getitem__)
        assert chosen != "c" and why == "power_of_two"  # c loses to either other one


@pytest.mark.parametrize("name", ROUTING_POLICIES)
def test_every_policy_named_in_the_settings_is_built(name: str) -> None:
    policy = make_policy(RouterSettings(policy=name))
    assert policy.name == name
    table = WorkerTable(policy)
    table.update({"a": load("a")})
    assert table.choose(key="anything").worker_id == "a"


def test_metrics_count_the_routing_decisions() -> None:
    text = RouterMetrics("m").render({}, {("a", "prefix"): 3, ("b", "new_prefix"): 1})
    sample = 'sluice:router_routed_requests_total{model_name="m",worker_id="a",reason="prefix"}'
    assert f"{sample} 3" in text
