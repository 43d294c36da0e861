"""EAGLE speculative decoding (`speculative_algorithm="eagle"` / `"eagle3"`): the tokens are
plain decoding's whatever the head drafts; the model's hidden states are kept per KV slot as
transformers computes them; the head's drafts are, token for token, what a plain-torch
reference of the head (services/tiny_eagle.py) drafts from the model's hidden states (in
float64); a head derived from the model agrees with it; bad configurations are refused."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine.engine import Engine
from tests.factories import mixed_prompts, tiny_model

PLAIN = {"disable_overlap_schedule": True}
K = 3
LAYERS = 6  # (EAGLE-3 reads three distinct layers' inputs: the head's config names them)


def _target() -> str:
    """A tiny llama of LAYERS layers, built once."""
    from services.tiny_model import make_tiny_model

    out = os.path.join(os.path.dirname(tiny_model("llama")), f"llama-eagle-target-{LAYERS}")
    if not os.path.exists(os.path.join(out, "config.json")):
        make_tiny_model(out, "llama", num_layers=LAYERS)
    return out


def head(kind: str, **kw) -> str:
    """A head for the target, built once: "eagle", "eagle3" (a draft vocabulary of 512)."""
    from services.tiny_eagle import make_eagle_head

    target = _target()
    tag = "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
    out = f"{target}-{kind}{tag}"
    if not os.path.exists(os.path.join(out, "config.json")):
        if kind == "eagle3":
            kw.setdefault("draft_vocab", 512)
        make_eagle_head(target, out, eagle3=kind == "eagle3", **kw)
    return out


def _spec(kind: str, path: str, k: int = K) -> dict:
    return {"speculative_algorithm": kind, "speculative_draft_model_path": path,
            "speculative_num_draft_tokens": k}  # fmt: skip


def tree_spec(kind: str, path: str, nodes: int = 8, topk: int = 3, steps: int = 3) -> dict:
    """Draft trees (engine/speculative/tree.py; tests/integration/test_speculative_tree.py)."""
    return {**_spec(kind, path, nodes), "speculative_eagle_topk": topk,
            "speculative_num_steps": steps}  # fmt: skip


# the drafts of the tests run both ways: K chained drafts, or trees of 6 nodes of topk 2
SHAPES = {"chain": lambda kind, path: _spec(kind, path),
          "tree": lambda kind, path: tree_spec(kind, path, nodes=6, topk=2)}  # fmt: skip


def _run(prompts, params, **kw):
    """(output ids, stats) of the target's engine; the prefix cache, and the head's K/V and
    rows, all given back after the run (the draft model's test's checks)."""
    return run_checked_ids(_target(), prompts, params, **kw)


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    return mixed_prompts(1536, n=n, seed=seed, max_len=100)


def eager_graphs(*runners) -> None:
    """Capture the runners' CUDA graphs with the CPU's eager double of them (EagerGraphCapturer:
    the replay path without a GPU)."""
    from engine.cuda_graph_runner import EagerGraphCapturer

    for r in runners:
        r.use_cuda_graph = True
        r.graph_capturer_factory = lambda device: EagerGraphCapturer()
        r.capture_cuda_graphs()


def graph_replays(model_runner, head_runner) -> dict[str, int]:
    """Replays so far of the model's and the head's decode and verify graphs."""
    return {
        f"{name} {kind}": sum(g.num_replays for g in graphs.graphs.values())
        for name, r in (("model", model_runner), ("head", head_runner))
        for kind in ("graph_runner", "verify_graph_runner")
        if (graphs := getattr(r, kind)) is not None
    }  # fmt: skip


def graph_run(model: str, spec: dict, prompts, params, graphs: bool, **kw):
    """(output ids, each step's proposals, stats, graph replays) of an engine over `model`
    with `spec`, the model's and the head's graphs captured (`eager_graphs`) or not."""
    proposals: list = []
    with Engine(model_path=model, **PLAIN, **kw, **spec) as engine:
        drafter = engine.scheduler.drafter
        runners = (engine.scheduler.model_runner, drafter.runner)
        if graphs:
            eager_graphs(*runners)
        spy_proposals(drafter, proposals)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        stats, replays = engine.get_stats(), graph_replays(*runners)
    return [o["output_ids"] for o in outs], proposals, stats, replays


def spy_proposals(drafter, seen: list) -> None:
    """Append each step's drafts (and with trees their parents) to `seen`."""
    orig = drafter.propose

    def spy(reqs):
        drafts = orig(reqs)
        seen.append(drafts if drafter.last_parents is None else (drafts, drafter.last_parents))
        return drafts

    drafter.propose = spy


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize(("page_size", "chunk"), [(1, 8192), (4, 32)])
def test_greedy_tokens_equal_plain(kind: str, page_size: int, chunk: int, shape: str) -> None:
    """(trees at page size 4: the accepted nodes' K/V moved into whole pages' slots)"""
    prompts = _prompts()
    params = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}
    kw = {"page_size": page_size, "chunked_prefill_size": chunk}
    want, _ = _run(prompts, params, **kw)
    got, stats = _run(prompts, params, **SHAPES[shape](kind, head(kind)), **kw)
    assert got == want
    assert stats["spec_num_drafts"] > 0 and stats["spec_draft_tokens"] > 0, stats


