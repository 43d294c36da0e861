"""What every benchmark records beside its numbers: the command, the machine, the versions."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
    }
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def versions(*names: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("sluice", "torch", "transformers", *names):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def write_result(name: str, results: Any, summary: dict[str, Any], **extra: Any) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    doc = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine_info(),
        "versions": versions(),
        "results": results,
        "summary": summary,
        **extra,
    }
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    return path


def write_profile(prof: Any, name: str, top: int = 30) -> str:
    """A cProfile's `top` functions by own time, then by cumulative time: printed, and written
    to results/NAME.txt; returns the text."""
    import io
    import pstats

    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    text = buf.getvalue()
    print(text)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(os.path.join(RESULTS_DIR, f"{name}.txt"), "w") as f:
        f.write(text)
    return text


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return "" if v is None else str(v)


def run_transformers_cb(
    manager: Any, prompts: list[list[int]], max_new_tokens: list[int], limit_s: float | None = None
) -> int:
    """Queue every prompt on a transformers continuous-batching manager, wait for all to
    finish and return the tokens generated; raises if the manager stops, or if it takes
    longer than `limit_s` (a stuck manager must not eat a time-boxed GPU)."""
    for p, n in zip(prompts, max_new_tokens, strict=True):
        manager.add_request(p, max_new_tokens=n)
    done = gen = 0
    deadline = None if limit_s is None else time.monotonic() + limit_s
    while done < len(prompts):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"transformers CB: {done}/{len(prompts)} done in {limit_s}s")
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            done += 1
            gen += len(result.generated_tokens)
        elif result is None and not manager.is_running():
            raise RuntimeError("transformers continuous batching stopped")
    return gen


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its live children: with the overlap
    loop on CPU the engine's forward runs in a device process, and `time.process_time()`
    would not count it."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def parse_arm_args(ap: Any, name: str | None = None) -> Any:
    """Parse the flags of a benchmark whose arms run interleaved, adding the ones they all
    take: --threads (torch's, set here), --seed, --repeat (timed runs per arm, the fastest
    counts) and, with a results `name`, --device, --dtype and --name (for a GPU run)."""
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per arm (the fastest)")
    if name is not None:
        ap.add_argument("--device", default="cpu")
        ap.add_argument("--dtype", default="auto")
        ap.add_argument("--name", default=name, help="results file name (no .json)")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return args


def parse_noise_args(ap: Any, archs: list[str], name: str, argv: list[str] | None) -> Any:
    """Parse the flags of a numerical-noise benchmark (bf16_noise.py, fp8_noise.py), adding
    the ones they share: --archs, --qk-scales, --device, --threads (torch's, set here) and
    --name."""
    ap.add_argument("--archs", nargs="+", default=archs)
    ap.add_argument("--qk-scales", type=float, nargs="+", default=[2.0, 1.0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    ap.add_argument("--name", default=name)
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return args


def write_noise_result(args: Any, rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """A noise benchmark's rows and summary, with the device it ran on."""
    import torch

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    write_result(args.name, rows, summary, device=device, args=vars(args))
    print(summary)


def small_model(layers: int, seed: int = 0, num_labels: int | None = None) -> str:
    """A random Llama of the `small` preset's shape with `layers` layers (built once, in the
    temp folder): the model of the CPU benchmarks that compare engine arms; with `num_labels`,
    a sequence classifier of its body."""
    import tempfile

    from services.tiny_model import make_tiny_model

    labels = f"-cls{num_labels}" if num_labels else ""
    path = os.path.join(tempfile.gettempdir(), f"sluice-bench-small-{layers}l-s{seed}{labels}")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_model(path, preset="small", seed=seed, num_layers=layers, num_labels=num_labels)
    return path


def count_decode_batches(scheduler: Any) -> list[int]:
    """Wrap an in-process engine's `scheduler.run_batch`: the returned list gets the number of
    requests of every decode batch it runs from now on."""
    sizes: list[int] = []
    run_batch = scheduler.run_batch

    def counted(batch: Any) -> Any:
        if batch.forward_mode.is_decode():
            sizes.append(len(batch.reqs))
        return run_batch(batch)

    scheduler.run_batch = counted
    return sizes


def score_prompts(engine: Any, prompts: list[list[int]]) -> dict[str, list[list[Any]]]:
    """Every prompt position's logprob of the prompt's own next token and top-1 token
    (`logprob_start_len=0`, `top_logprobs_num=1`), for `prompt_agreement`."""
    res = engine.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": 0},
        return_logprob=True, logprob_start_len=0, top_logprobs_num=1,
    )  # fmt: skip
    return {
        "prompt_logprobs": [
            [lp for lp, *_ in o["meta_info"]["input_token_logprobs"][1:]] for o in res
        ],
        "prompt_top": [
            [top[0][1] for top in o["meta_info"]["input_top_logprobs"][1:]] for o in res
        ],
    }


