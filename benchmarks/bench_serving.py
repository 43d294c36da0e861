"""Online serving benchmark, flag-compatible with SGLang's `python -m sglang.bench_serving`.

    python benchmarks/bench_serving.py --backend sluice --port 30000 \
        --dataset-name random --num-prompts 200 --random-input-len 256 \
        --random-output-len 64 --max-concurrency 64 [--request-rate 8] [--output-file x.jsonl]

Sends requests with an aiohttp client (Poisson arrivals at `--request-rate`, or all at once
with `inf`; at most `--max-concurrency` in flight), streams the answers and reports what
SGLang reports: request, input and output token throughput, and TTFT, TPOT, ITL and E2E
latency (mean, median, p99). Backends: `sluice` / `sglang` (`POST /generate`), `openai` /
`sglang-oai` / `vllm` (`POST /v1/completions`), `openai-chat` (`POST /v1/chat/completions`).

`--measure-disaggregation` instead runs, in one go, the same workload through `sluice
serve` (started here) and through the in-process engine, plus a detokenizer throughput and
scaling test; see `benchmarks/serving_disagg.py`. The recorded result came from

    sluice make-tiny-model /tmp/bench-m2 --hidden-size 256 --num-layers 4 --num-heads 4 \
        --num-kv-heads 2 --intermediate-size 768 --vocab-size 4096 \
        --max-position-embeddings 4096          # ~20-25 ms per decode step at batch 64
    python benchmarks/bench_serving.py --measure-disaggregation --model /tmp/bench-m2 \
        --num-prompts 192 --random-input-len 64 --random-output-len 128 \
        --random-range-ratio 0.5 --max-concurrency 64 --repeats 8 --detok-scaling 1,2,4 \
        --detok-steps 1000 --disable-tqdm --engine-cores 0 \
        --engine-flags "--max-total-tokens 40000 --max-running-requests 64 \
                        --disable-overlap-schedule"

and `results/bench_serving_disagg_mixed.json` from the same with `--enable-mixed-chunk` added to
`--engine-flags` (both sides), `--detok-scaling 1 --detok-steps 500` and `--result-name
bench_serving_disagg_mixed`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_GENERATE = ("sluice", "sglang", "sglang-native")
_COMPLETIONS = ("openai", "sglang-oai", "vllm")
_CHAT = ("openai-chat", "sglang-oai-chat", "vllm-chat")


@dataclass
class Request:
    prompt: str
    prompt_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass
class Output:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""


# -- datasets ------------------------------------------------------------------------------------
def _token_pool(tokenizer: Any) -> np.ndarray:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return np.array([t for t in range(len(tokenizer)) if t not in special])


def random_requests(args: argparse.Namespace, tokenizer: Any, seed: int) -> list[Request]:
    """SGLang's `random` dataset: lengths uniform in [len * range_ratio, len], random tokens."""
    rng = np.random.default_rng(seed)
    pool = _token_pool(tokenizer)
    n = args.num_prompts
    in_lens = rng.integers(
        max(int(args.random_input_len * args.random_range_ratio), 1),
        args.random_input_len + 1,
        size=n,
    )
    out_lens = rng.integers(
        max(int(args.random_output_len * args.random_range_ratio), 1),
        args.random_output_len + 1,
        size=n,
    )
    out = []
    for in_len, out_len in zip(in_lens, out_lens, strict=True):
        ids = rng.choice(pool, size=int(in_len)).tolist()
        out.append(Request(tokenizer.decode(ids), ids, int(out_len)))
    return out


def shared_prefix_requests(args: argparse.Namespace, tokenizer: Any, seed: int) -> list[Request]:
    """SGLang's `generated-shared-prefix`: groups of questions behind one long system prompt."""
    rng = np.random.default_rng(seed)
    pool = _token_pool(tokenizer)
    out = []
    for _ in range(args.gsp_num_groups):
        system = rng.choice(pool, size=args.gsp_system_prompt_len).tolist()
        for _ in range(args.gsp_prompts_per_group):
            ids = system + rng.choice(pool, size=args.gsp_question_len).tolist()
            out.append(Request(tokenizer.decode(ids), ids, args.gsp_output_len))
    random.Random(seed).shuffle(out)
    return out


def load_tokenizer(path: str | None) -> Any:
    from engine.tokenizer import load_tokenizer as load
    from services.engine_args import ensure_model

    return load(ensure_model(path))


