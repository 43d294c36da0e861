"""Tensor parallelism on CPU (gloo; engine/tensor_parallel.py): a model split over 2 or 4
rank processes generates transformers' greedy tokens for the Llama family (Llama's own
lm_head, Qwen2's q/k/v biases and tied embedding, Qwen3's q/k norms and head_dim, Mistral) and
its mixture-of-experts models (every expert split; Qwen2-MoE's shared expert and dense layers;
or the experts split into groups of ranks, `ep_size`),
in every scheduler loop, over prefix-cache hits and chunked prefills; with more ranks than
K/V heads (each head held by several ranks) and a vocabulary the ranks do not divide; the
logprobs are one rank's; weights updated from disk or from tensors, and memory released and
resumed, on every rank; what is not supported is refused with the reason (before any process
starts, where it is a flag); the ranks stop with the engine, and a rank that dies fails the
next forward with its name instead of hanging."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.cuda_graph_runner import EagerGraphCapturer
from engine.distributed import free_port
from engine.engine import Engine
from engine.loader import iter_safetensors
from engine.overlap.executor import ThreadExecutor
from tests.factories import (
    assert_greedy_match,
    hf_greedy,
    lora_greedy,
    mixed_prompts,
    model_path,
    tiny_fp8_model,
    tiny_lora,
    tiny_model,
)
from tests.rl_trainer import Trainer, buckets

REPO = str(Path(__file__).resolve().parents[2])
NEW = 10
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
PROMPTS = mixed_prompts(1500, n=5, max_len=60, seed=3)  # (three share a prefix; one is 1 token)


def check_greedy(eng: Engine, path: str, prompts: list[list[int]] = PROMPTS) -> None:
    outs = eng.generate(input_ids=prompts, sampling_params=[GREEDY] * len(prompts))
    for prompt, out in zip(prompts, outs):
        assert_greedy_match(path, prompt, out["output_ids"], hf_greedy(path, prompt, NEW))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe",
                                  "qwen3_moe", "phi3", "granite", "deepseek_v3", "glm4",
                                  "glm4_moe"])
def test_two_ranks_give_transformers_greedy_tokens(arch: str) -> None:
    path = tiny_model(arch)
    with Engine(model_path=path, tp_size=2, disable_overlap_schedule=True) as eng:
        runner = eng.scheduler.model_runner
        assert runner.tp.size == 2 and len(runner.tp_followers) == 1
        heads = ModelConfig.from_pretrained(path).num_heads
        assert runner.model_config.num_heads == heads // 2  # (this rank's)
        check_greedy(eng, path)
        check_greedy(eng, path)  # (again: every prompt a cache hit)


@pytest.mark.parametrize("arch, tp, ep", [("mixtral", 2, 2), ("qwen3_moe", 2, 2),
                                          ("qwen2_moe", 4, 2), ("deepseek_v3", 4, 4)])  # fmt: skip
def test_expert_parallelism_gives_transformers_greedy_tokens(arch: str, tp: int, ep: int) -> None:
    """--ep-size: each expert group holds its share of the experts (whole with ep == tp, else
    split over the group's ranks); a rank computes its experts' share of each token, one
    all-reduce over all the ranks sums them."""
    path = tiny_model(arch)
    config = ModelConfig.from_pretrained(path).hf_config
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    with Engine(model_path=path, tp_size=tp, ep_size=ep, disable_overlap_schedule=True) as eng:
        w13 = eng.scheduler.model_runner.model.model.layers[-1].mlp.experts.w13.weight
        assert tuple(w13.shape) == (experts // ep, 2 * inter // (tp // ep), config.hidden_size)
        check_greedy(eng, path)


def test_experts_that_do_not_split_are_refused_before_any_rank_starts(tmp_path) -> None:
    from services.tiny_model import make_tiny_model

    path = str(make_tiny_model(tmp_path / "m", arch="mixtral", num_experts=6))
    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match="6 experts do not split into 4 equal groups"):
        Engine(model_path=path, tp_size=4, ep_size=4, disable_overlap_schedule=True)
    assert len(multiprocessing.active_children()) == before


def start_node(path: str, tp: int, port: int, *flags: str) -> subprocess.Popen:
    """`sluice worker --node-rank 1` of a group over 2 "machines" (both this one, over
    loopback): its tp / 2 ranks only, no Redis."""
    cmd = [sys.executable, "-m", "services.cli", "worker", "--model", path, "--tp-size", str(tp),
           "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{port}",
           "--disable-overlap-schedule", *flags]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("tp", [2, 4])
def test_ranks_over_two_nodes(tp: int) -> None:
    """--nnodes 2: node 0's engine runs ranks 0..tp/2-1, `sluice worker --node-rank 1` the
    others, meeting at --dist-init-addr; transformers' greedy tokens; node 1's ranks end with
    the engine and its worker exits 0."""
    path, port = tiny_model("llama"), free_port()
    node = start_node(path, tp, port)
    try:
        with Engine(model_path=path, tp_size=tp, nnodes=2, dist_init_addr=f"127.0.0.1:{port}",
                    disable_overlap_schedule=True) as eng:  # fmt: skip
            runner = eng.scheduler.model_runner
            assert runner.tp.size == tp and len(runner.tp_followers) == tp // 2 - 1
            check_greedy(eng, path)
        assert node.wait(60) == 0, node.stderr.read()[-3000:]
    finally:
        node.kill()


def test_a_node_started_with_other_flags_is_refused() -> None:
    path, port = tiny_model("llama"), free_port()
    node = start_node(path, 2, port, "--max-total-tokens", "4096")
    try:
        match = ("rank 1 runs with other engine arguments than rank 0: max_total_tokens = "
                 "4096, not None")  # fmt: skip
        with pytest.raises(ValueError, match=match):
            Engine(model_path=path, tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}",
                   disable_overlap_schedule=True)  # fmt: skip
        assert node.wait(60) != 0
        assert "runs with other engine arguments than rank 1" in node.stderr.read()
    finally:
        node.kill()


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_overlap_loop_with_two_ranks(executor: str) -> None:
    """The overlap loop sends each forward after its placeholders are resolved; the device
    process executor gives way to the forward thread (rank 0 starts the ranks itself)."""
    path = tiny_model("llama")
    with Engine(model_path=path, tp_size=2, cpu_overlap_executor=executor) as eng:
        assert isinstance(eng.scheduler.executor, ThreadExecutor)
        check_greedy(eng, path)


def test_more_ranks_than_kv_heads_and_an_uneven_vocabulary(tmp_path) -> None:
    """One K/V head held by all 4 ranks, a vocabulary of 1534 in parts of 384 (the last one
    2 rows short), prefills in chunks of 16 tokens."""
    from services.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "m", arch="llama", vocab_size=1534, num_key_value_heads=1)
    with Engine(model_path=str(path), tp_size=4, chunked_prefill_size=16,
                disable_overlap_schedule=True) as eng:  # fmt: skip
        runner = eng.scheduler.model_runner
        assert (runner.model_config.num_heads, runner.model_config.num_kv_heads) == (1, 1)
        assert runner.model.lm_head.weight.shape[0] == 384
        check_greedy(eng, str(path))


def test_logprobs_are_one_ranks() -> None:
    path = tiny_model("qwen3")
    ask = dict(input_ids=PROMPTS[:3], sampling_params=[GREEDY] * 3, return_logprob=True,
               top_logprobs_num=3)  # fmt: skip
    with Engine(model_path=path, disable_overlap_schedule=True) as eng:
        want = eng.generate(**ask)
    with Engine(model_path=path, tp_size=2, disable_overlap_schedule=True) as eng:
        got = eng.generate(**ask)
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"]
        for a, b in zip(g["meta_info"]["output_token_logprobs"],
                        w["meta_info"]["output_token_logprobs"]):  # fmt: skip
            assert a[1] == b[1] and abs(a[0] - b[0]) < 1e-4
        def top_ids(out: dict) -> list[list[int]]:
            return [[t[1] for t in step] for step in out["meta_info"]["output_top_logprobs"]]

        assert top_ids(g) == top_ids(w)


def test_speculative_decoding_over_two_ranks() -> None:
    """The n-gram drafts' verify forward (every position's logits) runs on every rank: the
    tokens are plain decoding's on one rank, with drafts accepted and rejected."""
    path = tiny_model("qwen3")
    loopy = {"temperature": 0.0, "max_new_tokens": 40, "allowed_token_ids": [11, 12, 13],
             "ignore_eos": True}  # (few tokens: the output repeats, drafts are found)
    prompts = PROMPTS[:4]
    with Engine(model_path=path, disable_overlap_schedule=True) as eng:
        want = [o["output_ids"] for o in eng.generate(input_ids=prompts,
                                                      sampling_params=loopy)]  # fmt: skip
    with Engine(model_path=path, tp_size=2, speculative_algorithm="ngram",
                speculative_num_draft_tokens=4) as eng:  # fmt: skip
        got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=loopy)]
        stats = eng.get_stats()
    assert got == want
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    # a draft model (itself) on rank 0's device, one rank: every draft is right
    draft = {"speculative_algorithm": "standalone", "speculative_draft_model_path": path}
    with Engine(model_path=path, tp_size=2, speculative_num_draft_tokens=4, **draft) as eng:
        got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=loopy)]
        stats = eng.get_stats()
        assert eng.scheduler.drafter.runner.tp.size == 1
    assert got == want
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0, stats


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_draft_trees_over_two_ranks(graphs: bool) -> None:
    """Draft trees (n-gram tries of two matches) over two ranks: the followers mask the trees
    rank 0 masks (the parents come with the batch; with graphs, rank 0's verify graphs of
    trees and the followers' replay together), and the K/V of accepted nodes that moved to
    their path's positions moves on every rank (the followers' before their next forward).
    Tokens and logprobs are plain decoding's on one rank, with nodes moved."""
    path = tiny_model("qwen3")
    loopy = {"temperature": 0.0, "max_new_tokens": 24, "allowed_token_ids": [11, 12, 13],
             "ignore_eos": True, "return_logprob": True}  # fmt: skip
    prompts = PROMPTS[:3]
    with Engine(model_path=path, disable_overlap_schedule=True) as eng:
        want = eng.generate(input_ids=prompts, sampling_params=loopy)
    trees = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 6,
             "speculative_eagle_topk": 2, "speculative_num_steps": 3}  # fmt: skip
    kw = {"attention_backend": "triton", "cuda_graph_bs": (1, 2, 4)} if graphs else {}
    with Engine(model_path=path, tp_size=2, **trees, **kw) as eng:
        runner = eng.scheduler.model_runner
        if graphs:
            runner.use_cuda_graph = True
            runner.graph_capturer_factory = lambda device: EagerGraphCapturer()
            runner.capture_cuda_graphs()
        moved = []
        queue = runner.tp_link.queue_kv_moves
        runner.tp_link.queue_kv_moves = lambda src, dst: (moved.append(len(src)),
                                                          queue(src, dst))  # fmt: skip
        got = eng.generate(input_ids=prompts, sampling_params=loopy)
        stats = eng.get_stats()
        replays = sum(g.num_replays for g in runner.verify_graph_runner.graphs.values()) \
            if graphs else 0
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    for g, w in zip(got, want):
        lp = [x[0] for x in g["meta_info"]["output_token_logprobs"]]
        ref = [x[0] for x in w["meta_info"]["output_token_logprobs"]]
        assert lp == pytest.approx(ref, abs=1e-4)
    assert stats["spec_accepted_tokens"] > 0 and sum(moved) > 0, (stats, moved)
    assert replays > 0 or not graphs


