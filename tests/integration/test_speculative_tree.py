"""Draft trees (`speculative_eagle_topk` > 1; engine/speculative/tree.py): the tokens are plain
decoding's whatever the tree, with the Triton and torch_native backends and at page sizes 1
and 4 (greedy and sampled requests over chains and trees alike are in
tests/integration/test_speculative_eagle.py); after tree steps whose accepted nodes moved, the
model's kept hidden states are still transformers'; the trees are, node for node, what a
plain-torch reference of the EAGLE head builds (float64); a tree holding every candidate
accepts more than the chain; configurations the engine cannot serve are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.engine import Engine
from tests.factories import tiny_model
from tests.integration.test_speculative_eagle import (
    LAYERS,
    PLAIN,
    _prompts,
    _random_eagle_head,
    _target,
    eager_graphs,
    first_mlp_model,
    graph_run,
    head,
    tree_spec,
)

_tree = tree_spec


def test_triton_backend_with_graphs_captured() -> None:
    """The Triton extend kernel's tree mask. With the model's and the head's graphs (the
    CPU's eager double of them: the replay path), the model's tree steps replay its verify
    graphs of trees and the head's tree forwards its decode graphs (leaf rows of its own
    table); the trees and the tokens are the eager run's, and plain decoding's."""
    model = tiny_model("llama")
    prompts = [p[:20] for p in _prompts(3, seed=4)]
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True,
               "allowed_token_ids": [11, 12, 13]} for n in (12, 7, 4)]  # fmt: skip
    kw = {"cuda_graph_bs": (1, 2, 4, 8), "max_total_tokens": 1024, "attention_backend": "triton"}
    with Engine(model_path=model, **PLAIN, **kw) as engine:
        want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    spec = _tree("eagle", _random_eagle_head(model), nodes=5, topk=2, steps=3)

    got, eager_trees, stats, _ = graph_run(model, spec, prompts, params, False, **kw)
    assert got == want
    assert stats["spec_num_drafts"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    got, trees, _, replays = graph_run(model, spec, prompts, params, True, **kw)
    assert got == want
    assert trees == eager_trees
    for kind in ("model verify_graph_runner", "head graph_runner"):
        assert replays[kind] > 0, replays


@pytest.mark.parametrize("draft_lens", [[4, 4], [2, 4, 0]], ids=["full", "padded"])
def test_tree_verify_graphs_replay_the_eager_forward(draft_lens: list[int]) -> None:
    """A verify step of trees replayed from the model's verify graphs (every request at the
    graphs' width, or padded nodes and a padded request) gives the eager forward's logits
    and K/V: the static masks are each request's ancestor masks, the positions its depths."""
    from engine.speculative.tree import depths
    from tests.runner_batches import eager_forward, kv_restore, kv_snapshot, verify_batch

    model = tiny_model("llama")
    trees = {4: [0, 0, 1, 1], 2: [0, 0], 0: []}
    spec = _tree("eagle", _random_eagle_head(model), nodes=4, topk=2, steps=2)
    with Engine(model_path=model, **PLAIN, cuda_graph_bs=(1, 2, 4), max_total_tokens=1024,
                attention_backend="triton", **spec) as engine:  # fmt: skip
        runner = engine.scheduler.model_runner
        eager_graphs(runner)
        assert runner.verify_graph_runner.trees
        n = len(draft_lens)
        prefix = [7, 12, 3][:n]
        fb = verify_batch(runner, list(range(1, n + 1)), prefix, draft_lens, seed=5)
        fb.spec_parents = [trees[k] for k in draft_lens]
        fb.positions = torch.tensor([p + d for p, k in zip(prefix, draft_lens)
                                     for d in depths(trees[k])])  # fmt: skip
        want, want_kv = eager_forward(runner, fb)
        saved = kv_snapshot(runner)
        got = runner.forward(fb).float()
        got_kv = kv_snapshot(runner)
        kv_restore(runner, saved)
        assert sum(g.num_replays for g in runner.verify_graph_runner.graphs.values()) == 1
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for g, w in zip(got_kv, want_kv, strict=True):  # (slot 0 takes the padding's)
            torch.testing.assert_close(g[1:], w[1:])
        fb.spec_parents = None  # (the same nodes as chains: other logits)
        chain, _ = eager_forward(runner, fb)
        assert (chain.float() - want.float()).abs().max() > 1e-3


