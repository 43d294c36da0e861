"""LoRA adapters under CUDA graphs (the CPU's eager double of them, over the Triton backend
in the interpreter: the replay path, static buffers and all): a decode graph records every
adapted layer over every slot with a static mask a replay fills, so batches mixing adapters
and the base model replay the graphs of their padded size and every request still gets its
adapter's tokens (PEFT's, on the same random weights); an adapter loaded at run time that
adapts layers no adapter did before has the graphs recaptured with them; speculative verify
steps replay their graphs with adapters too."""

from __future__ import annotations

from engine.engine import Engine
from tests.factories import lora_greedy, mixed_prompts, model_path, tiny_lora
from tests.integration.test_speculative_eagle import eager_graphs

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
ARCH = "llama"
NAMES = [None, "a", "b", "a", None, "b", "a"]


def _adapter(seed: int, rank: int = 8, **kw: object) -> str:
    return tiny_lora(model_path(ARCH), seed, rank, **kw)


def _peft(folder: str | None, prompt: list[int]) -> list[int]:
    return lora_greedy(model_path(ARCH), folder, prompt, NEW)


def _replays(runner) -> dict[str, int]:
    return {kind: sum(g.num_replays for g in graphs.graphs.values())
            for kind in ("graph_runner", "verify_graph_runner")
            if (graphs := getattr(runner, kind)) is not None}  # fmt: skip


def test_mixed_batches_replay_the_graphs_with_each_requests_adapter() -> None:
    adapters = {"a": _adapter(1),
                "b": _adapter(2, rank=4, targets=("q_proj", "v_proj", "down_proj"))}
    prompts = mixed_prompts(500, n=len(NAMES), max_len=16, seed=11)
    # (requests end at different steps: the batch shrinks through the padded sizes)
    lengths = [NEW, 4, NEW, 6, 2, NEW, 5]
    params = [{**GREEDY, "max_new_tokens": n} for n in lengths]
    paths = tuple(f"{n}={p}" for n, p in adapters.items())
    with Engine(model_path=model_path(ARCH), lora_paths=paths, max_total_tokens=4096,
                cuda_graph_bs=(1, 2, 4, 8), attention_backend="triton",
                disable_overlap_schedule=True) as engine:  # fmt: skip
        runner = engine.scheduler.model_runner
        eager_graphs(runner)
        outs = engine.generate(input_ids=prompts, sampling_params=params, lora_path=NAMES)
        sizes = {bs for bs, g in runner.graph_runner.graphs.items() if g.num_replays}
    for prompt, name, n, out in zip(prompts, NAMES, lengths, outs, strict=True):
        want = _peft(adapters.get(name) if name else None, prompt)[:n]
        assert out["output_ids"] == want, name
    assert sizes >= {8, 4}, sizes


def test_an_adapter_of_new_layers_recaptures_the_graphs() -> None:
    """An engine whose first adapter adapts q/v/down only, captured; an adapter of every
    projection loaded later wraps the other layers, so the graphs are recaptured before the
    next replay and record them: its requests get its tokens, in graph replays."""
    b = _adapter(2, rank=4, targets=("q_proj", "v_proj", "down_proj"))
    a = _adapter(1)
    prompts = mixed_prompts(500, n=4, max_len=16, seed=5)
    with Engine(model_path=model_path(ARCH), lora_paths=(f"b={b}",), max_total_tokens=4096,
                max_lora_rank=8, cuda_graph_bs=(1, 2, 4), attention_backend="triton",
                disable_overlap_schedule=True) as engine:  # fmt: skip
        runner = engine.scheduler.model_runner
        eager_graphs(runner)
        first = runner.graph_runner
        got_b = engine.generate(input_ids=prompts[:2], sampling_params=GREEDY,
                                lora_path=["b", None])  # fmt: skip
        engine.load_lora_adapter("a", a)
        names = ["a", "b", None, "a"]
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
        assert runner.graph_runner is not first  # recaptured
        assert _replays(runner)["graph_runner"] > 0
    assert [o["output_ids"] for o in got_b] == [_peft(b, prompts[0]), _peft(None, prompts[1])]
    folders = {"a": a, "b": b, None: None}
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out["output_ids"] == _peft(folders[name], prompt), name


def test_speculative_verify_steps_replay_with_adapters() -> None:
    """N-gram speculation with adapters: the verify steps replay the verify graphs (each
    request's `width` rows of the static mask its adapter's), and every request gets its
    adapter's tokens, as without speculation."""
    adapters = {"a": _adapter(1), "b": _adapter(2, rank=4)}
    # (repetitive prompts: the n-gram drafts find matches)
    prompts = [([7, 8, 9, 10] * 6)[: 20 + i] for i in range(len(NAMES))]
    paths = tuple(f"{n}={p}" for n, p in adapters.items())
    with Engine(model_path=model_path(ARCH), lora_paths=paths, max_total_tokens=4096,
                cuda_graph_bs=(1, 2, 4, 8), attention_backend="triton",
                disable_overlap_schedule=True, speculative_algorithm="ngram",
                speculative_num_draft_tokens=3) as engine:  # fmt: skip
        runner = engine.scheduler.model_runner
        eager_graphs(runner)
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=NAMES)
        replays = _replays(runner)
        stats = engine.get_stats()
    for prompt, name, out in zip(prompts, NAMES, outs, strict=True):
        assert out["output_ids"] == _peft(adapters.get(name) if name else None, prompt), name
    assert stats["spec_draft_tokens"] > 0, stats
    assert replays.get("verify_graph_runner", 0) > 0, replays
