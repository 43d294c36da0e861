"""Compile every Triton kernel for an NVIDIA GPU (default the H100, sm_90a) without one, and
report each variant's registers, spills and shared memory.

Why: CI runs the kernels under TRITON_INTERPRET=1, which ignores num_warps and compiles nothing,
so a kernel can pass there and still fail to compile, spill registers or overflow shared memory
on the GPU, where device time is scarce. This runs the real compiler (Triton -> PTX -> ptxas for
the target) and flags a variant that spills, that needs more shared memory than one block may
have, that needs more registers than one SM holds, or that does not compile.

How: a stand-in Triton driver reports the target, and `knobs.runtime.jit_cache_hook` (called
where Triton would compile a variant it has not seen) compiles it with `triton.compile` and
returns True, which tells Triton to skip its own compile and the launch. So the kernels' own
launchers run unchanged on CPU tensors and choose the constexprs and num_warps they choose on
the GPU. The resource figures are ptxas's own `-v` report from Triton's compile
(`dump_ptxas_log`; `always_compile`, so that a cached kernel still runs ptxas).

The code depends on dtype, head_dim, the GQA group and num_warps, not on the page size: the
kernels read K/V slot by slot through req_to_token, so the page size only changes which slots
the table holds (batch size and sequence lengths are runtime values too).

The cases (kernels at the engine's shapes and variants) are listed in kernels/compile_cases.py.

Run with TRITON_INTERPRET unset (Triton fixes interpreter mode at import):
`python -m kernels.compile_check [--arch 90] [--json PATH] [--jobs N]`; exit status 1 on any
problem. `--jobs` (default: the cores, at most 8) splits the cases over child processes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.runtime import driver

from kernels.compile_cases import cases
from kernels.jit import interpreting

# Largest shared memory one block may opt into, per compute capability.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
REGISTERS_PER_SM = 65536


@dataclass
class Variant:
    """One kernel compiled for one case; figures are ptxas's, problems empty when it is fine."""

    kernel: str
    dtype: str
    head_dim: int | None = None
    num_heads: int | None = None  # Hq
    num_kv_heads: int | None = None  # Hk
    num_warps: int | None = None
    case: str | None = None  # a sliding window, or a fused MoE case and which compile of it
    blocks: dict[str, int] = field(default_factory=dict)
    registers: int | None = None
    stack: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared: int | None = None
    pdl: bool = False  # compiled with PDL (--enable-pdl): griddepcontrol in its prologue
    problems: list[str] = field(default_factory=list)