def test_kept_hidden_states_after_tree_steps_are_transformers(monkeypatch) -> None:
    """After tree steps whose accepted nodes were moved (their K/V and hidden rows), every
    kept hidden state of a request is transformers' over its tokens (float64): the moved
    K/V was read right by later forwards, and the moved rows are the accepted nodes'."""
    from engine.speculative import verify as verify_module
    from services.tiny_eagle import model_states

    moves = []
    orig_move = verify_module.move_kv
    monkeypatch.setattr(verify_module, "move_kv",
                        lambda r, s, m: moves.append(len(m)) or orig_move(r, s, m))  # fmt: skip
    path = first_mlp_model()
    prompt = _prompts(1, seed=3)[0][:30]
    seen = {}
    with Engine(model_path=path, dtype=torch.float64, **PLAIN,
                **_tree("eagle", path + "-eagle", nodes=10, topk=2)) as engine:  # fmt: skip
        sched = engine.scheduler
        orig = sched.drafter.propose

        def spy(reqs):  # the request's tokens and every kept hidden row, each step
            from engine.speculative.scheduling import token_array

            r = reqs[0]
            tokens = token_array(r).copy()
            table = sched.model_runner.req_to_token_pool.req_to_token
            slots = table[r.req_pool_idx, : len(tokens) - 1].to(torch.int64)
            seen["tokens"], seen["rows"] = tokens, sched.model_runner.hidden_capture.rows(slots)
            return orig(reqs)

        sched.drafter.propose = spy
        engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 24,
                                                             "temperature": 0.0})
    assert sum(moves) > 0
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    tokens = torch.from_numpy(seen["tokens"][:-1])
    assert len(tokens) > len(prompt) + 10
    with torch.no_grad():
        _, want = model_states(hf, tokens, False, None)
    torch.testing.assert_close(seen["rows"], want, rtol=1e-9, atol=1e-9)


def _reference_tree(w, cfg, model, tokens, eagle3, layers, hot, topk, steps, limits):
    """The tree a plain-torch EAGLE head builds for a request of `tokens`: (drafts, parents)."""
    from engine.speculative.tree import select_nodes
    from services.tiny_eagle import head_forward, model_states

    embed = model.get_input_embeddings().weight
    lm = w["lm_head.weight"] if eagle3 else model.get_output_embeddings().weight
    seq = torch.from_numpy(np.asarray(tokens))
    _, hidden = model_states(model, seq, eagle3, layers)
    n = len(seq) - 1

    def forward(path, own):
        ids = torch.cat([seq[1:], torch.tensor(path, dtype=torch.int64)])
        logits, out = head_forward(w, cfg, embed, lm, ids, hidden[:n], torch.arange(len(ids)),
                                   eagle3, own)  # fmt: skip
        return torch.log_softmax(logits[-1], -1), out

    def ids_of(columns):
        return [int(hot[c]) if hot is not None else int(c) for c in columns]

    logp, out = forward([], None)
    values, columns = logp.topk(topk)
    cand = [(t, -1, float(v), 1) for t, v in zip(ids_of(columns), values)]  # token, parent..
    leaves = [([t], out[n - 1 : n], float(v), j) for j, (t, v) in
              enumerate(zip(ids_of(columns), values))]  # (path, own states, score, candidate)
    for step in range(1, steps):
        children = []
        for path, own, score, c in leaves:
            logp, out = forward(path, own)
            values, columns = logp.topk(topk)
            for t, v in zip(ids_of(columns), values):
                cand.append((t, c, score + float(v), step + 1))
                children.append((path + [t], torch.cat([own, out[-1:]]), score + float(v),
                                 len(cand) - 1))  # fmt: skip
        best = torch.tensor([ch[2] for ch in children], dtype=torch.float64).topk(topk).indices
        leaves = [children[int(i)] for i in best]
    scores = np.array([c[2] for c in cand])
    parents = np.array([c[1] for c in cand])
    depth = np.array([c[3] for c in cand])
    max_depth, max_nodes = limits
    chosen = select_nodes(scores, parents, depth, max_nodes, depth <= max_depth)
    node = {c: j for j, c in enumerate(chosen, start=1)}
    return [cand[c][0] for c in chosen], [node.get(cand[c][1], 0) for c in chosen]


