"""Speculative decoding (n-gram drafts): the tokens are those of plain decoding, token for
token, for greedy and seeded requests, whatever is accepted; the KV of rejected drafts comes
back; finish conditions cut a step's tokens where they apply."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from tests.factories import assert_engine_clean, mixed_prompts, model_path, tiny_lora, tiny_model

PLAIN = {"disable_overlap_schedule": True}
SPEC = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}
# draft trees (engine/speculative/tree.py): the continuations of 3 matches, 8 nodes, depth 4
TREE = {**SPEC, "speculative_num_draft_tokens": 8, "speculative_eagle_topk": 3,
        "speculative_num_steps": 4}  # fmt: skip
# few allowed tokens: the output repeats itself, drafts are found and partly accepted
LOOPY = {"allowed_token_ids": [11, 12, 13], "ignore_eos": True}


def _run(path: str, prompts, params, **kw):
    with Engine(model_path=path, **kw) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        stats = engine.get_stats()
        assert_engine_clean(engine)
    return outs, stats


def _prompts(path: str, n: int = 8, seed: int = 0) -> list[list[int]]:
    from engine.config import ModelConfig

    return mixed_prompts(ModelConfig.from_pretrained(path).vocab_size, n=n, seed=seed, max_len=120)


def _drafts_used(stats: dict) -> None:
    """Drafts were proposed, some accepted and some rejected: both paths ran."""
    assert stats["spec_num_drafts"] > 0
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats


@pytest.mark.parametrize("name", ["llama", "mistral-sliding", "gemma3_text", "qwen3"])
def test_greedy_tokens_equal_plain_decoding(name: str) -> None:
    path = model_path(name)
    prompts = _prompts(path)
    params = {"temperature": 0.0, "max_new_tokens": 48, **LOOPY}
    want, _ = _run(path, prompts, params, **PLAIN)
    got, stats = _run(path, prompts, params, **SPEC)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    _drafts_used(stats)
    assert stats["generation_tokens"] == 48 * len(prompts)
    # free-running text too (drafts are mostly rejected there)
    free = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
    want, _ = _run(path, prompts[:4], free, **PLAIN)
    got, _ = _run(path, prompts[:4], free, **SPEC)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_trees_equal_plain_decoding_and_accept_more(name: str) -> None:
    """N-gram trees: greedy tokens are plain decoding's, and on looping outputs (three allowed
    tokens: several continuations of the same suffix) the tree of three matches accepts
    more a step than the chain of the latest one."""
    path = model_path(name)
    prompts = _prompts(path)
    params = {"temperature": 0.0, "max_new_tokens": 48, **LOOPY}
    want, _ = _run(path, prompts, params, **PLAIN)
    _, chain = _run(path, prompts, params, **SPEC)
    got, tree = _run(path, prompts, params, **TREE)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    _drafts_used(tree)
    assert tree["spec_accept_length"] > chain["spec_accept_length"], (tree, chain)


@pytest.mark.parametrize(("name", "kw"), [
    ("mistral-sliding", {"attention_backend": "torch_native", "page_size": 4}),
    ("gemma3_text", {"attention_backend": "torch_native", "hybrid_swa_memory": True,
                     "swa_full_tokens_ratio": 0.1, "max_total_tokens": 6400,
                     "chunked_prefill_size": 128}),
], ids=["mistral-page4", "gemma3-hybrid-memory"])  # fmt: skip
def test_trees_in_sliding_windows_equal_plain_decoding(name: str, kw: dict) -> None:
    """N-gram trees over models with sliding-window layers (prompts up to 120 tokens, windows
    of 32): a node's window is by its position (the prefix plus its depth), and accepted
    nodes moved to their path's slots move in the window pool too (hybrid memory: a window
    pool a tenth of the full one, so its slots are not the full slots). Tokens and logprobs
    are plain decoding's. (The Triton kernel's window by position is checked against the
    reference through the backend: tests/unit/test_speculative_tree.py.)"""
    path = model_path(name)
    prompts = _prompts(path)
    params = {"temperature": 0.0, "max_new_tokens": 32, "return_logprob": True, **LOOPY}
    want, _ = _run(path, prompts, params, **PLAIN, **kw)
    got, stats = _run(path, prompts, params, **TREE, **kw)
    _drafts_used(stats)
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        gl, wl = g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"]
        assert max(abs(a[0] - b[0]) for a, b in zip(gl, wl)) < 1e-4


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_seeded_sampling_penalties_and_logprobs_equal_plain(page_size: int, shape: str) -> None:
    """Each position is sampled as that token would be: same seeded noise, penalties over
    the output plus the drafts before it, min_new_tokens at its step, its logprob."""
    path = tiny_model("llama")
    prompts = _prompts(path, seed=1)
    params = [
        {"temperature": 0.8, "sampling_seed": 7 + i, "max_new_tokens": 40, "return_logprob": True,
         "top_logprobs_num": 2, "frequency_penalty": 0.3 * (i % 2), "top_p": 0.9,
         "min_new_tokens": 30 if i == 3 else 0, **LOOPY, "allowed_token_ids": [11, 12, 13, 14]}
        for i in range(len(prompts))
    ]  # fmt: skip
    params[5]["allowed_token_ids"] = None  # free text beside the loops
    params[6]["temperature"] = 0.0
    kw = {"page_size": page_size}
    want, _ = _run(path, prompts, params, **PLAIN, **kw)
    got, stats = _run(path, prompts, params, **(SPEC if shape == "chain" else TREE), **kw)
    _drafts_used(stats)
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        gl, wl = g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"]
        assert [e[1] for e in gl] == [e[1] for e in wl]
        assert max(abs(a[0] - b[0]) for a, b in zip(gl, wl)) < 1e-4
        gt, wt = g["meta_info"]["output_top_logprobs"], w["meta_info"]["output_top_logprobs"]
        assert [[e[1] for e in x] for x in gt] == [[e[1] for e in x] for x in wt]


def test_finish_conditions_cut_a_steps_tokens() -> None:
    """A forced token makes every draft right: max_new_tokens, a stop token after
    min_new_tokens and a stop string end the output exactly where plain decoding does."""
    path = tiny_model("llama")
    prompt = _prompts(path, n=1)[0]
    forced = {"temperature": 0.0, "ignore_eos": True, "logit_bias": {"500": 100.0}}
    cases = [
        {**forced, "max_new_tokens": 7},
        {**forced, "max_new_tokens": 30, "stop_token_ids": [500], "min_new_tokens": 6},
        {**forced, "max_new_tokens": 30},
    ]
    outs = {}
    for name, mode in (("plain", PLAIN), ("spec", SPEC)):
        with Engine(model_path=path, **mode) as engine:
            text = engine.tokenizer.decode([500] * 3)
            runs = [*cases, {**forced, "max_new_tokens": 30, "stop": [text]}]
            outs[name] = engine.generate(input_ids=[prompt] * 4, sampling_params=runs)
            stats = engine.get_stats()
            assert_engine_clean(engine)
    for got, want in zip(outs["spec"], outs["plain"], strict=True):
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    got = outs["spec"]
    assert got[0]["output_ids"] == [500] * 7
    assert got[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    ids = got[1]["output_ids"]  # the stop token is banned for 6 tokens, then forced
    assert len(ids) == 7 and 500 not in ids[:6] and ids[6] == 500
    assert got[1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": 500}
    assert got[2]["output_ids"] == [500] * 30
    assert got[3]["meta_info"]["finish_reason"] == {"type": "stop", "matched": text}
    assert len(got[3]["output_ids"]) <= 4
    # the forced runs were accepted whole: 30 tokens take about 30 / 5 steps, not 30
    assert stats["spec_accept_length"] > 3.5


def test_tight_memory_grammar_lora_and_mixed_chunk() -> None:
    """With little KV memory (drafts are dropped when they do not fit, requests retracted),
    a grammar request (no drafts) and LoRA requests in the same batches, and mixed chunks,
    the tokens are still plain decoding's."""
    path = tiny_model("llama")
    adapter = tiny_lora(path, seed=3)
    prompts = _prompts(path, n=8, seed=2)
    params = [{"temperature": 0.0, "max_new_tokens": 40, **LOOPY} for _ in prompts]
    params[2] = {"temperature": 0.0, "max_new_tokens": 40, "regex": "(ab|cd){3,9}"}
    loras = [None, "a", None, "a", None, None, "a", None]
    # a small pool, and admission that expects few new tokens: running requests outgrow it
    kw = {"max_total_tokens": 400, "init_new_token_ratio": 0.05, "chunked_prefill_size": 64,
          "enable_mixed_chunk": True, "lora_paths": (f"a={adapter}",)}  # fmt: skip
    outs = {}
    for name, mode in (("plain", PLAIN), ("spec", SPEC)):
        with Engine(model_path=path, **mode, **kw) as engine:
            outs[name] = engine.generate(input_ids=prompts, sampling_params=params, lora_path=loras)
            stats = engine.get_stats()
            assert_engine_clean(engine)
    assert [o["output_ids"] for o in outs["spec"]] == [o["output_ids"] for o in outs["plain"]]
    assert stats["spec_accepted_tokens"] > 0 and stats["num_retractions"] > 0
    assert stats["spec_memory_skips"] > 0, stats
    text = outs["spec"][2]["text"]
    assert len(text) >= 6 and set(text) <= set("abcd"), text