@pytest.mark.parametrize("executor", ["no-overlap", "thread"])
def test_hierarchical_cache_copies_run_on_every_rank(executor: str) -> None:
    """Documents evicted from a small device pool come back from host memory on both ranks
    (each rank's host pool holds its heads): the tokens are one rank's with a plain cache, and
    the second round's prompts are served from the cache."""
    from tests.integration.test_hicache import DOC_LEN, rounds

    path = tiny_model("llama")
    kw = dict(disable_overlap_schedule=True) if executor == "no-overlap" else {}
    plain, _ = rounds(path, hicache=False, **kw)
    hier, stats = rounds(path, hicache=True, tp_size=2, **kw)
    assert [o["output_ids"] for o in hier] == [o["output_ids"] for o in plain]
    assert min(o["meta_info"]["cached_tokens"] for o in hier[6:]) >= DOC_LEN - 1
    assert stats["hicache_host_hit_tokens"] >= 5 * (DOC_LEN - 1)


def test_decode_graphs_replay_on_every_rank() -> None:
    """CUDA graphs under tensor parallelism, on CPU with the eager graph double: every rank
    captures at the same time as rank 0 (the capture's collectives meet), and where rank 0
    replays its graph of the padded size (3 requests in the graph of 4) the followers replay
    theirs (an eager follower's collectives would not match the padded rows')."""
    path = tiny_model("llama")
    prompts = PROMPTS[:3]
    with Engine(model_path=path, tp_size=2, attention_backend="triton", cuda_graph_bs=(1, 2, 4),
                disable_overlap_schedule=True) as eng:  # fmt: skip
        runner = eng.scheduler.model_runner
        runner.use_cuda_graph = True
        runner.graph_capturer_factory = lambda device: EagerGraphCapturer()
        runner.capture_cuda_graphs()
        check_greedy(eng, path, prompts)
        replays = {bs: g.num_replays for bs, g in runner.graph_runner.graphs.items()}
        assert replays == {1: 0, 2: 0, 4: NEW - 1}  # (every decode step, 3 rows padded to 4)


