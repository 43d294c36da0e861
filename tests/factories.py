"""Shared test factories: tiny models per architecture (built once per session), prompt sets,
and the transformers greedy reference."""

from __future__ import annotations

import atexit
import functools
import os
import random
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import pytest
import torch

DENSE_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma2", "gemma3_text")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe")
ARCHS = DENSE_ARCHS + MOE_ARCHS
# test model name -> (arch, sliding window): Mistral windows every layer, Qwen2-MoE's config
# every other one (a model of full and windowed layers)
WINDOWED_MODELS = {"mistral-sliding": ("mistral", 32), "qwen2_moe-sliding": ("qwen2_moe", 32)}
_ROOT = tempfile.mkdtemp(prefix="sluice-test-models-")
# (each test process's models, ~0.7 GB by the end of a suite: 928 runs' worth had filled the
# disk before they were removed when the process ends)
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


def require_compiled_cuda() -> None:
    """Skip the calling test module unless kernels run compiled on a CUDA GPU: a GPU, Triton
    installed, and not in the interpreter (TRITON_INTERPRET set). Call it before importing
    anything that imports triton."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU", allow_module_level=True)
    pytest.importorskip("triton", reason="triton is not installed")
    from kernels.jit import interpreting

    if interpreting():
        pytest.skip("TRITON_INTERPRET is set: these tests need compiled kernels",
                    allow_module_level=True)  # fmt: skip


@functools.cache
def tiny_model(
    arch: str,
    preset: str = "tiny",
    seed: int = 0,
    sliding_window: int | None = None,
    num_labels: int | None = None,
    pooling: str = "cls",
    head_dim: int | None = None,
) -> str:
    """A tiny model folder, built once; `num_labels`: a sequence classifier of that many;
    `pooling` ("cls" / "mean"): an encoder embedding model's (bert, xlm-roberta); `head_dim`:
    other than the preset's (flashinfer's kernels take 64, 128 or 256; tiny's is 16)."""
    from services.tiny_model import make_tiny_model

    window = f"-sw{sliding_window}" if sliding_window else ""
    labels = f"-cls{num_labels}" if num_labels else ""
    pool = f"-{pooling}" if pooling != "cls" else ""
    hd = f"-hd{head_dim}" if head_dim else ""
    out = os.path.join(_ROOT, f"{arch}-{preset}-{seed}{window}{labels}{pool}{hd}")
    if not os.path.exists(os.path.join(out, "config.json")):
        make_tiny_model(out, arch=arch, preset=preset, seed=seed, sliding_window=sliding_window,
                        num_labels=num_labels, pooling=pooling,
                        **({"head_dim": head_dim} if head_dim else {}))  # fmt: skip
    return out


def tiny_fp8_model(arch: str, block_size: int = 16) -> str:
    """`tiny_model(arch)` as an FP8 checkpoint (services/tiny_fp8.py; 0: per-tensor scales)."""

    from services.tiny_fp8 import quantize_checkpoint

    out = os.path.join(_ROOT, f"{arch}-tiny-0-fp8b{block_size}")
    if not os.path.exists(os.path.join(out, "config.json")):
        shutil.copytree(tiny_model(arch), out + ".tmp", dirs_exist_ok=True)
        quantize_checkpoint(out + ".tmp", block_size)
        os.replace(out + ".tmp", out)
    return out


def tiny_int_weight_model(
    arch: str,
    bits: int = 4,
    group: int | None = 16,
    symmetric: bool = True,
    seed: int = 0,
    act_order: bool = False,
) -> str:
    """`tiny_model(arch, seed=seed)` as a compressed-tensors W4A16 / W8A16 checkpoint
    (services/tiny_int_weight.py; group None: per output channel; `act_order`: the groups
    of each layer's columns in `column_order`, stored in that order, for `tiny_gptq_model`)."""

    from services.tiny_int_weight import quantize_checkpoint

    kind = f"w{bits}g{group or 'ch'}{'' if symmetric else 'asym'}{'ao' if act_order else ''}"
    out = os.path.join(_ROOT, f"{arch}-tiny-{seed}-{kind}")
    if not os.path.exists(os.path.join(out, "config.json")):
        shutil.copytree(tiny_model(arch, seed=seed), out + ".tmp", dirs_exist_ok=True)
        quantize_checkpoint(out + ".tmp", bits, group, symmetric, act_order)
        os.replace(out + ".tmp", out)
    return out