def test_arguments_are_checked() -> None:
    path = tiny_model("llama")
    for bad, why in [
        ({"speculative_algorithm": "medusa"}, "not in"),
        ({"speculative_algorithm": "eagle"}, "needs speculative_draft_model_path"),
        ({"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 0}, ">= 1"),
        ({"speculative_algorithm": "ngram", "speculative_ngram_min_match_window_size": 5,
          "speculative_ngram_max_match_window_size": 3}, "min <= max"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            Engine(model_path=path, **bad)


@pytest.mark.parametrize(("name", "page_size"), [("mistral-sliding", 4), ("gemma3_text", 1)])
def test_hybrid_window_memory(name: str, page_size: int) -> None:
    """Over hybrid sliding-window memory (a window pool a tenth of the full one) the drafts'
    K/V go to both pools, the rejected drafts' pages come back from both (the request's
    account says they hold window KV: nothing read from the device), and the tokens are
    plain decoding's over the same memory."""
    path = model_path(name)
    prompts = _prompts(path)
    memory = dict(hybrid_swa_memory=True, max_total_tokens=6400, chunked_prefill_size=128,
                  swa_full_tokens_ratio=0.1, page_size=page_size)  # fmt: skip
    params = {"temperature": 0.0, "max_new_tokens": 48, **LOOPY}
    want, _ = _run(path, prompts, params, **PLAIN, **memory)
    got, stats = _run(path, prompts, params, **SPEC, **memory)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    _drafts_used(stats)


def test_speculative_counts_reach_metrics_through_the_heartbeat() -> None:
    """The worker's heartbeat carries the drafter's counts since it started; the router's
    /metrics exports the accept length and rate per worker (SGLang's gauges) and the counts
    (vLLM's spec_decode counters), equal to the engine's."""
    from services.router_metrics import RouterMetrics
    from services.worker_load import LoadReporter, WorkerFacts, load_figures
    from shared.messages import WorkerLoadMsg
    from tests.unit.test_router_workers_metrics import _samples

    path = model_path("llama")
    params = {"temperature": 0.0, "max_new_tokens": 24, **LOOPY}
    with Engine(model_path=path, **SPEC) as engine:
        engine.generate(input_ids=_prompts(path, n=3), sampling_params=params)
        stats = engine.get_stats()
        reporter = LoadReporter(WorkerFacts.of(engine.scheduler, "w0", "tiny"))
        reporter.figures = load_figures(engine.scheduler)
        beat = WorkerLoadMsg.from_msg(reporter.payload().to_msg())  # (through the wire format)
    _drafts_used(stats)
    assert (beat.spec_num_drafts, beat.spec_draft_tokens, beat.spec_accepted_tokens) == (
        stats["spec_num_drafts"], stats["spec_draft_tokens"], stats["spec_accepted_tokens"]
    )
    samples = _samples(RouterMetrics("tiny").render({"w0": beat}))
    worker = '{model_name="tiny",worker_id="w0"}'
    for prefix in ("sluice", "sglang"):
        assert samples[f"{prefix}:spec_accept_length{worker}"] == pytest.approx(
            stats["spec_accept_length"]
        )
        rate = stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
        assert samples[f"{prefix}:spec_accept_rate{worker}"] == pytest.approx(rate)
    assert samples[f"vllm:spec_decode_num_drafts_total{worker}"] == stats["spec_num_drafts"]
    assert samples[f"vllm:spec_decode_num_draft_tokens_total{worker}"] == stats["spec_draft_tokens"]
    assert (samples[f"vllm:spec_decode_num_accepted_tokens_total{worker}"]
            == stats["spec_accepted_tokens"])  # fmt: skip
    # per position of a step's drafts: none accepted after a rejected one
    per_pos = beat.spec_accepted_per_pos
    assert sum(per_pos) == stats["spec_accepted_tokens"] and 0 < len(per_pos) <= 4
    assert per_pos == sorted(per_pos, reverse=True)
    for j, n in enumerate(per_pos):
        labels = f'{{model_name="tiny",worker_id="w0",position="{j}"}}'
        assert samples[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{labels}"] == n