# -- one request per backend ---------------------------------------------------------------------
def _payload(args: argparse.Namespace, model: str, req: Request) -> tuple[str, dict]:
    stream = not args.disable_stream
    ignore_eos = not args.disable_ignore_eos
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    if args.backend in _GENERATE:
        prompt = {"input_ids": req.prompt_ids} if args.tokenize_prompt else {"text": req.prompt}
        params = {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": ignore_eos}
        return "/generate", {**prompt, "sampling_params": params, "stream": stream, **extra}
    body = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": stream,
        **extra,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if args.backend in _CHAT:
        return "/v1/chat/completions", {
            **body,
            "messages": [{"role": "user", "content": req.prompt}],
        }
    prompt = req.prompt_ids if args.tokenize_prompt else req.prompt
    return "/v1/completions", {**body, "prompt": prompt}


def _chunk_text(backend: str, data: dict) -> tuple[str, int | None]:
    """(text this chunk adds or the whole text so far for /generate, tokens so far if told)."""
    if backend in _GENERATE:
        return data.get("text", ""), data.get("meta_info", {}).get("completion_tokens")
    usage = data.get("usage") or {}
    if not data.get("choices"):
        return "", usage.get("completion_tokens")
    choice = data["choices"][0]
    text = choice.get("text") if backend in _COMPLETIONS else choice["delta"].get("content")
    return text or "", usage.get("completion_tokens")


async def send(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    base: str,
    model: str,
    req: Request,
    headers: dict,
) -> Output:
    path, body = _payload(args, model, req)
    out = Output(prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    try:
        async with session.post(base + path, json=body, headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {await resp.text()}"
                return out
            if args.disable_stream:
                data = await resp.json()
                out.text, tokens = _whole_text(args.backend, data)
                out.ttft = out.latency = time.perf_counter() - start
                out.output_len = tokens
                out.success = True
                return out
            tokens = None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    out.error = data["error"].get("message", "error")
                    return out
                text, told = _chunk_text(args.backend, data)
                tokens = told if told is not None else tokens
                if not text:
                    continue
                now = time.perf_counter()
                if out.ttft == 0.0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
                out.text = text if args.backend in _GENERATE else out.text + text
            out.latency = time.perf_counter() - start
            out.output_len = tokens if tokens is not None else req.output_len
            out.success = True
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out.error = repr(exc)
    return out


def _whole_text(backend: str, data: dict) -> tuple[str, int]:
    if backend in _GENERATE:
        return data["text"], data["meta_info"]["completion_tokens"]
    choice = data["choices"][0]
    text = choice["text"] if backend in _COMPLETIONS else choice["message"]["content"]
    return text, data["usage"]["completion_tokens"]


# -- the run -------------------------------------------------------------------------------------
async def run_requests(
    args: argparse.Namespace, base: str, requests: list[Request], model: str
) -> tuple[list[Output], float]:
    headers = (
        {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
        if os.environ.get("OPENAI_API_KEY")
        else {}
    )
    limit = args.max_concurrency or len(requests)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for _ in range(args.warmup_requests):
            warm = await send(session, args, base, model, _warmup(requests[0]), headers)
            if not warm.success:
                raise SystemExit(f"warmup request failed: {warm.error}")
        sem = asyncio.Semaphore(limit)
        bar = _progress(len(requests), args.disable_tqdm)

        async def limited(req: Request) -> Output:
            async with sem:
                out = await send(session, args, base, model, req, headers)
            bar.update(1)
            return out

        rng = np.random.default_rng(args.seed)
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(outputs), duration


def _warmup(req: Request) -> Request:
    return Request(req.prompt, req.prompt_ids, min(req.output_len, 16))


def _progress(total: int, disable: bool) -> Any:
    from tqdm.asyncio import tqdm

    return tqdm(total=total, disable=disable, desc="requests")


def summarize(outputs: list[Output], duration: float) -> dict[str, Any]:
    """SGLang's metrics (its key names), latencies in ms."""
    ok = [o for o in outputs if o.success]
    out_lens = [o.output_len for o in ok]
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    itls = [x for o in ok for x in o.itl]
    res: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration": duration,
        "total_input_tokens": sum(o.prompt_len for o in ok),
        "total_output_tokens": sum(out_lens),
        "request_throughput": len(ok) / duration,
        "input_throughput": sum(o.prompt_len for o in ok) / duration,
        "output_throughput": sum(out_lens) / duration,
        "concurrency": sum(o.latency for o in ok) / duration,
    }
    for name, values in (
        ("ttft", [o.ttft for o in ok]),
        ("tpot", tpots),
        ("itl", itls),
        ("e2e_latency", [o.latency for o in ok]),
    ):
        arr = np.array(values or [0.0]) * 1000
        res.update(
            {
                f"mean_{name}_ms": float(arr.mean()),
                f"median_{name}_ms": float(np.median(arr)),
                f"std_{name}_ms": float(arr.std()),
                f"p95_{name}_ms": float(np.percentile(arr, 95)),
                f"p99_{name}_ms": float(np.percentile(arr, 99)),
            }
        )
    errors = [o.error for o in outputs if not o.success]
    if errors:
        res["first_error"] = errors[0]
    return res


def print_summary(title: str, res: dict[str, Any]) -> None:
    print(f"{'=' * 16} {title} {'=' * 16}")
    rows = [
        ("Successful requests", "completed"),
        ("Benchmark duration (s)", "duration"),
        ("Total input tokens", "total_input_tokens"),
        ("Total generated tokens", "total_output_tokens"),
        ("Request throughput (req/s)", "request_throughput"),
        ("Input token throughput (tok/s)", "input_throughput"),
        ("Output token throughput (tok/s)", "output_throughput"),
        ("Concurrency", "concurrency"),
    ]
    for metric in ("e2e_latency", "ttft", "tpot", "itl"):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {metric.upper()} (ms)", f"{stat}_{metric}_ms"))
    for label, key in rows:
        value = res.get(key)
        print(
            f"{label:<36}{value:>14.2f}"
            if isinstance(value, float)
            else f"{label:<36}{value!s:>14}"
        )
    if res.get("failed"):
        print(f"failed: {res['failed']} (first error: {res.get('first_error')})")


def base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


async def served_model(base: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(base + "/v1/models") as resp:
        return (await resp.json())["data"][0]["id"]


def make_requests(
    args: argparse.Namespace, tokenizer: Any, seed: int | None = None
) -> list[Request]:
    make = random_requests if args.dataset_name == "random" else shared_prefix_requests
    return make(args, tokenizer, args.seed if seed is None else seed)


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    requests = make_requests(args, tokenizer)
    base = base_url(args)
    model = args.served_model_name or asyncio.run(served_model(base))
    outputs, duration = asyncio.run(run_requests(args, base, requests, model))
    res = summarize(outputs, duration)
    res.update(
        backend=args.backend,
        dataset_name=args.dataset_name,
        num_prompts=len(requests),
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
    )
    print_summary("Serving Benchmark Result", res)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(res) + "\n")
    return res


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="sluice", choices=_GENERATE + _COMPLETIONS + _CHAT)
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--model",
        default=None,
        help="model folder (tokenizer; the served model "
        "for --measure-disaggregation); default: the generated tiny model",
    )
    p.add_argument("--served-model-name", default=None, help="default: GET /v1/models")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model)")
    p.add_argument(
        "--dataset-name", default="random", choices=["random", "generated-shared-prefix"]
    )
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append the result as a JSON line")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument(
        "--tokenize-prompt",
        action="store_true",
        help="send token ids instead of text (exact input lengths)",
    )
    p.add_argument("--extra-request-body", default=None, help="JSON merged into every request")
    p.add_argument("--warmup-requests", type=int, default=1)
    g = p.add_argument_group("--measure-disaggregation (see benchmarks/serving_disagg.py)")
    g.add_argument("--measure-disaggregation", action="store_true")
    g.add_argument(
        "--engine-flags",
        default="",
        help="engine flags for both sides, e.g. "
        "'--max-running-requests 64 --max-total-tokens 60000'",
    )
    g.add_argument("--repeats", type=int, default=2, help="paired runs, alternating the order")
    g.add_argument("--tokenizers", type=int, default=1)
    g.add_argument("--detokenizers", type=int, default=1)
    g.add_argument("--detok-scaling", default="1,2,4", help="detokenizer counts to measure")
    g.add_argument("--detok-steps", type=int, default=1000, help="synthetic steps per run")
    g.add_argument("--detok-batch", type=int, default=64, help="requests per synthetic step")
    g.add_argument(
        "--engine-cores",
        default=None,
        help="e.g. '0': the in-process engine and the worker run on these cores with one "
        "torch thread per core; the client and the other services on the remaining cores "
        "(a GPU host's layout: the model's compute does not share cores with the services)",
    )
    g.add_argument("--result-name", default="bench_serving_disagg")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.measure_disaggregation:
        from benchmarks.serving_disagg import measure

        measure(args)
    else:
        benchmark(args)


if __name__ == "__main__":
    main()
