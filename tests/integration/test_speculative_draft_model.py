"""Speculative decoding with a draft model (`speculative_algorithm="standalone"`): the tokens
are plain decoding's whatever the draft model is (the model itself, a perturbed copy that
agrees on part of the tokens, an unrelated model); a draft model equal to the model has every
draft accepted (its K/V caught up exactly: prompts in chunks, the accepted drafts, the token
after them); the draft's K/V comes back when requests finish, are retracted, or do not fit."""

from __future__ import annotations

import os

import pytest

from engine.engine import Engine
from tests.factories import assert_engine_clean, mixed_prompts, model_path, tiny_model

PLAIN = {"disable_overlap_schedule": True}
K = 4


def _spec(draft: str, k: int = K) -> dict:
    return {"speculative_algorithm": "standalone", "speculative_draft_model_path": draft,
            "speculative_num_draft_tokens": k}  # fmt: skip


def noisy_draft(path: str, noise: float = 0.02, num_layers: int | None = None) -> str:
    """The model at `path` with relative weight noise (and maybe fewer layers), built once:
    a draft that agrees with it on part of the tokens (about half at 0.02 on tiny llama)."""
    from services.tiny_draft import make_draft_model

    out = f"{path}-draft-n{noise}-l{num_layers}"
    if not os.path.exists(os.path.join(out, "config.json")):
        make_draft_model(path, out, num_layers, noise)
    return out


def _run(path: str, prompts, params, **kw):
    with Engine(model_path=path, **kw) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        stats = engine.get_stats()
        assert_engine_clean(engine)
        drafter = engine.scheduler.drafter
        if drafter is not None:  # every request finished: the draft's K/V and rows are back
            runner = drafter.runner
            assert not drafter.drafts
            assert runner.allocator.available_size() == runner.allocator.size
            assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size
            stats["draft_memory_drops"] = drafter.memory_drops
    return outs, stats


def _prompts(path: str, n: int = 8, seed: int = 0) -> list[list[int]]:
    from engine.config import ModelConfig

    return mixed_prompts(ModelConfig.from_pretrained(path).vocab_size, n=n, seed=seed, max_len=120)


def _ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize(("page_size", "chunk"), [(1, 8192), (4, 32)])
def test_greedy_tokens_equal_plain_whatever_the_draft(page_size: int, chunk: int) -> None:
    path = tiny_model("llama")
    prompts = _prompts(path)
    params = {"temperature": 0.0, "max_new_tokens": 30, "ignore_eos": True}
    kw = {"page_size": page_size, "chunked_prefill_size": chunk}
    want, _ = _run(path, prompts, params, **PLAIN, **kw)
    # the model as its own draft: every draft is right (30 tokens in about 30 / 5 steps)
    got, stats = _run(path, prompts, params, **_spec(path), **kw)
    assert _ids(got) == _ids(want)
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0, stats
    assert stats["spec_accept_length"] > K, stats
    # a perturbed copy: some drafts accepted, some rejected
    got, stats = _run(path, prompts, params, **_spec(noisy_draft(path)), **kw)
    assert _ids(got) == _ids(want)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    # an unrelated model of the same vocabulary: still plain decoding's tokens
    got, _ = _run(path, prompts[:4], params, **_spec(tiny_model("llama", seed=1)), **kw)
    assert _ids(got) == _ids(want[:4])


@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_seeded_sampling_penalties_and_logprobs_equal_plain(topk: int) -> None:
    """Seeded sampling, penalties, min_new_tokens and logprobs: each request's tokens,
    logprobs and top logprobs are plain decoding's, with chained drafts or draft trees (the
    rows of the accepted path's nodes; engine/speculative/tree.py)."""
    path = tiny_model("llama")
    prompts = _prompts(path, seed=1)
    params = [
        {"temperature": 0.7, "sampling_seed": 7 + i, "max_new_tokens": 32, "return_logprob": True,
         "top_logprobs_num": 2, "frequency_penalty": 0.3 * (i % 2), "top_p": 0.9,
         "min_new_tokens": 20 if i == 3 else 0, "ignore_eos": i != 5}
        for i in range(len(prompts))
    ]  # fmt: skip
    params[6]["temperature"] = 0.0
    want, _ = _run(path, prompts, params, **PLAIN)
    tree = {"speculative_eagle_topk": 2, "speculative_num_steps": 3} if topk > 1 else {}
    got, stats = _run(path, prompts, params, **_spec(noisy_draft(path), k=6 if tree else 3),
                      **tree)  # fmt: skip
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        gl, wl = g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"]
        assert max(abs(a[0] - b[0]) for a, b in zip(gl, wl, strict=True)) < 1e-4
        gt, wt = g["meta_info"]["output_top_logprobs"], w["meta_info"]["output_top_logprobs"]
        assert [[e[1] for e in x] for x in gt] == [[e[1] for e in x] for x in wt]


