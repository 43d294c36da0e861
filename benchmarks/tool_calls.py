"""What tool call parsing costs the router: streamed chat chunks formatted with `tools`
(`tool_choice` auto, each parser) vs without, over the same deltas, side by side (CPU).

    python benchmarks/tool_calls.py [--streams 200] [--reps 5]

The router formats every stream of every request in one process, so its cost per chunk bounds
how many tokens/s one router serves. This runs the router's own `Formatter.chunks()` (what
`/v1/chat/completions` with `stream: true` runs per request) on outputs that arrive one token
of text per delta (a word with its leading space, or up to 5 characters of JSON), as the
detokenizers send them, and times the whole loop.

Per parser (`hermes`, `llama3`, `mistral`) one output in its format: ~200 tokens of content
(hermes, mistral; llama3's calls must open the output, so it has none) then two calls of ~40
tokens each. Each output is formatted two ways:

* `tools`: tools given, `tool_choice` auto with that parser (content and tool_calls deltas;
  a call streams from its header on, so nearly every delta inside a call is a chunk too);
* `none`: the same deltas without tools (all content, the fast template path for chunks).

Reported: deltas/s and microseconds per delta per way; the summary is tools/none per parser
(the cost of parsing, per delta), and the whole-text parse of one output (a non-streamed
response), in microseconds. Outside the router nothing runs: no Redis, no model; the deltas
come from memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_result  # noqa: E402
from services.router_logprobs import TokenNames  # noqa: E402
from services.router_protocol import SubRequest  # noqa: E402
from services.router_responses import Formatter  # noqa: E402
from services.router_stream import Delta, Usage  # noqa: E402
from services.router_tools import ToolMode  # noqa: E402
from services.tool_parsers import parse  # noqa: E402
from shared.messages import FinishReason  # noqa: E402

WORDS = "the weather in the city will be mostly sunny with a light breeze from the west".split()
ARGS = [{"city": "Oslo", "days": 3, "units": "metric", "detail": "hourly forecast"}, {}]
NAMES = ["get_weather", "get_time"]


def output_text(parser: str, content_tokens: int = 200) -> str:
    words = " ".join(WORDS[i % len(WORDS)] for i in range(content_tokens))
    calls = [{"name": n, "arguments": a} for n, a in zip(NAMES, ARGS, strict=True)]
    if parser == "hermes":
        body = "".join(f"\n<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
        return words + body
    if parser == "mistral":
        return words + " [TOOL_CALLS]" + json.dumps(calls)
    llama = [{"name": c["name"], "parameters": c["arguments"]} for c in calls]
    return "<|python_tag|>" + "; ".join(json.dumps(c) for c in llama)


def pieces(text: str) -> list[str]:
    """The text as detokenizer deltas, one token's text each, BPE-like: a word with its leading
    space, long words and JSON split every 5 characters."""
    return re.findall(r" ?[^ ]{1,5}| +", text)


def formatter(parts: list[str], tool_mode: ToolMode | None) -> Formatter:
    async def deltas() -> AsyncIterator[Delta]:
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            yield Delta(
                text=part,
                output_ids=[k],
                finish_reason=FinishReason("stop", 2) if last else None,
                usage=Usage(10, len(parts), 0) if last else None,
            )

    sub = SubRequest(0, 0, {}, messages=[])
    handle = SimpleNamespace(rid="r0", sub=sub, deltas=deltas, close=lambda: None)
    return Formatter("chat", "chatcmpl-1", 1, "m", TokenNames(), [handle], tool_mode=tool_mode)  # type: ignore[list-item]


async def run_streams(
    parts: list[str], parser: str | None, streams: int
) -> tuple[float, int]:
    """Seconds to format `streams` streams of `parts`, and the number of chunks sent."""
    num_chunks = 0
    start = time.perf_counter()
    for _ in range(streams):
        mode = None if parser is None else ToolMode("auto", parser=parser)
        async for _chunk in formatter(parts, mode).chunks():
            num_chunks += 1
    return time.perf_counter() - start, num_chunks


def check(parser: str, text: str) -> None:
    """The stream under test really makes the calls (so the benchmark parses what it says)."""
    content, calls = parse(parser, text)
    assert [c.name for c in calls] == NAMES, (parser, calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    parsers = ("hermes", "llama3", "mistral")
    texts = {p: output_text(p) for p in parsers}
    for parser, text in texts.items():
        check(parser, text)
    rows: list[dict[str, Any]] = []
    per_delta: dict[tuple[str, str], list[float]] = {}
    for rep in range(args.reps):
        for parser in parsers:  # interleaved: drift on the shared machine hits every way alike
            parts = pieces(texts[parser])
            for way, mode in (("none", None), ("tools", parser)):
                secs, chunks = asyncio.run(run_streams(parts, mode, args.streams))
                deltas = len(parts) * args.streams
                per_delta.setdefault((parser, way), []).append(secs / deltas * 1e6)
                rows.append({
                    "rep": rep, "parser": parser, "way": way, "deltas": deltas, "chunks": chunks,
                    "deltas_per_s": round(deltas / secs),
                    "us_per_delta": round(secs / deltas * 1e6, 2),
                })  # fmt: skip
    columns = ["rep", "parser", "way", "deltas", "chunks", "deltas_per_s", "us_per_delta"]
    print_table(rows, columns)
    whole = {}
    for parser in parsers:
        t0 = time.perf_counter()
        for _ in range(1000):
            parse(parser, texts[parser])
        whole[parser] = round((time.perf_counter() - t0) / 1000 * 1e6, 1)
    med = {k: statistics.median(v) for k, v in per_delta.items()}
    summary = {
        "us_per_delta_median": {f"{p}/{w}": round(v, 2) for (p, w), v in med.items()},
        "tools_vs_none_per_delta": {
            p: round(med[(p, "tools")] / med[(p, "none")], 2) for p in parsers
        },
        "whole_parse_us": whole,
        "output_chars": {p: len(t) for p, t in texts.items()},
    }
    print(json.dumps(summary, indent=2))
    path = write_result("tool_calls", rows, summary, config=vars(args))
    print("wrote", path)


if __name__ == "__main__":
    main()