@pytest.mark.parametrize("shape", SHAPES)
def test_seeded_sampling_and_penalties_equal_plain(shape: str) -> None:
    """A draft (a tree's node: after its path) is sampled as the request's token would be
    there: its seeded noise at that step, its penalties over the tokens before, its allowed
    tokens (the drafts obey them)."""
    prompts = _prompts(4, seed=1)
    params = [
        {"temperature": 0.8, "sampling_seed": 7, "max_new_tokens": 16, "ignore_eos": True},
        {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True,
         "repetition_penalty": 1.3, "frequency_penalty": 0.5, "logit_bias": {"5": 3.0}},
        {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True,
         "allowed_token_ids": list(range(100, 400))},
        {"temperature": 1.0, "top_k": 20, "sampling_seed": 3, "max_new_tokens": 16,
         "ignore_eos": True},
    ]  # fmt: skip
    want, _ = _run(prompts, params)
    got, _ = _run(prompts, params, **SHAPES[shape]("eagle3", head("eagle3")))
    assert got == want


def first_mlp_model() -> str:
    """A tiny llama whose first layer's MLP decides its tokens (its attention outputs and its
    second layer's scaled down) and whose final norm is 1, and beside it (`-eagle`) a head
    derived from its first layer (services/tiny_eagle.py), built once."""
    import shutil

    from safetensors.torch import load_file, save_file

    from services.tiny_eagle import make_eagle_head

    base = tiny_model("llama")
    path = base + "-first-mlp-decides"
    if not os.path.exists(os.path.join(path, "config.json")):
        shutil.copytree(base, path)
        file = os.path.join(path, "model.safetensors")
        w = load_file(file)
        for key in list(w):
            # (the head misses the first token: the first layer's attention matters little)
            if key.endswith("o_proj.weight") or (
                key.startswith("model.layers.1.") and key.endswith("down_proj.weight")
            ):
                w[key] = w[key] * 0.02
        w["model.norm.weight"] = torch.ones_like(w["model.norm.weight"])
        save_file(w, file, metadata={"format": "pt"})
        make_eagle_head(path, path + "-eagle", copy_layers=1)
    return path


def test_derived_head_agrees_with_a_model_decided_by_its_first_layers() -> None:
    """Most drafts of a head derived from the model's first layer are accepted, and the
    tokens are plain decoding's."""
    path = first_mlp_model()
    prompts = _prompts()
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    with Engine(model_path=path, **PLAIN) as engine:
        want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    with Engine(model_path=path, **PLAIN, **_spec("eagle", path + "-eagle")) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        stats = engine.get_stats()
    assert [o["output_ids"] for o in outs] == want
    assert stats["spec_accept_length"] > 2.5, stats  # (3.04 of at most 4 when written)