def test_finish_conditions_and_a_smaller_draft() -> None:
    """A two-layer model drafted by its first layer (perturbed): max_new_tokens, a stop string
    found in plain decoding's output and EOS end the output where plain decoding does."""
    path = tiny_model("llama")
    draft = noisy_draft(path, noise=0.01, num_layers=1)
    prompts = _prompts(path, n=6, seed=3)
    base = {"temperature": 0.0, "ignore_eos": True}
    want, _ = _run(path, prompts, {**base, "max_new_tokens": 40}, **PLAIN)
    with Engine(model_path=path, **PLAIN) as engine:
        stops = [engine.tokenizer.decode(w["output_ids"][9:11]) for w in want]
    params = [{**base, "max_new_tokens": 7 + i} for i in range(3)]
    params += [{**base, "max_new_tokens": 40, "stop": [s]} for s in stops[3:5]]
    params += [{"temperature": 0.0, "max_new_tokens": 40}]  # (EOS, if it comes)
    plain, _ = _run(path, prompts, params, **PLAIN)
    got, stats = _run(path, prompts, params, **_spec(draft))
    assert _ids(got) == _ids(plain)
    assert [g["meta_info"]["finish_reason"] for g in got] == [
        p["meta_info"]["finish_reason"] for p in plain
    ]
    assert [len(g["output_ids"]) for g in got[:3]] == [7, 8, 9]
    assert stats["spec_accepted_tokens"] > 0


def test_drafts_obey_allowed_tokens_and_logit_bias() -> None:
    """The draft's greedy choice takes each request's allowed_token_ids and logit_bias (its
    fixed constraints), so the model as its own draft still has every draft accepted."""
    path = tiny_model("llama")
    prompts = _prompts(path, n=4, seed=5)
    base = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    params = [{**base, "allowed_token_ids": [11, 12, 13]},
              {**base, "logit_bias": {"500": 100.0}},
              {**base, "allowed_token_ids": [20, 21], "logit_bias": {"21": -3.0}},
              base]  # fmt: skip
    want, _ = _run(path, prompts, params, **PLAIN)
    got, stats = _run(path, prompts, params, **_spec(path))
    assert _ids(got) == _ids(want)
    assert set(got[0]["output_ids"]) <= {11, 12, 13} and set(got[2]["output_ids"]) <= {20, 21}
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0, stats