class _TargetOnlyDriver:
    """Enough of a Triton driver to pick a target and a device; it cannot launch anything."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


def _compile(target: GPUTarget, fn: Any, compile: dict[str, Any]) -> dict[str, Any]:
    """Compile one variant as Triton's own launch path would; a failure is returned, not raised,
    so that the launcher goes on to its next kernel."""
    jit_fn = fn.jit_function
    consts = {jit_fn.arg_names[path[0]]: v for path, v in compile["constants"].items()}
    info: dict[str, Any] = {"kernel": fn.name, "num_warps": compile["num_warps"]}
    info["blocks"] = {k: v for k, v in consts.items() if k.startswith("BLOCK")}
    info["pdl"] = bool(consts.get("PDL", False))
    src = triton.compiler.ASTSource(
        jit_fn, compile["signature"], compile["constants"], compile["configs"][0]
    )
    options = {k: compile[k] for k in ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion")}
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # where dump_ptxas_log prints ptxas's report
            compiled = triton.compile(src, target=target, options=options)
    except Exception as exc:  # any compile failure is the finding
        info["problems"] = [f"compile failed: {type(exc).__name__}: {str(exc)[:2000]}"]
        return info
    report = log.getvalue()
    props = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes", report)
    regs = re.search(r"Used (\d+) registers", report)
    if props is None or regs is None:
        info["problems"] = ["no ptxas -v report in the compile log"]
        return info
    info["stack"], info["spill_stores"], info["spill_loads"] = map(int, props.groups())
    info["registers"] = int(regs.group(1))
    info["shared"] = compiled.metadata.shared
    info["problems"] = pdl_problems(compiled.asm["ptx"], info["pdl"])
    return info


# an instruction that may touch memory other kernels read or write (after an optional
# predicate): global loads, stores, atomics and reductions, asynchronous copies, prefetches
# (their state space after the opcode; param, shared, local and const are this kernel's own)
_MEMORY_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld|st|atom|red|cp\.async|prefetch)\b\.?(\S*)", re.M)
_OWN_SPACES = ("param", "shared", "local", "const")


def pdl_problems(ptx: str, pdl: bool) -> list[str]:
    """What breaks `kernels.jit.pdl_prologue`'s rule in a kernel's PTX: with PDL, a memory
    access before the first `griddepcontrol.wait` (the earlier kernel may still be writing),
    or no wait, or `launch_dependents` before it; without, any griddepcontrol at all.
    (Text order: the prologue is the kernel's entry block, which PTX lists first.)"""
    wait = ptx.find("griddepcontrol.wait")
    launch = ptx.find("griddepcontrol.launch_dependents")
    if not pdl:
        return ["griddepcontrol in a kernel compiled without PDL"] if max(wait, launch) >= 0 else []
    if wait < 0 or launch < 0:
        return ["PDL: griddepcontrol.wait or launch_dependents missing"]
    if launch < wait:
        return ["PDL: launch_dependents before griddepcontrol.wait"]
    for m in _MEMORY_OP.finditer(ptx, 0, wait):
        if m.group(1) in ("ld", "st") and m.group(2).split(".")[0] in _OWN_SPACES:
            continue
        return [f"PDL: memory access before griddepcontrol.wait: {m.group(0).strip()}"]
    return []


@contextlib.contextmanager
def offline_compiler(arch: int) -> Iterator[list[dict[str, Any]]]:
    """While open, launching a Triton kernel compiles it for `arch` and appends its compile info
    to the yielded list instead of running it. Restores the driver, the hook and the knobs."""
    target = GPUTarget("cuda", arch, 32)
    compiled: list[dict[str, Any]] = []
    seen: dict[tuple[str, str], dict[str, Any]] = {}  # same specialisation: compile once
    touched: list[Any] = []

    def hook(*, key: str, repr: str, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        if (fn.name, key) not in seen:
            seen[fn.name, key] = _compile(target, fn, compile)
            touched.append(fn.jit_function)
        compiled.append(seen[fn.name, key])
        return True

    previous_driver = driver._active  # not `.active`: that would create the real (CUDA) one
    with knobs.runtime.scope(), knobs.nvidia.scope(), knobs.compilation.scope():
        knobs.runtime.jit_cache_hook = hook
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        driver.set_active(_TargetOnlyDriver(target))
        try:
            yield compiled
        finally:
            driver._active = previous_driver
            for jit_fn in touched:  # their binders hold the stand-in target
                jit_fn.device_caches.clear()


def _problems(v: dict[str, Any], arch: int) -> list[str]:
    if v.get("problems"):
        return v["problems"]
    found = []
    if v["spill_stores"] or v["spill_loads"]:
        found.append(f"spills {v['spill_stores']} B stored / {v['spill_loads']} B loaded")
    limit = SHARED_LIMIT.get(arch, SHARED_LIMIT[90])
    if v["shared"] > limit:
        found.append(f"shared memory {v['shared']} B > {limit} B")
    if v["registers"] * v["num_warps"] * 32 > REGISTERS_PER_SM:
        found.append(f"{v['registers']} registers x {v['num_warps'] * 32} threads > 65536")
    return found


def check(arch: int = 90) -> list[Variant]:
    """Compile every case's kernels for `arch`; one Variant per kernel launched per case."""
    return [v for _, v in _check(arch, (0, 1))]


def _check(arch: int, shard: tuple[int, int]) -> list[tuple[int, Variant]]:
    """`check` of the cases whose index is k modulo n (`shard` (k, n): one of n processes),
    each variant with its case's index."""
    if interpreting():
        raise RuntimeError("Triton is in interpreter mode: unset TRITON_INTERPRET")
    variants = []
    k, n = shard
    with offline_compiler(arch) as compiled:
        for index, (labels, launch) in enumerate(cases()):
            if index % n != k:
                continue
            start = len(compiled)
            launch()
            counts: dict[str, int] = {}
            for info in compiled[start:]:
                extra = {"problems": _problems(info, arch)}
                if "moe" in labels.get("case", ""):  # two GEMMs: one kernel compiled twice
                    counts[info["kernel"]] = counts.get(info["kernel"], 0) + 1
                    extra["case"] = f"{labels['case']} #{counts[info['kernel']]}"
                variants.append((index, Variant(**{**labels, **info, **extra})))
    return variants


def _table(variants: list[Variant]) -> str:
    head = "kernel dtype D|case Hq/Hk warps blocks regs stack spill_st spill_ld shared status"
    rows = [head.split()]
    for v in variants:
        heads = f"{v.num_heads or '-'}/{v.num_kv_heads}" if v.num_kv_heads else "-"
        blocks = ",".join(f"{k.removeprefix('BLOCK_')}={n}" for k, n in v.blocks.items())
        figures = (v.registers, v.stack, v.spill_stores, v.spill_loads, v.shared)
        status = "OK" if not v.problems else "; ".join(v.problems).splitlines()[0][:100]
        shape = "|".join(str(x).replace(" ", "_") for x in (v.head_dim, v.case) if x) or None
        cells = (v.kernel, v.dtype, shape, heads, v.num_warps, blocks, *figures, status)
        rows.append(["-" if c is None else str(c) for c in cells])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head.split()) - 1)]
    return "\n".join(" ".join(c.ljust(w) for c, w in zip(r, widths)) + " " + r[-1] for r in rows)


