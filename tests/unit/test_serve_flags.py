"""`sluice serve` hands the engine flags it was given to its worker as `sluice worker` flags:
list-valued ones (`--cuda-graph-bs`, `--lora-paths`) as one value each, switches bare, the
rest as strings, and nothing left at its default."""

from __future__ import annotations

import argparse

from services.engine_args import add_engine_args
from services.serve import engine_flags


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