def prompt_agreement(arm: dict, full: dict) -> dict[str, float]:
    """`arm`'s `score_prompts` against `full`'s: top-1 agreement and |delta logprob|."""
    same = [a == b for x, y in zip(arm["prompt_top"], full["prompt_top"]) for a, b in zip(x, y)]
    deltas = [
        abs(a - b)
        for x, y in zip(arm["prompt_logprobs"], full["prompt_logprobs"])
        for a, b in zip(x, y)
    ]
    return {"top1_agreement": sum(same) / len(same), "mean_abs_dlogprob": statistics.mean(deltas),
            "max_abs_dlogprob": max(deltas), "positions": len(same)}  # fmt: skip


@contextlib.contextmanager
def base_worktree(root: str, rev: str) -> Iterator[tuple[str, dict[str, str]]]:
    """A temporary git worktree of `root` at revision `rev` (a benchmark's baseline), and the
    revisions compared: {"base_rev": rev's commit, "tree": HEAD's, "+dirty" when the tree has
    uncommitted changes to tracked files}. The worktree is removed on exit."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", root, *args], check=True, capture_output=True,
                              text=True).stdout.strip()  # fmt: skip

    base_rev = git("rev-parse", rev)
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    revs = {"base_rev": base_rev, "tree": git("rev-parse", "HEAD") + ("+dirty" if dirty else "")}
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        git("worktree", "add", "--detach", base, base_rev)
        try:
            yield base, revs
        finally:
            git("worktree", "remove", "--force", base)


def add_weight_format_args(p: Any, name: str) -> None:
    """The options of the benchmarks that run one model in several weight formats side by side
    (benchmarks/fp8.py, benchmarks/int_weight.py)."""
    p.add_argument("--preset", default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prefill-prompts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--name", default=name)
    p.add_argument("--arch", default=None,
                   help="the model's architecture (default: the preset's, Llama); a MoE "
                        "(qwen3_moe...) has its experts quantized in the quantized arms, and "
                        "adds their bytes")  # fmt: skip


def decode_and_prefill_speed(engine: Any, prompts: list[list[int]], args: Any) -> dict[str, float]:
    """Decode ms per token at batch 1 (`args.decode_tokens` after a 16-token prompt, the
    median of `args.repeats`, after a warm-up) and prefill tokens/s (`args.prefill_prompts`
    random prompts of 512 tokens, one output token each)."""
    import random

    decode = {"max_new_tokens": args.decode_tokens, "temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=prompts[0][:16], sampling_params={**decode, "max_new_tokens": 4})
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts[0][:16], sampling_params=decode)
        times.append(time.perf_counter() - t0)
    rng = random.Random(1)
    vocab = max(max(p) for p in prompts) + 1
    batch = [[rng.randrange(8, vocab) for _ in range(512)] for _ in range(args.prefill_prompts)]
    t0 = time.perf_counter()
    engine.generate(input_ids=batch, sampling_params={"max_new_tokens": 1})
    return {
        "decode_ms_per_token": 1e3 * statistics.median(times) / args.decode_tokens,
        "prefill_tok_s": 512 * len(batch) / (time.perf_counter() - t0),
    }


def expert_bytes(model: Any) -> dict[str, int]:
    """A MoE's experts' bytes (weights and scales, as stored: float8, packed integers...):
    {"expert_bytes": n}; {} for a model without experts."""
    from engine.layers.moe import ExpertWeights

    experts = [m for m in model.modules() if isinstance(m, ExpertWeights)]
    if not experts:
        return {}
    return {"expert_bytes": sum(t.nbytes for m in experts
                                for t in (*m.parameters(), *m.buffers()))}  # fmt: skip


def against_full(row: dict[str, Any], out: dict[str, Any], full: dict[str, Any]) -> None:
    """A weight format's speed and block-linear bytes as ratios to the full-precision arm's."""
    row["decode_speedup"] = full["decode_ms_per_token"] / out["decode_ms_per_token"]
    row["prefill_speedup"] = out["prefill_tok_s"] / full["prefill_tok_s"]
    if full.get("block_linear_bytes"):
        row["block_linear_bytes_ratio"] = out["block_linear_bytes"] / full["block_linear_bytes"]
    if full.get("expert_bytes"):  # (a MoE's experts)
        row["expert_bytes_ratio"] = out["expert_bytes"] / full["expert_bytes"]


def random_prompts(model_path: str, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` random token ids of the model's vocabulary (ids 8 and up)."""
    import random

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(length)] for _ in range(n)]