@pytest.mark.parametrize(("kind", "leaf_rows"), [("eagle", 256), ("eagle3", 256), ("eagle", 1)],
                         ids=["eagle", "eagle3", "eagle-own-tables"])
def test_trees_are_the_reference_heads(kind: str, leaf_rows: int, monkeypatch) -> None:
    """Every request's tree of every step equals the reference head's, built from the
    model's hidden states of the request's tokens then (float64: no near-ties). Fourteen
    nodes: every candidate of four steps of topk 2, so every forward's leaves (each reading
    its parent's output state and its ancestors' K/V) are compared, the last forward's
    among them, whose leaves' parents are not all siblings. (`leaf_rows` 1: too few rows of
    the head's table kept for leaves, so they run over a table of their own.)"""
    from transformers import AutoModelForCausalLM

    from engine.speculative import draft_runner
    from services.tiny_eagle import aux_layers, load_head

    monkeypatch.setattr(draft_runner, "MAX_LEAF_ROWS", leaf_rows)

    path = head(kind)
    prompts = _prompts(2, seed=2)
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    topk, steps = 2, 4
    proposals = []  # (request's tokens, its limits, its drafts, their parents)
    kw = {"dtype": torch.float64, "page_size": 4, "chunked_prefill_size": 32,
          "max_running_requests": 2}  # fmt: skip
    own_tables = []
    with Engine(model_path=_target(), **PLAIN, **kw,
                **_tree(kind, path, nodes=14, topk=topk, steps=steps)) as engine:  # fmt: skip
        drafter = engine.scheduler.drafter
        orig = drafter.propose
        pool = drafter.runner.req_to_token_pool
        alloc = pool.alloc
        pool.alloc = lambda n: own_tables.append((r := alloc(n)) is None) or r

        def spy(reqs):
            from engine.speculative.scheduling import token_array

            seen = [(token_array(r).copy(), (min(drafter.room(r), steps), drafter.tree_nodes(r)))
                    for r in reqs]  # fmt: skip
            drafts = orig(reqs)
            trees = drafter.last_parents or [[] for _ in reqs]  # (None: no drafts at all)
            for (tokens, limits), d, p in zip(seen, drafts, trees, strict=True):
                proposals.append((tokens, limits, list(d), list(p)))
            return drafts

        drafter.propose = spy
        engine.generate(input_ids=prompts, sampling_params=params)
    proposals = [p for p in proposals if p[2]]
    assert any(own_tables) == (leaf_rows == 1), own_tables
    assert len(proposals) >= 4 and any(not p[3] == list(range(len(p[3]))) for p in proposals)
    w, cfg = load_head(path)
    eagle3 = kind == "eagle3"
    ids = (getattr(cfg, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = aux_layers(LAYERS, ids) if eagle3 else None
    model = AutoModelForCausalLM.from_pretrained(_target(), dtype=torch.float64).eval()
    hot = w["d2t"] + torch.arange(len(w["d2t"])) if eagle3 else None
    with torch.no_grad():
        for tokens, limits, drafts, parents in proposals:
            want = _reference_tree(w, cfg, model, tokens, eagle3, layers, hot, topk, steps,
                                   limits)  # fmt: skip
            assert (drafts, parents) == want, len(tokens)


def test_a_whole_tree_accepts_more_than_the_chain() -> None:
    """A derived head on a model its first layer decides: a tree of every candidate of 3
    steps (2 + 4 + 4 nodes) contains the greedy chain's path and its runners-up, so it
    accepts more than the 3-token chain; the tokens are plain decoding's either way."""
    path = first_mlp_model()
    prompts = _prompts()
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    with Engine(model_path=path, **PLAIN) as engine:
        want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    lengths = {}
    for name, spec in (("chain", _tree("eagle", path + "-eagle", nodes=3, topk=1, steps=3)),
                       ("tree", _tree("eagle", path + "-eagle", nodes=10, topk=2, steps=3))):
        with Engine(model_path=path, **PLAIN, **spec) as engine:
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            lengths[name] = engine.get_stats()["spec_accept_length"]
        assert [o["output_ids"] for o in outs] == want
    # (3.04 and 3.19 of at most 4 when written)
    assert lengths["tree"] > lengths["chain"] > 2.5, lengths


def test_standalone_draft_model_trees() -> None:
    """A draft model drafts trees too: the model as its own draft puts the model's greedy
    path in its tree, so most of each path is accepted; plain decoding's tokens (sampling and
    logprobs: tests/integration/test_speculative_draft_model.py)."""
    from tests.integration.test_speculative_draft_model import _run as run_checked

    path = tiny_model("llama")
    prompts = _prompts(6, seed=5)
    greedy = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    want, _ = run_checked(path, prompts, greedy, **PLAIN)
    got, stats = run_checked(path, prompts, greedy, **PLAIN,
                             **_tree("standalone", path, nodes=6, topk=2, steps=3))
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert stats["spec_accept_length"] > 2.5, stats


def test_bad_tree_configurations_are_refused() -> None:
    from engine.config import EngineArgs

    base = {"model_path": _target(), "speculative_algorithm": "eagle",
            "speculative_draft_model_path": head("eagle")}  # fmt: skip
    args = EngineArgs(**base, speculative_num_draft_tokens=8, speculative_eagle_topk=2)
    assert args.speculative_num_steps == 4  # (num_draft_tokens // topk)
    args = EngineArgs(**base, speculative_num_draft_tokens=3)
    assert args.speculative_num_steps == 3
    with pytest.raises(ValueError, match="takes 3 steps"):
        EngineArgs(**base, speculative_num_draft_tokens=3, speculative_num_steps=1)
    # SGLang's chain command (its num_draft_tokens counts the last token): 3 drafts
    args = EngineArgs(**base, speculative_num_draft_tokens=4, speculative_num_steps=3)
    assert (args.speculative_num_draft_tokens, args.speculative_num_steps) == (3, 3)
    with pytest.raises(ValueError, match="fewer than speculative_num_draft_tokens"):
        EngineArgs(**base, speculative_num_draft_tokens=9, speculative_eagle_topk=2,
                   speculative_num_steps=2)  # fmt: skip
    with pytest.raises(ValueError, match="must be in 1..4"):
        EngineArgs(**base, speculative_num_draft_tokens=4, speculative_eagle_topk=2,
                   speculative_num_steps=5)  # fmt: skip
    # n-gram trees hold topk matches' continuations: at most topk x steps nodes
    ngram = {"model_path": _target(), "speculative_algorithm": "ngram"}
    assert EngineArgs(**ngram, speculative_eagle_topk=2).speculative_num_steps == 2
    with pytest.raises(ValueError, match="8 candidate nodes, fewer than"):
        EngineArgs(**ngram, speculative_num_draft_tokens=9, speculative_eagle_topk=2,
                   speculative_num_steps=4)  # fmt: skip
    # (trees over several ranks: tests/integration/test_tensor_parallel.py)
    assert EngineArgs(**base, speculative_eagle_topk=2, tp_size=2).speculative_num_steps == 2
    with pytest.raises(ValueError, match="speculative_eagle_topk must be"):
        EngineArgs(**base, speculative_eagle_topk=0)


def test_backends_and_models_without_tree_masks_are_refused() -> None:
    from types import SimpleNamespace

    from engine.speculative.scheduling import check_tree_support

    class NoTrees:
        supports_tree_mask = False

    windows = SimpleNamespace(sliding_windows=(None, 8))
    plain = SimpleNamespace(sliding_windows=(None, None))
    with pytest.raises(ValueError, match="NoTrees attention backend has no tree masks"):
        check_tree_support(SimpleNamespace(attn_backend=NoTrees(), model_config=plain))
    from engine.attention.base import create_attention_backend

    backend = create_attention_backend("torch_native", device="cpu")
    check_tree_support(SimpleNamespace(attn_backend=backend, model_config=plain))
    # (sliding windows compare the nodes' positions: tests/integration/test_speculative.py)
    check_tree_support(SimpleNamespace(attn_backend=backend, model_config=windows))