@pytest.mark.parametrize("kind", ["block", "tensor", "online"])
def test_fp8_over_two_ranks_computes_the_split_w8a8(kind: str) -> None:
    """FP8 weights split over 2 ranks against transformers computing the same W8A8 arithmetic
    (tests/test_fp8.py's comparison): a block-scaled checkpoint (8 x 8 blocks: each rank's rows
    and columns are whole blocks, so it is the unsplit arithmetic), per-tensor scales and
    `--quantization fp8` (the row-parallel projections quantize their input per token over
    their own half of the columns, and --quantization fp8 their weights per row of their
    half, as a split layer must)."""
    from tests.fp8_reference import dequantized_copy, hf_w8a8_logits
    from tests.teacher_forcing import assert_same_arithmetic, cpu_sequences, cpu_teacher_forced

    seqs = cpu_sequences()
    if kind == "block":
        path = tiny_fp8_model("qwen3", 8)
        ours = cpu_teacher_forced(path, tp_size=2)
        ref = hf_w8a8_logits(path, seqs, group_cols=8)
    elif kind == "tensor":
        path = tiny_fp8_model("llama", 0)
        ours = cpu_teacher_forced(path, tp_size=2)
        ref = hf_w8a8_logits(dequantized_copy(path), seqs, None, split=2)
    else:
        path = tiny_model("llama")
        ours = cpu_teacher_forced(path, tp_size=2, quantization="fp8")
        ref = hf_w8a8_logits(path, seqs, None, quantize_weights=True, split=2)
    assert_same_arithmetic(ours, ref)