# -- the model's hidden states, and the drafts, against references -----------------------------
def _hf(dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(_target(), dtype=dtype).eval()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_kept_hidden_states_are_transformers(kind: str) -> None:
    from services.tiny_eagle import aux_layers, load_head, model_states

    prompt = _prompts(1, seed=3)[0][:40]
    path = head(kind)
    rows = kept_rows(_target(), _spec(kind, path), prompt)
    _, cfg = load_head(path)
    ids = (getattr(cfg, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = aux_layers(LAYERS, ids) if kind == "eagle3" else None
    with torch.no_grad():
        _, want = model_states(_hf(), torch.tensor(prompt), kind == "eagle3", layers)
    torch.testing.assert_close(rows, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_drafts_are_the_reference_heads(kind: str) -> None:
    """Every request's drafts of every step equal the reference head's chain from the model's
    hidden states of the request's tokens then (float64: no near-ties)."""
    from services.tiny_eagle import aux_layers, head_forward, load_head, model_states

    path = head(kind)
    prompts = _prompts(3, seed=2)
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    kw = {"dtype": torch.float64, "page_size": 4, "chunked_prefill_size": 32}
    proposals = drafted_chains(_target(), _spec(kind, path), prompts, params, **kw)
    assert len(proposals) > 10
    w, cfg = load_head(path)
    eagle3 = kind == "eagle3"
    ids = (getattr(cfg, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = aux_layers(LAYERS, ids) if eagle3 else None
    model = _hf()
    embed = model.get_input_embeddings().weight
    lm = w["lm_head.weight"] if eagle3 else model.get_output_embeddings().weight
    hot = w["d2t"] + torch.arange(len(w["d2t"])) if eagle3 else None
    with torch.no_grad():
        for tokens, drafts in proposals:
            seq = torch.from_numpy(np.asarray(tokens))
            _, hidden = model_states(model, seq, eagle3, layers)
            n = len(seq) - 1  # head positions 0 .. L - 2: tokens 1 .. L - 1, hidden 0 .. L - 2
            ids_in, own, want = seq[1:], None, []
            for _ in drafts:
                logits, out = head_forward(w, cfg, embed, lm, ids_in, hidden[:n],
                                           torch.arange(len(ids_in)), eagle3, own)  # fmt: skip
                best = int(logits[-1].argmax())
                token = int(hot[best]) if hot is not None else best
                want.append(token)
                own = out[n - 1 :] if own is None else torch.cat([own, out[-1:]], 0)
                ids_in = torch.cat([ids_in, torch.tensor([token])])
            assert drafts == want, (len(tokens), drafts, want)


def drafted_chains(model: str, spec: dict, prompts, params, **kw) -> list:
    """(a request's tokens, its drafts) of every step that drafted, over an engine's run."""
    from engine.speculative.scheduling import token_array

    proposals = []
    with Engine(model_path=model, **PLAIN, **kw, **spec) as engine:
        drafter = engine.scheduler.drafter
        orig = drafter.propose

        def spy(reqs):
            tokens = [token_array(r).copy() for r in reqs]
            drafts = orig(reqs)
            proposals.extend(zip(tokens, [list(d) for d in drafts]))
            return drafts

        drafter.propose = spy
        engine.generate(input_ids=prompts, sampling_params=params)
    return [(t, d) for t, d in proposals if d]  # (none in a request's last steps)


# -- configuration ------------------------------------------------------------------------------
def test_bad_configurations_are_refused() -> None:
    from engine.config import EngineArgs
    from engine.speculative import from_vllm_config

    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        EngineArgs(model_path=_target(), speculative_algorithm="EAGLE3")
    args = EngineArgs(model_path=_target(), speculative_algorithm="EAGLE",
                      speculative_draft_model_path=head("eagle"))  # fmt: skip
    assert args.speculative_algorithm == "eagle"
    assert from_vllm_config({"method": "eagle3", "model": "x", "num_speculative_tokens": 2}) == {
        "speculative_algorithm": "eagle3", "speculative_draft_model_path": "x",
        "speculative_num_draft_tokens": 2,
    }  # fmt: skip
    # EAGLE-3 reads three layers' states: a two-layer model has no three distinct ones
    with pytest.raises(ValueError, match="three distinct hidden states"):
        Engine(model_path=tiny_model("llama"), **PLAIN, **_spec("eagle3", head("eagle3")))
    # a model outside the Llama family has no layer loop to read them from
    with pytest.raises(ValueError, match="Llama family"):
        Engine(model_path=tiny_model("gpt2"), **PLAIN, **_spec("eagle3", head("eagle3")))


# -- CUDA graphs (the CPU's eager double of them) ------------------------------------------------
def test_head_decode_graphs_replay_with_the_eager_heads_drafts() -> None:
    """With the model's and the head's graphs (EagerGraphCapturer: the replay path on the
    CPU), the head's decode forwards replay its decode graphs and its catch-ups after a
    request's first its verify graphs (the hidden states through the static buffers, padded
    batches and tokens among them), and the drafts and tokens are the eager run's."""
    # (a random EAGLE head over the two-layer tiny model: the Triton interpreter's forwards
    # cost a third of the six-layer target's, and its drafts depend on the hidden states it
    # reads; two allowed tokens, so that half its drafts are right and catch-ups come both
    # full and padded; an EAGLE-3 head's graphs read the same, with a wider input)
    model = tiny_model("llama")
    path = _random_eagle_head(model)
    prompts = [p[:20] for p in _prompts(3, seed=4)]
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True,
               "allowed_token_ids": [11, 12]} for n in (16, 9, 4)]  # fmt: skip

    kw = {"cuda_graph_bs": (1, 2, 4), "max_total_tokens": 1024, "attention_backend": "triton"}
    want, want_drafts, _, _ = graph_run(model, _spec("eagle", path), prompts, params, False, **kw)
    got, got_drafts, _, replays = graph_run(model, _spec("eagle", path), prompts, params, True,
                                            **kw)  # fmt: skip
    assert got == want
    assert got_drafts == want_drafts
    # (every step has drafts here: the model's steps are all verify steps)
    for kind in ("head graph_runner", "head verify_graph_runner", "model verify_graph_runner"):
        assert replays[kind] > 0, replays


def test_eagle3_graphs_read_the_draft_vocabulary_only() -> None:
    """An EAGLE-3 head with a draft vocabulary: its graph replays return rows as wide as the
    model's vocabulary, of which only the draft's columns are written. Drafts within allowed
    tokens and after a logit bias (over the model's ids) are the eager run's, in the draft
    vocabulary, and the tokens plain decoding's."""
    from services.tiny_eagle import load_head

    path = head("eagle3")
    w, _ = load_head(path)
    hot = (w["d2t"] + torch.arange(len(w["d2t"]))).tolist()
    allowed = hot[10:14]
    prompts = [p[:12] for p in _prompts(2, seed=4)]
    params = [{"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True,
               "allowed_token_ids": allowed},
              {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True,
               "logit_bias": {str(hot[3]): 50.0}}]  # fmt: skip
    kw = {"cuda_graph_bs": (1, 2, 4), "max_total_tokens": 1024, "attention_backend": "triton"}
    want, _ = _run(prompts, params, **kw)

    def run(graphs: bool):
        drafts = []
        with Engine(model_path=_target(), **PLAIN, **kw, **_spec("eagle3", path)) as engine:
            drafter = engine.scheduler.drafter
            if graphs:
                eager_graphs(drafter.runner)
            spy_proposals(drafter, drafts)
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            replays = graph_replays(engine.scheduler.model_runner, drafter.runner)
        return [o["output_ids"] for o in outs], drafts, replays

    got, eager, _ = run(False)
    assert got == want
    got, drafts, replays = run(True)
    assert got == want and drafts == eager and replays["head graph_runner"] > 0
    first = [d for step in drafts for d in step[0]]
    assert first and set(first) <= set(allowed)


def test_no_drafts_where_no_allowed_token_is_in_the_draft_vocabulary() -> None:
    """A request whose allowed tokens are all outside an EAGLE-3 head's draft vocabulary gets
    no drafts (each would be rejected); the others do; plain decoding's tokens."""
    from services.tiny_eagle import load_head

    path = head("eagle3")
    w, _ = load_head(path)
    hot = set((w["d2t"] + torch.arange(len(w["d2t"]))).tolist())
    outside = [t for t in range(100, 1536) if t not in hot][:3]
    prompts = _prompts(2, seed=9)
    params = [{"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True,
               "allowed_token_ids": outside},
              {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}]  # fmt: skip
    want, _ = _run(prompts, params)
    proposals: list = []
    with Engine(model_path=_target(), **PLAIN, **_spec("eagle3", path)) as engine:
        drafter = engine.scheduler.drafter
        spy_proposals(drafter, proposals)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert not drafter.undraftable  # (forgotten once finished)
    assert [o["output_ids"] for o in outs] == want
    assert all(not step[0] for step in proposals) and any(step[1] for step in proposals)


# -- memory -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_tight_memory_retraction_and_grammar(monkeypatch: pytest.MonkeyPatch, shape: str) -> None:
    """A head pool too small for every request (some get no drafts; a tree none past its first
    level), a model pool that retracts running requests (their slots, and the hidden states
    kept by them, recomputed when they come back), a grammar request and mixed chunks: plain
    decoding's tokens, and nothing leaks (the head's slots and rows, trees' leaves' too)."""
    from engine.speculative import eagle

    monkeypatch.setattr(eagle, "draft_pool_tokens", lambda tokens, args: 200)
    prompts = _prompts(8, seed=2)
    params = [{"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True} for _ in prompts]
    params[2] = {"temperature": 0.0, "max_new_tokens": 40, "regex": "(ab|cd){3,9}"}
    kw = {"max_total_tokens": 400, "init_new_token_ratio": 0.05, "chunked_prefill_size": 64,
          "enable_mixed_chunk": True}  # fmt: skip
    want, _ = _run(prompts, params, **kw)
    got, stats = _run(prompts, params, **SHAPES[shape]("eagle3", head("eagle3")), **kw)
    assert got == want
    assert stats["num_retractions"] > 0 and stats["draft_memory_drops"] > 0, stats


def test_memory_released_with_the_model_and_taken_back() -> None:
    """Released while idle, the model's K/V goes with the hidden states kept by its slots, and
    the head's weights and K/V with them; resumed, requests decode plain decoding's tokens."""
    prompts = _prompts(3, seed=6)
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    want, _ = _run(prompts, params)
    with Engine(model_path=_target(), **PLAIN, **_spec("eagle", head("eagle"))) as engine:
        sched = engine.scheduler
        model, draft = sched.model_runner, sched.drafter.runner
        held, draft_held = model.memory_occupied(), draft.memory_occupied()
        capture = model.hidden_capture.buffer
        assert held["kv_cache"] >= capture.numel() * capture.element_size() > 0
        engine.generate(input_ids=prompts, sampling_params=params)
        sched.release_memory_occupation()
        assert model.memory_occupied()["kv_cache"] == 0
        assert draft.memory_occupied() == {"weights": 0, "kv_cache": 0}
        sched.resume_memory_occupation()
        assert model.memory_occupied() == held and draft.memory_occupied() == draft_held
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == want



def _random_eagle_head(model: str) -> str:
    from services.tiny_eagle import make_eagle_head

    out = model + "-eagle-random"
    if not os.path.exists(os.path.join(out, "config.json")):
        make_eagle_head(model, out)
    return out


@pytest.mark.parametrize("draft_lens", [[3, 3], [1, 3, 0]], ids=["full", "padded"])
def test_head_verify_graphs_replay_its_eager_catch_up(draft_lens: list[int]) -> None:
    """A catch-up of the head replayed from its verify graphs (every request at the graphs'
    width, or padded tokens and a padded request) gives the eager forward's logits and output
    hidden states, from the same hidden-state input."""
    from tests.runner_batches import eager_forward, kv_restore, kv_snapshot, verify_batch

    model = tiny_model("llama")
    with Engine(model_path=model, **PLAIN, cuda_graph_bs=(1, 2, 4), max_total_tokens=1024,
                attention_backend="triton", **_spec("eagle", _random_eagle_head(model))) as eng:
        runner = eng.scheduler.drafter.runner
        eager_graphs(runner)
        n = len(draft_lens)
        fb = verify_batch(runner, list(range(1, n + 1)), [7, 12, 3][:n], draft_lens, seed=5)
        gen = torch.Generator().manual_seed(0)
        fb.spec_hidden = torch.randn(fb.num_tokens, runner.model.catchup_hidden_width,
                                     generator=gen)  # fmt: skip
        want, _ = eager_forward(runner, fb)
        want_hidden = fb.spec_hidden_out.clone()
        saved = kv_snapshot(runner)
        fb.spec_hidden_out = None
        got = runner.forward(fb).float()
        kv_restore(runner, saved)
        assert sum(g.num_replays for g in runner.verify_graph_runner.graphs.values()) == 1
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fb.spec_hidden_out, want_hidden, atol=1e-4, rtol=1e-4)


# -- tensor parallelism ----------------------------------------------------------------------------
def test_over_two_ranks() -> None:
    """The model over two ranks (rank 0 keeps the hidden states, which every rank has whole),
    the head whole on rank 0's device with the model's embedding and lm_head read whole from
    its checkpoint: a derived EAGLE head's drafts are accepted as on one rank, and a random
    EAGLE-3 head's tokens are plain decoding's."""
    prompts = _prompts(4, seed=7)
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    path = first_mlp_model()
    spec = _spec("eagle", path + "-eagle")
    with Engine(model_path=path, **PLAIN) as eng:
        want = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    with Engine(model_path=path, **PLAIN, tp_size=2, **spec) as eng:
        got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
        stats = eng.get_stats()
        assert eng.scheduler.drafter.runner.tp.size == 1
    assert got == want
    assert stats["spec_accept_length"] > 2.5, stats
    want, _ = _run(prompts, params)
    got, stats = _run(prompts, params, tp_size=2, **_spec("eagle3", head("eagle3")))
    assert got == want and stats["spec_num_drafts"] > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_gpu_kv_budget_counts_the_kept_hidden_states(monkeypatch: pytest.MonkeyPatch, tp: int):
    """On a GPU the model's KV budget leaves room for the head (its weights, its pool) and for
    the hidden states kept per slot (three of the model's width a token for EAGLE-3), and
    with tensor parallelism for rank 0's whole copy of the embedding and lm_head."""
    from engine.config import EngineArgs, ModelConfig
    from engine.mem_cache.kv_memory import plan_kv_memory
    from engine.mem_cache.kv_pool import KVPool

    path, draft = _target(), head("eagle3")
    free, total = 3 << 30, 4 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    mc, hc = ModelConfig.from_pretrained(path), ModelConfig.from_pretrained(draft)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    args = EngineArgs(model_path=path, tp_size=tp, max_running_requests=64,
                      **_spec("eagle3", draft))  # fmt: skip
    tokens = plan_kv_memory(mc, args, dtype, dev).tokens
    usable = free - total * (1 - args.mem_fraction_static)
    per_token = KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
    head_per_token = KVPool.bytes_per_token(hc.num_layers, hc.num_kv_heads, hc.head_dim, dtype)
    hidden_per_token = 3 * mc.hidden_size * 2
    fixed = os.path.getsize(os.path.join(draft, "model.safetensors")) + 64 * K * head_per_token
    if tp > 1:
        fixed += 2 * mc.vocab_size * mc.hidden_size * 2
    want = int((usable - fixed) // (per_token + head_per_token + hidden_per_token))
    assert tokens == want // args.page_size * args.page_size


# -- hierarchical cache -------------------------------------------------------------------------
def test_prefixes_loaded_from_host_memory_bring_their_hidden_states() -> None:
    """With the hierarchical cache, a document evicted to host memory comes back with the
    hidden states kept by its slots (they go to the host and back with its K/V): the head
    reads transformers' states for every position, loaded ones included (float64), and the
    tokens are a plain radix cache's."""
    from services.tiny_eagle import model_states
    from tests.integration.test_hicache import GREEDY, documents

    docs = documents(6, vocab=1000)
    prompts = [doc + [10 + r, 11 + i, 12] for r in range(2) for i, doc in enumerate(docs)]
    kw = {"dtype": torch.float64, "max_total_tokens": 640, "chunked_prefill_size": 128}

    def rounds(hicache: bool):
        seen = []  # (request's tokens, the hidden rows of its positions) at its first step
        with Engine(model_path=_target(), **PLAIN, **kw, enable_hierarchical_cache=hicache,
                    hicache_ratio=4.0, **_spec("eagle", head("eagle"))) as engine:  # fmt: skip
            sched = engine.scheduler
            orig, done = sched.drafter.propose, set()

            def spy(reqs):
                from engine.speculative.scheduling import token_array

                for r in reqs:
                    if r.rid not in done:
                        done.add(r.rid)
                        tokens = token_array(r).copy()
                        table = sched.model_runner.req_to_token_pool.req_to_token
                        slots = table[r.req_pool_idx, : len(tokens) - 1].to(torch.int64)
                        seen.append((tokens, sched.model_runner.hidden_capture.rows(slots)))
                return orig(reqs)

            sched.drafter.propose = spy
            outs = [engine.generate(input_ids=[p], sampling_params=GREEDY)[0]["output_ids"]
                    for p in prompts]  # fmt: skip
            return outs, seen, engine.get_stats()

    want, _, _ = rounds(False)
    got, seen, stats = rounds(True)
    assert got == want
    assert stats["hicache_loaded_tokens"] >= 5 * 200, stats
    model = _hf()
    with torch.no_grad():
        for tokens, rows in seen[6:]:  # (the second round: documents loaded from the host)
            _, states = model_states(model, torch.from_numpy(tokens[:-1]), False, None)
            torch.testing.assert_close(rows, states, rtol=1e-9, atol=1e-9)


# -- token maps (FR-Spec) ------------------------------------------------------------------------
def test_token_map_restricts_the_heads_vocabulary(tmp_path) -> None:
    """`speculative_token_map` (SGLang's FR-Spec map): the head drafts over the map's tokens
    only, mapped back to the model's ids. A map of every token in reverse order drafts what
    the head drafts without one (same argmax, other columns); a map of a subset drafts from
    it only; the tokens are plain decoding's; bad maps are refused with the reason."""
    path = first_mlp_model()
    prompts = _prompts(4, seed=8)
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    vocab = 1536
    everything, subset = tmp_path / "all.pt", tmp_path / "subset.json"
    torch.save(torch.arange(vocab - 1, -1, -1), everything)
    subset.write_text(str(list(range(0, vocab, 3))))

    def run(**kw):
        proposals = []
        with Engine(model_path=path, **PLAIN, **_spec("eagle", path + "-eagle"), **kw) as eng:
            drafter = eng.scheduler.drafter
            orig = drafter.propose
            drafter.propose = lambda reqs: proposals.append(orig(reqs)) or proposals[-1]
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            stats = eng.get_stats()
        return [o["output_ids"] for o in outs], proposals, stats

    want, base, stats = run()
    assert stats["spec_accept_length"] > 2.0, stats
    got, drafts, _ = run(speculative_token_map=str(everything))
    assert got == want and drafts == base
    got, drafts, _ = run(speculative_token_map=str(subset))
    assert got == want
    made = {t for step in drafts for d in step for t in d}
    assert made and all(t % 3 == 0 for t in made)
    bad = tmp_path / "bad.json"
    for text, why in (("[1, 1]", "repeated"), (f"[{vocab}]", "outside"), ("[[1, 2]]", "1-D"),
                      ("{}", "not a list of token ids")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=why):
            Engine(model_path=path, **PLAIN, **_spec("eagle", path + "-eagle"),
                   speculative_token_map=str(bad))  # fmt: skip
    from engine.config import EngineArgs

    with pytest.raises(ValueError, match="not 'eagle3'"):
        EngineArgs(model_path=_target(), **_spec("eagle3", head("eagle3")),
                   speculative_token_map=str(subset))  # fmt: skip


def test_eagle3_over_deepseek_v3() -> None:
    """An EAGLE-3 head over DeepSeek-V3 (SGLang captures its layers for EAGLE-3 heads, as
    for Kimi-K2's): the model keeps the residual stream entering three of its layers, which
    equals transformers' (float64), and the tokens are plain decoding's."""
    from transformers import AutoModelForCausalLM

    from services.tiny_eagle import aux_layers, load_head, make_eagle_head, model_states
    from services.tiny_model import make_tiny_model

    target = os.path.join(os.path.dirname(tiny_model("llama")), f"deepseek_v3-{LAYERS}")
    if not os.path.exists(os.path.join(target, "config.json")):
        make_tiny_model(target, "deepseek_v3", num_layers=LAYERS)
    path = target + "-eagle3"
    if not os.path.exists(os.path.join(path, "config.json")):
        make_eagle_head(target, path, eagle3=True, draft_vocab=512)
    prompts = _prompts(4, seed=5)
    params = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
    want, _ = run_checked_ids(target, prompts, params)
    got, stats = run_checked_ids(target, prompts, params, **_spec("eagle3", path))
    assert got == want and stats["spec_num_drafts"] > 0
    prompt = prompts[0][:30]
    rows = kept_rows(target, _spec("eagle3", path), prompt)
    _, cfg = load_head(path)
    layers = aux_layers(LAYERS, cfg.eagle_config["eagle_aux_hidden_state_layer_ids"])
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64,
                                              experts_implementation="eager").eval()  # fmt: skip
    with torch.no_grad():
        _, states = model_states(hf, torch.tensor(prompt), True, layers)
    torch.testing.assert_close(rows, states, rtol=1e-9, atol=1e-9)


def kept_rows(model: str, spec: dict, prompt: list[int]) -> torch.Tensor:
    """The hidden states the model keeps for the prompt's positions, read at the request's
    first decode step (float64)."""
    seen = {}
    with Engine(model_path=model, dtype=torch.float64, **PLAIN, **spec) as engine:
        sched = engine.scheduler
        orig = sched.drafter.propose

        def spy(reqs):
            if not seen:
                table = sched.model_runner.req_to_token_pool.req_to_token
                slots = table[reqs[0].req_pool_idx, : len(prompt)].to(torch.int64)
                seen["rows"] = sched.model_runner.hidden_capture.rows(slots).clone()
            return orig(reqs)

        sched.drafter.propose = spy
        engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 3,
                                                             "temperature": 0.0})
    return seen["rows"]


def run_checked_ids(model: str, prompts, params, **kw):
    """(output ids, stats) of an engine over `model`, overlap off, with the draft model
    test's checks after the run."""
    from tests.integration.test_speculative_draft_model import _run as run_checked

    outs, stats = run_checked(model, prompts, params, **PLAIN, **kw)
    return [o["output_ids"] for o in outs], stats