def _ptxas_version(arch: int) -> str:
    """The binary Triton runs for `arch` (3.9 uses ptxas-blackwell for sm_90) and its release."""
    path = get_ptxas(arch).path
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True)
    return f"{os.path.basename(path)}: {out.stdout.strip().splitlines()[-2]}"


def check_in_processes(arch: int, jobs: int) -> list[Variant]:
    """`check` split over `jobs` child processes (each compiles every jobs-th case; ptxas is
    the cost), the variants in the order one process would list them."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for k in range(jobs):
            cmd = [sys.executable, "-m", "kernels.compile_check", "--arch", str(arch),
                   "--shard", f"{k}/{jobs}", "--json", os.path.join(tmp, f"{k}.json")]  # fmt: skip
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
        for proc in procs:
            proc.wait()
        variants = []
        for k in range(jobs):
            path = os.path.join(tmp, f"{k}.json")
            if not os.path.exists(path):
                raise RuntimeError(f"compile_check shard {k}/{jobs} failed (no report)")
            with open(path) as f:
                variants += [(v.pop("index"), Variant(**v)) for v in json.load(f)["variants"]]
    return [v for _, v in sorted(variants, key=lambda iv: iv[0])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    parser.add_argument("--json", help="write the variants and versions here")
    parser.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 8),
                        help="processes compiling in parallel (default: the cores, at most 8)")
    parser.add_argument("--shard", help=argparse.SUPPRESS)  # k/n: one of --jobs' processes
    args = parser.parse_args(argv)
    if args.shard:  # a child of check_in_processes: its cases' variants, indexed, as JSON
        k, n = (int(x) for x in args.shard.split("/"))
        found = _check(args.arch, (k, n))
        with open(args.json, "w") as f:
            json.dump({"variants": [{**asdict(v), "index": i} for i, v in found]}, f, default=str)
        return 0
    if args.jobs > 1:
        variants = check_in_processes(args.arch, args.jobs)
    else:
        variants = check(args.arch)
    print(_table(variants))
    bad = [v for v in variants if v.problems]
    print(f"{len(variants)} variants, {len(bad)} with problems")
    if args.json:
        report = {
            "command": " ".join([sys.executable, "-m", "kernels.compile_check", *sys.argv[1:]]),
            "triton": triton.__version__,
            "torch": torch.__version__,
            "host": platform.platform(),
            "ptxas": _ptxas_version(args.arch),
            "target": {"arch": args.arch, "sm": sm_arch_from_capability(args.arch)},
            "shared_limit": SHARED_LIMIT.get(args.arch, SHARED_LIMIT[90]),
            "variants": [asdict(v) for v in variants],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