def test_fp8_blocks_a_rank_would_cut_are_refused_before_any_rank_starts() -> None:
    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match="not whole .* scale blocks .*choose a tp_size"):
        Engine(model_path=tiny_fp8_model("qwen3", 16), tp_size=2)  # (176 / 2 = 88 rows)
    assert len(multiprocessing.active_children()) == before


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lora_adapters_over_two_ranks(arch: str) -> None:
    """LoRA with the base split: each rank holds its rows of B over a column-parallel layer
    (q/k/v, gate/up) and its columns of A over a row-parallel one (o, down: x @ A.T
    all-reduced); an adapter given at start and one loaded while running (on every rank), in
    one batch with the base model: PEFT's greedy tokens for each."""
    path = tiny_model(arch)
    sql, chat = tiny_lora(path, 1), tiny_lora(path, 2)
    prompt = PROMPTS[0]
    with Engine(model_path=path, tp_size=2, lora_paths=(f"sql={sql}",), max_loras_per_batch=2,
                disable_overlap_schedule=True) as eng:  # fmt: skip
        eng.load_lora_adapter("chat", chat)
        outs = eng.generate(input_ids=[prompt] * 3, sampling_params=GREEDY,
                            lora_path=["sql", None, "chat"])  # fmt: skip
        for out, adapter in zip(outs, (sql, None, chat)):
            assert out["output_ids"] == lora_greedy(path, adapter, prompt, NEW), adapter
        eng.unload_lora_adapter("chat")
        out = eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="sql")
        assert out["output_ids"] == lora_greedy(path, sql, prompt, NEW)