def config_variant(source: str, out: str, edit: Any) -> str:
    """A copy of the model folder `source` at `out` with its quantization_config edited in
    place by `edit(qc)`."""
    import json

    shutil.copytree(source, out)
    config_file = os.path.join(out, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    with open(config_file, "w") as f:
        json.dump(config, f)
    return out


def tiny_w8a8_model(arch: str) -> str:
    """`tiny_model(arch)` as a compressed-tensors W8A8 (int8) checkpoint: llm-compressor's
    scheme, "int-quantized" (services/tiny_int_weight.py)."""

    from services.tiny_int_weight import quantize_checkpoint

    out = os.path.join(_ROOT, f"{arch}-tiny-0-w8a8")
    if not os.path.exists(os.path.join(out, "config.json")):
        shutil.copytree(tiny_model(arch), out + ".tmp", dirs_exist_ok=True)
        quantize_checkpoint(out + ".tmp", activations=True)
        os.replace(out + ".tmp", out)
    return out


def tiny_gptq_model(
    arch: str,
    bits: int = 4,
    group: int | None = 16,
    symmetric: bool = True,
    act_order: bool = False,
    layout: str = "gptq",
) -> str:
    """`tiny_int_weight_model(...)` rewritten as a GPTQ checkpoint (`to_gptq`)."""

    from services.tiny_int_weight import to_gptq

    source = tiny_int_weight_model(arch, bits, group, symmetric, act_order=act_order)
    out = f"{source}-{layout}"
    if not os.path.exists(os.path.join(out, "config.json")):
        shutil.copytree(source, out + ".tmp", dirs_exist_ok=True)
        to_gptq(out + ".tmp", act_order, layout)
        os.replace(out + ".tmp", out)
    return out


def dequantized_copy(path: str, out: str, act_order: bool = False) -> str:
    """A float checkpoint of a pack-quantized one (`tiny_int_weight_model`), its weights
    unpacked by compressed-tensors (`unpack_from_int32`) and scaled: what the engine must
    compute with. `act_order`: each layer's columns put back from `column_order` (the model
    its GPTQ rewrite holds)."""
    import json

    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file, save_file

    from services.tiny_int_weight import column_order

    shutil.copytree(path, out)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    bits = config.pop("quantization_config")["config_groups"]["group_0"]["weights"]["num_bits"]
    file = os.path.join(out, "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        base = name.removesuffix("_packed")
        shape = tensors.pop(base + "_shape")
        q = unpack_from_int32(tensors.pop(name), bits, torch.Size(shape.tolist())).float()
        scale = tensors.pop(base + "_scale").float()
        group = shape[1].item() // scale.shape[1]
        if base + "_zero_point" in tensors:
            zero = unpack_from_int32(tensors.pop(base + "_zero_point"), bits, scale.shape,
                                     packed_dim=0)  # fmt: skip
            q = q - zero.float().repeat_interleave(group, 1)
        w = q * scale.repeat_interleave(group, 1)
        if act_order:  # (column j is the model's column order[j])
            order = column_order(base.removesuffix(".weight"), w.shape[1])
            w = torch.empty_like(w).index_copy_(1, order, w)
        tensors[base] = w
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


@functools.cache
def tiny_lora(model: str, seed: int, rank: int = 8, **kw: Any) -> str:
    """A random LoRA adapter (PEFT folder) of the model folder `model`, built once."""
    from services.tiny_lora import make_tiny_lora

    suffix = "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
    out = f"{model}-lora{seed}-r{rank}{suffix}"
    if not os.path.exists(os.path.join(out, "adapter_config.json")):
        make_tiny_lora(model, out, rank=rank, seed=seed, **kw)
    return out


def model_path(name: str, head_dim: int | None = None) -> str:
    """The tiny model of an architecture, or of a name in WINDOWED_MODELS."""
    if name in WINDOWED_MODELS:
        arch, window = WINDOWED_MODELS[name]
        return tiny_model(arch, sliding_window=window, head_dim=head_dim)
    return tiny_model(name, head_dim=head_dim)


BF16_TIE_NATS = 0.25  # about 2 bf16 ulps of logits of 16-32 (tiny models: top logits ~25)


def assert_equal_or_tied(got: list[dict], want: list[dict], tie: float = BF16_TIE_NATS) -> None:
    """Greedy outputs of two bf16 runs that take different kernel paths (another prefix-cache
    hit, another pool): equal, or equal up to a first divergence where the two tokens are
    `want`'s top two at that step within `tie` nats, a near-tie that bf16 rounding in another
    kernel may flip (after it the sequences differ, so the comparison stops). Both runs need
    `return_logprob=True, top_logprobs_num=2`."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        ta, tb = a["output_ids"], b["output_ids"]
        j = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if j is None:
            assert len(ta) == len(tb), f"request {i}: {len(ta)} tokens vs {len(tb)}"
            continue
        (lp0, t0, _), (lp1, t1, _) = b["meta_info"]["output_top_logprobs"][j][:2]
        assert {t0, t1} == {ta[j], tb[j]} and lp0 - lp1 <= tie, (
            f"request {i}: first divergence at token {j} ({ta[j]} vs {tb[j]}) is not a "
            f"near-tie of the reference (top two: {t0} at {lp0:.3f}, {t1} at {lp1:.3f})"
        )


def mixed_prompts(
    vocab_size: int, n: int = 16, seed: int = 0, max_len: int = 300
) -> list[list[int]]:
    """`n` prompts of mixed lengths in [1, max_len]; half share a long common prefix.
    Ids avoid the first few (special tokens) so no prompt contains EOS."""
    rng = random.Random(seed)
    lo = 8
    prefix = [rng.randrange(lo, vocab_size) for _ in range(max_len * 2 // 3)]
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            tail = [
                rng.randrange(lo, vocab_size) for _ in range(rng.randint(1, max_len - len(prefix)))
            ]
            prompts.append(prefix + tail)
        else:
            length = 1 if i == 1 else rng.randint(2, max_len)
            prompts.append([rng.randrange(lo, vocab_size) for _ in range(length)])
    return prompts


@functools.cache
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers (float32, no padding, EOS not special)."""
    model = _hf_model(path)
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        # No EOS at all (not min_new_tokens, which works by masking EOS out of the logits).
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@functools.cache
def _peft_model(path: str, adapter: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter).eval()


@torch.inference_mode()
def lora_greedy(
    path: str, adapter: str | None, prompt: list[int], max_new_tokens: int
) -> list[int]:
    """`hf_greedy` with a LoRA adapter applied by PEFT (None: the base model)."""
    if adapter is None:
        return hf_greedy(path, prompt, max_new_tokens)
    ids = torch.tensor([prompt])
    out = _peft_model(path, adapter).generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def top2_gap(path: str, ids: list[int]) -> float:
    """Gap between the two largest next-token logits after `ids` (transformers)."""
    logits = _hf_model(path)(torch.tensor([ids])).logits[0, -1].double()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


TIE_EPS = 1e-3


def count_graph_replays(monkeypatch: Any, verify: bool = False) -> list[int]:
    """The batch size of every CUDA graph replay from now on (the test's monkeypatch): of
    decode graphs, or (`verify`) of speculative verify graphs."""
    from engine.cuda_graph_runner import CudaGraphRunner
    from engine.speculative.verify_graphs import VerifyGraphRunner

    runner_class = VerifyGraphRunner if verify else CudaGraphRunner
    replays: list[int] = []
    replay = runner_class.replay

    def counting_replay(self, fb):
        replays.append(fb.batch_size)
        return replay(self, fb)

    monkeypatch.setattr(runner_class, "replay", counting_replay)
    return replays


def packed_experts_served(engine: Any, bits: int) -> list:
    """The engine's integer experts (`IntExpertWeights`), after checking that the tiny MoE's
    two layers each hold w13 and w2 packed: int32 words of 32 // `bits` integers along K."""
    from engine.layers.int_experts import IntExpertWeights

    moe = [m for m in engine.scheduler.model_runner.model.modules()
           if isinstance(m, IntExpertWeights)]  # fmt: skip
    assert len(moe) == 2 * 2  # w13 and w2 of both layers
    for m in moe:
        assert m.weight.dtype == torch.int32
        assert m.weight.shape == (m.num_local, m.out_features, -(-m.in_features * bits // 32))
    return moe


def assert_engine_clean(engine: Any) -> None:
    """After a run: the prefix cache is consistent and, flushed, gives back every KV slot (of
    the window pool too, over hybrid sliding-window memory) and request row (nothing leaked by
    the requests that ran)."""
    engine.scheduler.tree_cache.check_integrity()
    assert engine.flush_cache()
    allocator = engine.scheduler.model_runner.allocator
    assert allocator.available_size() == allocator.size, "KV slots leaked"
    window = getattr(allocator, "swa", None)  # hybrid sliding-window memory's window pool
    if window is not None:
        assert window.available_size() == window.size, "window KV slots leaked"
    pool = engine.scheduler.model_runner.req_to_token_pool
    assert pool.available_size() == pool.size, "request rows leaked"


def assert_greedy_match(path: str, prompt: list[int], got: list[int], want: list[int]) -> None:
    """Token-exact, except that a first mismatch on a genuine tie (top-2 gap < TIE_EPS) ends
    the comparison as equal (the rest of both sequences legitimately diverge)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            gap = top2_gap(path, prompt + want[:i])
            assert gap < TIE_EPS, (
                f"mismatch at new token {i}: got {a}, transformers {b}, top-2 gap {gap:.3g}\n"
                f"got  {got}\nwant {want}"
            )
            return
    assert len(got) == len(want), f"length differs: {len(got)} vs {len(want)}"


def paged_case_batch(case: Any, mode: Any, pool: Any, backend: Any, rows: Any = None) -> Any:
    """A ForwardBatch over a `kernels.testing.PagedCase` (on the case's device), for one
    attention backend and KV pool; `rows` picks some of its requests (decode batches)."""
    from engine.forward_batch import ForwardBatch

    rows = list(range(len(case.seq_lens))) if rows is None else rows
    extend = mode.is_extend()
    num_tokens = case.q.shape[0] if extend else len(rows)
    device = case.seq_lens.device
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(rows),
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        out_cache_loc=case.out_cache_loc if extend else case.out_cache_loc[rows],
        req_pool_indices=case.req_pool_indices[rows],
        seq_lens=case.seq_lens[rows],
        seq_lens_cpu=case.seq_lens[rows].tolist(),
        req_to_token=case.req_to_token,
        kv_pool=pool,
        attn_backend=backend,
        extend_prefix_lens_cpu=case.prefix_lens.tolist() if extend else None,
        extend_seq_lens_cpu=case.extend_lens.tolist() if extend else None,
        extend_start_loc=case.extend_start_loc if extend else None,
    )


# the scheduler loops a change to the running model must work under: without overlap, and
# with the overlap executor's forward thread and its device process (engine/overlap/)
SCHEDULER_LOOPS = pytest.mark.parametrize(
    "kw",
    [
        dict(disable_overlap_schedule=True),
        dict(cpu_overlap_executor="thread"),
        dict(cpu_overlap_executor="process"),
    ],
    ids=["no-overlap", "thread", "process"],
)


def run_python(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python ARGS` in a fresh interpreter that imports this checkout (its PYTHONPATH first),
    output captured as text."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)  # fmt: skip


def python_output(*args: str, timeout: float = 300) -> str:
    """`run_python(ARGS)`'s output, once it exited cleanly (its stderr's tail otherwise)."""
    proc = run_python(*args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