def test_tight_memory_retraction_and_grammar(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft pool too small for every request (some get no drafts, their draft K/V given
    back), a model pool that retracts running requests, a grammar request (no drafts) and
    mixed chunks: the tokens are still plain decoding's, and nothing leaks."""
    from engine.speculative import draft_runner

    monkeypatch.setattr(draft_runner, "draft_pool_tokens", lambda tokens, args: 200)
    path = tiny_model("llama")
    prompts = _prompts(path, n=8, seed=2)
    params = [{"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True} for _ in prompts]
    params[2] = {"temperature": 0.0, "max_new_tokens": 40, "regex": "(ab|cd){3,9}"}
    kw = {"max_total_tokens": 400, "init_new_token_ratio": 0.05, "chunked_prefill_size": 64,
          "enable_mixed_chunk": True}  # fmt: skip
    want, _ = _run(path, prompts, params, **PLAIN, **kw)
    got, stats = _run(path, prompts, params, **_spec(path), **kw)
    assert _ids(got) == _ids(want)
    assert stats["num_retractions"] > 0 and stats["draft_memory_drops"] > 0, stats
    assert stats["spec_accepted_tokens"] > 0
    text = got[2]["text"]
    assert len(text) >= 6 and set(text) <= set("abcd"), text


@pytest.mark.parametrize("name", ["mistral-sliding", "qwen3"])
def test_other_architectures_draft_themselves(name: str) -> None:
    """Sliding-window attention (over hybrid window memory for the model; the draft keeps
    full K/V) and Qwen3's q/k norms: the model as its own draft accepts every draft."""
    path = model_path(name)
    prompts = _prompts(path, n=6)
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    kw = {"hybrid_swa_memory": True} if name == "mistral-sliding" else {}
    want, _ = _run(path, prompts, params, **PLAIN, **kw)
    got, stats = _run(path, prompts, params, **_spec(path), **kw)
    assert _ids(got) == _ids(want)
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0, stats


def test_arguments_are_checked() -> None:
    path = tiny_model("llama")
    for bad, why in [
        ({"speculative_algorithm": "standalone"}, "needs speculative_draft_model_path"),
        ({"speculative_draft_model_path": path}, "needs speculative_algorithm"),
        ({"speculative_algorithm": "ngram", "speculative_draft_model_path": path},
         "is for .*'standalone'"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            Engine(model_path=path, **bad)
    # vLLM's name for it
    with Engine(model_path=path, speculative_algorithm="draft_model",
                speculative_draft_model_path=path) as engine:  # fmt: skip
        assert engine.args.speculative_algorithm == "standalone"


def test_draft_state_follows_the_requests_tokens() -> None:
    """Whatever the request's tokens became since the last drafts (some drafts accepted, or
    tokens that differ from the drafts from the first on), the draft's K/V of every position
    is then that of a draft model that never saw the request (recomputed from scratch), and
    so are the next drafts."""
    import torch

    from engine.sampling.sampling_params import SamplingParams
    from engine.scheduler.req import Req

    path = tiny_model("llama")
    prompt = _prompts(path, n=1, seed=4)[0]
    with Engine(model_path=path, **_spec(noisy_draft(path))) as engine:
        drafter = engine.scheduler.drafter
        runner = drafter.runner

        def keys(req: Req) -> torch.Tensor:
            """The draft's keys of the request's positions, every layer."""
            state = drafter.drafts[req.rid]
            assert state.confirmed == req.seqlen
            slots = runner.req_to_token_pool.req_to_token[state.row, : req.seqlen].long()
            return torch.stack([k[slots] for k in runner.kv_pool.k_buffer])

        req = Req("a", list(prompt), SamplingParams(max_new_tokens=100))
        drafts = drafter.propose([req])[0]
        assert len(drafts) == K and drafter.drafts["a"].length == len(prompt) + K - 1
        other = (drafts[0] + 1) % 1000
        extend, extends = drafter._extend, []

        def recording(group):  # the positions each catch-up extend computes
            extends.append([(start, end) for _, _, start, end in group])
            return extend(group)

        drafter._extend = recording
        # (K/V computed again from: the first rejected draft, the first token, the last)
        for new, redo in (([*drafts[:2], other], 2), ([other, *drafts[1:3]], 0), ([other], 0)):
            start = req.seqlen
            req.output_ids.extend(new)
            extends.clear()
            drafts, kept = drafter.propose([req])[0], keys(req)
            assert extends == [[(start + redo, req.seqlen)]], (new, extends)
            drafter.forget(req)
            assert drafter.propose([req])[0] == drafts, new
            torch.testing.assert_close(keys(req), kept, rtol=0, atol=1e-4)  # (float32 rounding)
        drafter.forget(req)
        assert runner.allocator.available_size() == runner.allocator.size


def test_requests_with_fewer_drafts_keep_their_draft_kv() -> None:
    """Drafted in one batch with a request that makes more drafts, a request with room for
    two only (near its max_new_tokens) sits out the last decode forwards without touching
    its K/V: once its drafts are accepted and it goes on, the draft's K/V of its positions is
    a from-scratch recompute's, and so are its next drafts."""
    import torch

    from engine.sampling.sampling_params import SamplingParams
    from engine.scheduler.req import Req

    path = tiny_model("llama")
    short_prompt, long_prompt = _prompts(path, n=2, seed=6)
    with Engine(model_path=path, **_spec(noisy_draft(path))) as engine:
        drafter = engine.scheduler.drafter
        runner = drafter.runner
        short = Req("s", list(short_prompt), SamplingParams(max_new_tokens=4))
        short.output_ids.append(7)  # one token made, three to go: room for two drafts
        other = Req("o", list(long_prompt), SamplingParams(max_new_tokens=100))
        assert [drafter.room(short), drafter.room(other)] == [2, K]
        drafts = drafter.propose([short, other])
        assert [len(d) for d in drafts] == [2, K]
        short.output_ids.extend(drafts[0])  # every draft accepted, and the request goes on
        short.sampling_params.max_new_tokens = 100
        next_drafts = drafter.propose([short])[0]
        state = drafter.drafts["s"]
        slots = runner.req_to_token_pool.req_to_token[state.row, : short.seqlen].long()
        kept = torch.stack([k[slots] for k in runner.kv_pool.k_buffer])
        drafter.forget(short)
        assert drafter.propose([short])[0] == next_drafts
        state = drafter.drafts["s"]
        slots = runner.req_to_token_pool.req_to_token[state.row, : short.seqlen].long()
        fresh = torch.stack([k[slots] for k in runner.kv_pool.k_buffer])
        torch.testing.assert_close(kept, fresh, rtol=0, atol=1e-4)
        drafter.forget(short)
        drafter.forget(other)
        assert runner.allocator.available_size() == runner.allocator.size


def test_gpu_kv_budget_leaves_room_for_the_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the model's KV pool is sized from free memory x mem_fraction_static less the
    draft's weights (its checkpoint's size) and its pool (as many tokens, plus k per running
    request), so both fit where the model alone would have taken it all."""
    import torch

    from engine.config import EngineArgs, ModelConfig
    from engine.mem_cache.kv_memory import plan_kv_memory
    from engine.mem_cache.kv_pool import KVPool

    path, draft = tiny_model("llama"), noisy_draft(tiny_model("llama"), 0.02, num_layers=1)
    free, total = 3 << 30, 4 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    mc = ModelConfig.from_pretrained(path)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    alone = plan_kv_memory(mc, EngineArgs(model_path=path), dtype, dev).tokens
    args = EngineArgs(model_path=path, **_spec(draft), max_running_requests=64)
    tokens = plan_kv_memory(mc, args, dtype, dev).tokens
    usable = free - total * (1 - args.mem_fraction_static)
    per_token = KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
    dmc = ModelConfig.from_pretrained(draft)
    draft_per_token = KVPool.bytes_per_token(dmc.num_layers, dmc.num_kv_heads, dmc.head_dim, dtype)
    weights = os.path.getsize(os.path.join(draft, "model.safetensors"))
    assert alone == int(usable // per_token)
    extra = 64 * K * draft_per_token
    assert tokens == int((usable - weights - extra) // (per_token + draft_per_token))
    assert tokens * per_token + weights + (tokens * draft_per_token + extra) <= usable


@pytest.mark.parametrize("backup", [True, False], ids=["backup", "discard"])
def test_memory_released_with_the_model_and_taken_back(backup: bool) -> None:
    """Requests retracted mid-run (their draft K/V still held), the memory released: the
    draft's weights and K/V go too and its requests' draft K/V is forgotten; resumed, the
    requests end with plain decoding's tokens, the model as its own draft right every time
    (the draft's weights read again where they were discarded, its K/V recomputed)."""
    from tests.integration.test_pause import GREEDY, Run, three_each

    path = tiny_model("llama")
    prompts = _prompts(path, n=4, seed=6)
    want, _ = _run(path, prompts, GREEDY, **PLAIN)
    eng = Engine(model_path=path, enable_weights_cpu_backup=backup, **_spec(path))
    try:
        run, sched = Run(eng, prompts), eng.scheduler
        draft = sched.drafter.runner
        held = draft.memory_occupied()
        run.step_until(three_each)
        assert sched.drafter.drafts and sched.drafter.stats.num_drafts > 0
        assert sched.retract_all() == len(prompts)
        sched.release_memory_occupation()
        assert not sched.drafter.drafts
        assert draft.memory_occupied() == {"weights": 0, "kv_cache": 0}
        sched.resume_memory_occupation()
        assert draft.memory_occupied() == held
        run.to_end()
        stats = eng.get_stats()
    finally:
        eng.shutdown()
    assert [run.tokens[f"r{i}"] for i in range(len(prompts))] == _ids(want)
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0, stats