def test_lora_adapters_in_graph_replays_on_every_rank() -> None:
    """LoRA under CUDA graphs over two ranks (the eager double): rank 0 and the follower fill
    their graphs' static LoRA masks alike (the same slots: the same calls, in order) and
    replay the graph of the padded size; PEFT's tokens for each request."""
    path = tiny_model("llama")
    sql, chat = tiny_lora(path, 1), tiny_lora(path, 2)
    prompt = PROMPTS[0]
    with Engine(model_path=path, tp_size=2, attention_backend="triton", cuda_graph_bs=(1, 2, 4),
                lora_paths=(f"sql={sql}", f"chat={chat}"),
                disable_overlap_schedule=True) as eng:  # fmt: skip
        runner = eng.scheduler.model_runner
        runner.use_cuda_graph = True
        runner.graph_capturer_factory = lambda device: EagerGraphCapturer()
        runner.capture_cuda_graphs()
        outs = eng.generate(input_ids=[prompt] * 3, sampling_params=GREEDY,
                            lora_path=["sql", None, "chat"])  # fmt: skip
        replays = {bs: g.num_replays for bs, g in runner.graph_runner.graphs.items()}
    for out, adapter in zip(outs, (sql, None, chat)):
        assert out["output_ids"] == lora_greedy(path, adapter, prompt, NEW), adapter
    assert replays == {1: 0, 2: 0, 4: NEW - 1}  # (every decode step, 3 rows padded to 4)


@pytest.mark.parametrize("executor", ["no-overlap", "thread"])
def test_hybrid_window_memory_over_two_ranks(executor: str) -> None:
    """Hybrid sliding-window memory (Mistral's window of 32 keys, a window pool a tenth of the
    full one): rank 0 sends the window slots of the batch's slots with each forward; the tokens
    are one rank's with plain memory."""
    from tests.integration.test_hybrid_swa import run

    path = model_path("mistral-sliding")
    prompts = mixed_prompts(500, n=6, max_len=200, seed=3)
    kw = dict(disable_overlap_schedule=True) if executor == "no-overlap" else {}
    plain, _ = run(path, prompts, hybrid=False, **kw)
    split, scheduler = run(path, prompts, hybrid=True, tp_size=2, **kw)
    assert [r["output_ids"] for r in split] == [r["output_ids"] for r in plain]
    # (the window pool holds fewer tokens than were in flight, none retracted: windows freed)
    assert scheduler.pools.allocator.swa_size < sum(len(p) + 120 for p in prompts)
    assert scheduler.stats.num_retractions == 0


