"""`sluice serve` hands the engine flags it was given to its worker as `sluice worker` flags:
list-valued ones (`--cuda-graph-bs`, `--lora-paths`) as one value each, switches bare, the
rest as strings, and nothing left at its default."""

from __future__ import annotations

import argparse

import pytest

from services.engine_args import add_engine_args, engine_args_from
from services.serve import Launcher, add_router_args, engine_flags, router_flags
from shared.settings import ServeSettings


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_engine_flags_round_trip_to_the_worker() -> None:
    given = (
        "--page-size", "4", "--disable-overlap-schedule", "--cuda-graph-bs", "1", "8",
        "--lora-paths", "sql=/a/sql", "/b/chat", "--max-loras-per-batch", "2",
        "--quantization", "fp8", "--kv-cache-dtype", "fp8_e5m2", "--enable-lora",
    )  # fmt: skip
    flags = engine_flags(parse(*given))
    assert flags == [
        "--quantization", "fp8", "--kv-cache-dtype", "fp8_e5m2", "--page-size", "4",
        "--disable-overlap-schedule",
        "--cuda-graph-bs", "1", "8", "--lora-paths", "sql=/a/sql", "/b/chat",
        "--max-loras-per-batch", "2", "--enable-lora",
    ]  # fmt: skip
    again = parse(*flags)  # what the worker parses
    assert again.quantization == "fp8" and again.kv_cache_dtype == "fp8_e5m2"
    assert again.enable_lora
    assert again.lora_paths == ["sql=/a/sql", "/b/chat"] and again.cuda_graph_bs == [1, 8]
    assert engine_flags(parse()) == []


def _launcher(dp_size: int, *worker_flags: str) -> Launcher:
    return Launcher(ServeSettings(dp_size=dp_size), "/m", list(worker_flags))


def test_dp_workers_get_one_gpu_each(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _launcher(2, "--device", "cuda")._worker_gpus() == ["0", "1"]
    assert _launcher(1, "--device", "cuda")._worker_gpus() == []  # (whatever is visible)
    assert _launcher(3)._worker_gpus() == []  # CPU workers
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    assert _launcher(2, "--device", "cuda")._worker_gpus() == ["4", "6"]
    with pytest.raises(SystemExit, match="needs 4 GPUs"):
        _launcher(4, "--device", "cuda")._worker_gpus()


def test_dp_workers_of_tp_ranks_get_that_many_gpus_each(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _launcher(2, "--device", "cuda", "--tp-size", "2")._worker_gpus() == ["0,1", "2,3"]
    assert _launcher(2, "--device", "cuda", "--tp=2")._worker_gpus() == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 5,6,7,8")
    launcher = _launcher(2, "--device", "cuda", "--tensor-parallel-size", "2")
    assert launcher._worker_gpus() == ["4,5", "6,7"]
    with pytest.raises(SystemExit, match="--dp-size 2 x --tp-size 3 needs 6 GPUs"):
        _launcher(2, "--device", "cuda", "--tp-size", "3")._worker_gpus()
    assert "--tp-size" in engine_flags(parse("--tp", "2"))  # (what serve hands its workers)


def test_expert_parallel_flags() -> None:
    """SGLang's --ep-size (and its aliases), vLLM's --enable-expert-parallel (ep = tp); serve
    hands either to its workers."""
    from tests.factories import tiny_model

    model = ("--model", tiny_model("mixtral"))
    assert engine_args_from(parse(*model, "--tp", "4", "--ep", "2")).ep_size == 2
    assert engine_args_from(parse(*model, "--tp", "4", "--expert-parallel-size", "4")).ep_size == 4
    assert engine_args_from(parse(*model, "--tp", "2", "--enable-expert-parallel")).ep_size == 2
    assert engine_args_from(parse(*model, "--tp", "2")).ep_size == 1
    with pytest.raises(ValueError, match="ep_size must be >= 1 and divide tp_size 2"):
        engine_args_from(parse(*model, "--tp", "2", "--ep-size", "3"))
    assert engine_flags(parse("--tp", "2", "--enable-expert-parallel")) == [
        "--tp-size", "2", "--enable-expert-parallel"]  # fmt: skip


def test_serve_runs_node_0_only() -> None:
    from services.serve import run

    ns = parse("--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "h:5000")
    with pytest.raises(SystemExit, match="on node 1 run `sluice worker --node-rank 1`"):
        run(ServeSettings(), ns)
    assert engine_flags(ns) == ["--tp-size", "2", "--nnodes", "2", "--node-rank", "1",
                                "--dist-init-addr", "h:5000"]  # fmt: skip


def test_serve_passes_the_routing_policy_to_its_router() -> None:
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    ns = parser.parse_args(["--policy", "round_robin", "--cache-threshold", "0.5"])
    assert router_flags(ns) == ["--policy", "round_robin", "--cache-threshold", "0.5"]


def test_hierarchical_cache_flags_reach_the_worker() -> None:
    given = ("--enable-hierarchical-cache", "--hicache-ratio", "3", "--hicache-write-policy",
             "write_back")  # fmt: skip
    again = parse(*engine_flags(parse(*given)))
    args = engine_args_from(again)
    assert args.enable_hierarchical_cache and args.hicache_ratio == 3.0
    assert args.hicache_write_policy == "write_back" and args.hicache_size == 0.0