def test_prompt_logprobs_embeddings_and_a_classifier_over_two_ranks() -> None:
    """The prompt's logprobs (extra logit rows the forward computes), an embedding model's
    pooled states and a sequence classifier's scores (pooled before any vocabulary gather):
    one rank's."""
    path = tiny_model("qwen3")
    ask = dict(input_ids=PROMPTS[:3], sampling_params=[{**GREEDY, "max_new_tokens": 2}] * 3,
               return_logprob=True, logprob_start_len=0)  # fmt: skip

    def prompt_lps(out: list[dict]) -> list[float]:
        return [lp for o in out for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]

    def vectors(**kw: object) -> torch.Tensor:
        with Engine(model_path=kw.pop("path"), is_embedding=True, **kw) as eng:
            return torch.tensor([o["embedding"] for o in eng.encode(input_ids=PROMPTS[:3])])

    outs = {}
    for tp in (1, 2):
        with Engine(model_path=path, tp_size=tp, disable_overlap_schedule=True) as eng:
            outs[tp] = prompt_lps(eng.generate(**ask))
    assert len(outs[1]) > 50
    torch.testing.assert_close(torch.tensor(outs[2]), torch.tensor(outs[1]), atol=1e-4, rtol=0)
    torch.testing.assert_close(vectors(path=path, tp_size=2), vectors(path=path), atol=1e-5,
                               rtol=0)  # fmt: skip
    classifier = tiny_model("qwen3", num_labels=3)
    torch.testing.assert_close(vectors(path=classifier, tp_size=2), vectors(path=classifier),
                               atol=1e-5, rtol=0)  # fmt: skip


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(model_path=tiny_model("llama"), tp_size=3),
         "4 attention heads do not split into 3 equal parts"),
        (dict(model_path=tiny_model("gpt2"), tp_size=2),
         "not supported for GPT2LMHeadModel yet; it is for LlamaForCausalLM"),
        (dict(model_path=tiny_model("llama"), tp_size=0), "tp_size must be >= 1"),
        (dict(model_path=tiny_model("mixtral"), tp_size=2, ep_size=4),
         "ep_size must be >= 1 and divide tp_size 2"),
        (dict(model_path=tiny_model("llama"), tp_size=2, nnodes=2), "nnodes > 1 needs "
         "dist_init_addr"),
        (dict(model_path=tiny_model("llama"), tp_size=2, nnodes=2, dist_init_addr="host"),
         "dist_init_addr must be HOST:PORT, got 'host'"),
        (dict(model_path=tiny_model("llama"), tp_size=2, nnodes=3), "nnodes must be >= 1 and "
         "divide tp_size 2"),
        (dict(model_path=tiny_model("llama"), tp_size=2, nnodes=2, node_rank=2,
              dist_init_addr="h:1"), r"node_rank must be in \[0, nnodes 2\)"),
    ],
    ids=["heads", "gpt2", "zero", "ep", "nodes-addr", "nodes-bad-addr", "nodes", "node-rank"],
)
def test_refused_before_any_rank_starts(kw: dict, match: str) -> None:
    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match=match):
        Engine(disable_overlap_schedule=True, **kw)
    assert len(multiprocessing.active_children()) == before


@pytest.mark.parametrize("executor", ["no-overlap", "thread"])
def test_weights_updated_released_and_resumed_on_every_rank(executor: str) -> None:
    """Every rank takes its part of another checkpoint (from disk, or as tensors sent in
    buckets), gives its memory back and takes it again; reading a weight back is refused; the
    ranks stop with the engine."""
    a, b = tiny_model("llama"), tiny_model("llama", seed=1)
    kw = dict(disable_overlap_schedule=True) if executor == "no-overlap" else {}
    prompts = PROMPTS[:2]
    with Engine(model_path=a, tp_size=2, **kw) as eng:
        procs = list(eng.scheduler.model_runner.tp_followers)
        check_greedy(eng, a, prompts)
        eng.update_weights_from_disk(b)
        check_greedy(eng, b, prompts)
        tensors = sorted(iter_safetensors(a))
        for bucket in (tensors[0::2], tensors[1::2]):  # (q, k, v of a layer in both)
            eng.update_weights_from_tensor(bucket)
        check_greedy(eng, a, prompts)
        eng.update_weights_from_disk(b)
        eng.release_memory_occupation()  # (the weights discarded: B is on disk)
        eng.resume_memory_occupation()
        check_greedy(eng, b, prompts)
    assert procs and not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("executor", ["no-overlap", "thread"])
def test_every_rank_joins_the_trainers_group_and_takes_its_part(executor: str) -> None:
    """SGLang's layout: rank r of the engine is rank `rank_offset + r` of the trainer's group
    (the trainer a separate process, tests/rl_trainer.py); every rank receives each broadcast
    (one tensor at a time, or flattened) and keeps its part; a refused bucket is still received
    by every rank, so the ones after it land."""
    a, b = tiny_model("llama"), tiny_model("llama", seed=1)
    kw = dict(disable_overlap_schedule=True) if executor == "no-overlap" else {}
    bucket_list = buckets(b, 3)
    with Engine(model_path=a, tp_size=2, **kw) as eng:
        with pytest.raises(ValueError, match="join as ranks 1..2: world_size 2 is too small"):
            eng.init_weights_update_group("127.0.0.1", free_port(), 1, 2, backend="gloo")
        port = free_port()
        trainer = Trainer("--port", str(port), "--world-size", "3", "--checkpoint", b,
                          "--buckets", "3", "--order", "0,0f,1,2f")  # fmt: skip
        try:
            eng.init_weights_update_group("127.0.0.1", port, 1, 3, backend="gloo", timeout_s=60)
        except BaseException:
            trainer.kill()
            raise
        wrong = bucket_spec(bucket_list[0])
        wrong["names"][0] = "model.extra.weight"
        with pytest.raises(ValueError, match="unexpected weight 'model.extra.weight'"):
            eng.update_weights_from_distributed(**wrong)
        check_greedy(eng, a, PROMPTS[:2])  # (nothing changed)
        for k, bucket in enumerate(bucket_list):
            fmt = "flattened_bucket" if k != 1 else None
            eng.update_weights_from_distributed(**bucket_spec(bucket), load_format=fmt)
        assert trainer.answers()[-1] == {"call": "done"}
        eng.destroy_weights_update_group()
        check_greedy(eng, b, PROMPTS[:2])


def bucket_spec(bucket: list) -> dict:
    return {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}  # fmt: skip


@pytest.mark.parametrize("arch, tp, ep", [("llama", 2, 1), ("qwen2_moe", 2, 1),
                                          ("qwen2_moe", 4, 2), ("llama-kv1", 4, 1)])  # fmt: skip
def test_weights_read_back_whole_from_the_ranks_parts(
    arch: str, tp: int, ep: int, tmp_path
) -> None:
    """`get_weights_by_name`: every rank reads its part (its heads' rows, its columns of a
    row-parallel weight, its part of the vocabulary or of an expert; nothing of another
    expert group's expert) and rank 0 puts them together: the checkpoint's tensors,
    exactly."""
    if arch == "llama-kv1":  # (one K/V head held by every rank; a vocabulary 4 does not divide)
        from services.tiny_model import make_tiny_model

        path = str(make_tiny_model(tmp_path / "m", arch="llama", vocab_size=1534,
                                   num_key_value_heads=1))  # fmt: skip
    else:
        path = tiny_model(arch)
    want = dict(iter_safetensors(path))
    names = [n for n in want if ".layers.1." in n or ".layers." not in n]  # (one layer's)
    with Engine(model_path=path, tp_size=tp, ep_size=ep, disable_overlap_schedule=True) as eng:
        for name in names:
            got = eng.get_weights_by_name(name, truncate_size=want[name].numel())
            assert torch.equal(torch.tensor(got), want[name].flatten().float()), name
        first = eng.get_weights_by_name("model.layers.1.self_attn.o_proj.weight", 5)
        assert first == want["model.layers.1.self_attn.o_proj.weight"].flatten()[:5].tolist()


def test_an_update_that_does_not_fit_is_refused_on_every_rank() -> None:
    path = tiny_model("llama")
    with Engine(model_path=path, tp_size=2, disable_overlap_schedule=True) as eng:
        with pytest.raises(ValueError, match="is a .* checkpoint; the served model is"):
            eng.update_weights_from_disk(tiny_model("qwen3"))
        name = "model.layers.0.self_attn.q_proj.weight"
        weight = dict(iter_safetensors(path))[name]
        with pytest.raises(ValueError, match="does not match"):
            eng.update_weights_from_tensor([(name, weight[:, :-1])])
        check_greedy(eng, path, PROMPTS[:2])  # (nothing changed, the ranks in step)


def test_a_rank_that_dies_fails_the_next_forward_with_its_name() -> None:
    path = tiny_model("llama")
    with Engine(model_path=path, tp_size=2, disable_overlap_schedule=True) as eng:
        proc = eng.scheduler.model_runner.tp_followers[0]
        eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="sluice-tp1 exited with code -9"):
            eng.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
        with pytest.raises(RuntimeError, match="ranks out of step .* restart the worker"):
            eng.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
        assert time.monotonic() - start < 30


def test_a_forward_that_fails_names_the_rank_that_died():
    """Rank 0's forward raised (its collective's peer was killed mid-forward, before any
    watcher noticed): the error names the rank process that exited, as a failed send does;
    with every rank alive the forward's own error stands."""
    import types

    from engine.tensor_parallel import TPLink

    alive = types.SimpleNamespace(name="sluice-tp2", exitcode=None)
    killed = types.SimpleNamespace(name="sluice-tp1", exitcode=-signal.SIGKILL)
    link = types.SimpleNamespace(procs=[killed, alive], broken=None)
    cause = RuntimeError("gloo: Connection reset by peer")
    with pytest.raises(RuntimeError, match="sluice-tp1 exited with code -9") as info:
        TPLink.forward_failed(link, cause)
    assert info.value.__cause__ is cause and link.broken == "sluice-tp1 exited with code -9"
    link = types.SimpleNamespace(procs=[alive], broken=None)
    TPLink.forward_failed(link, cause)  # returns: the caller re-raises the forward's error
    assert link.broken is None


def test_verify_graphs_replay_on_every_rank() -> None:
    """Speculative verify steps in CUDA graphs under tensor parallelism (the eager graph
    double): every rank captures them with its decode graphs, and where rank 0 replays one
    (requests padded to the graph's width and size) the followers replay theirs; the tokens
    are plain decoding's on one rank."""
    path = tiny_model("llama")
    prompts = PROMPTS[:3]
    loopy = {"temperature": 0.0, "max_new_tokens": 16, "allowed_token_ids": [11, 12, 13],
             "ignore_eos": True}  # fmt: skip
    with Engine(model_path=path, disable_overlap_schedule=True) as eng:
        want = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=loopy)]
    with Engine(model_path=path, tp_size=2, attention_backend="triton", cuda_graph_bs=(1, 2, 4),
                speculative_algorithm="ngram", speculative_num_draft_tokens=3) as eng:  # fmt: skip
        runner = eng.scheduler.model_runner
        runner.use_cuda_graph = True
        runner.graph_capturer_factory = lambda device: EagerGraphCapturer()
        runner.capture_cuda_graphs()
        got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=loopy)]
        stats = eng.get_stats()
        replays = sum(g.num_replays for g in runner.verify_graph_runner.graphs.values())
    assert got == want
    assert stats["spec_num_drafts"] > 0 and replays > 0, (stats, replays)
