"""Engine arguments as command-line flags (SGLang's spellings), shared by `generate` and the
worker service."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from engine.config import (
    ATTENTION_BACKENDS,
    CPU_OVERLAP_EXECUTORS,
    DECODE_TENSOR_CORES,
    GEMV_BACKENDS,
    GEMV_MAX_ROWS,
    SCHEDULE_POLICIES,
    TRITON_DECODE_MERGES,
    EngineArgs,
)
from engine.mem_cache.host_pool import HICACHE_WRITE_POLICIES
from engine.mem_cache.kv_quant import KV_CACHE_DTYPES
from engine.pooling import POOLING_TYPES
from engine.quantization import QUANTIZATION_METHODS
from engine.speculative import SPECULATIVE_ALGORITHM_NAMES, from_vllm_config

DEFAULT_MODEL_DIR = os.path.join(os.path.expanduser("~"), ".cache", "sluice", "tiny-llama")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        "--model-path",
        dest="model_path",
        default=None,
        help="Hugging Face model folder (default: a generated tiny model)",
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATION_METHODS,
        help="fp8: run the blocks' linear layers in float8 (W8A8, scales per output channel "
        "and per token), quantized as the model loads; an FP8 checkpoint (quant_method fp8 "
        "in its config) runs in FP8 without the flag, as do AWQ, GPTQ and compressed-tensors "
        "W4A16 / W8A16 / W8A8 ones on their integer weights (naming their method is "
        "accepted, and checked against the checkpoint)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="fp8 (= fp8_e4m3) or fp8_e5m2: K/V stored in float8, twice the tokens of a "
        "bfloat16 cache in the same memory; per-layer scales from the checkpoint "
        "(self_attn.k_scale / v_scale), else 1.0",
    )
    g.add_argument("--device", default="cpu")
    g.add_argument(
        "--tp-size",
        "--tp",
        "--tensor-parallel-size",
        dest="tp_size",
        type=int,
        default=1,
        help="split the model over this many devices (--device and the ones after it: "
        "cuda:0 with --tp-size 2 takes cuda:0 and cuda:1); rank 0 schedules for all. Llama, "
        "Mistral, Qwen2 and Qwen3 models",
    )
    g.add_argument(
        "--ep-size",
        "--ep",
        "--expert-parallel-size",
        dest="ep_size",
        type=int,
        default=1,
        help="mixture-of-experts layers: split the experts into this many groups of the "
        "--tp-size ranks (which it divides), each group holding its share of the experts "
        "(whole when it equals --tp-size) instead of every rank a slice of every expert",
    )
    g.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="machines the --tp-size ranks span (each runs tp-size / nnodes of them); node 0 "
        "runs the worker, the others `sluice worker --node-rank N` with the same flags",
    )
    g.add_argument("--node-rank", type=int, default=0, help="this machine's node (0 schedules)")
    g.add_argument(
        "--dist-init-addr",
        default=None,
        help="HOST:PORT where node 0's rank 0 listens for the others (with --nnodes > 1)",
    )
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="vLLM's flag: --ep-size equal to --tp-size",
    )
    g.add_argument("--page-size", type=int, default=1)
    g.add_argument("--chunked-prefill-size", type=int, default=8192)
    g.add_argument("--max-prefill-tokens", type=int, default=16384)
    g.add_argument("--max-running-requests", type=int, default=256)
    g.add_argument("--max-total-tokens", type=int, default=None)
    g.add_argument("--mem-fraction-static", type=float, default=0.85)
    g.add_argument("--context-length", type=int, default=None)
    g.add_argument("--schedule-policy", default="fcfs", choices=SCHEDULE_POLICIES)
    g.add_argument(
        "--enable-priority-scheduling",
        action="store_true",
        help="order waiting requests by their `priority` (larger first), and let one preempt "
        "running requests whose priority is worse by more than the threshold",
    )
    g.add_argument(
        "--schedule-low-priority-values-first",
        action="store_true",
        help="with priority scheduling: smaller `priority` values go first (vLLM's order)",
    )
    g.add_argument("--priority-scheduling-preemption-threshold", type=int, default=10)
    g.add_argument("--disable-radix-cache", action="store_true")
    g.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="weights released while idle (/release_memory_occupation) are copied to host "
        "memory first and back at the resume; without it they are discarded and read from "
        "the checkpoint again (vLLM's /sleep says it per call: level 1 or 2)",
    )
    g.add_argument(
        "--enable-memory-saver",
        "--enable-sleep-mode",
        dest="enable_memory_saver",
        action="store_true",
        help="accepted for SGLang's and vLLM's command lines: releasing memory while idle "
        "needs nothing set up at start here",
    )
    g.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="keep prefixes evicted from the device's KV pool in a host-memory pool, and load "
        "them back when a request reuses them (SGLang's HiCache)",
    )
    g.add_argument(
        "--hicache-ratio",
        type=float,
        default=2.0,
        help="the host pool's size as a multiple of the device pool's tokens (> 1)",
    )
    g.add_argument(
        "--hicache-size",
        type=float,
        default=0.0,
        help="the host pool's size in GB (10^9 bytes of K/V); overrides --hicache-ratio",
    )
    g.add_argument(
        "--hicache-write-policy",
        default="write_through",
        choices=HICACHE_WRITE_POLICIES,
        help="when a prefix is copied to host memory: as it is cached (write_through), when "
        "it is reused (write_through_selective), or when it is evicted (write_back)",
    )
    g.add_argument(
        "--hybrid-swa-memory",
        action="store_true",
        help="sliding-window layers keep K/V only for the tokens their window still reads, in "
        "a smaller pool (models with windowed and, or only, full layers: Gemma 2/3, Mistral)",
    )
    g.add_argument(
        "--swa-full-tokens-ratio",
        type=float,
        default=0.8,
        help="with --hybrid-swa-memory: the window pool's size, as a fraction of the full pool's",
    )
    g.add_argument("--disable-overlap-schedule", action="store_true")
    g.add_argument(
        "--enable-mixed-chunk",
        action="store_true",
        help="running requests decode inside prefill batches instead of pausing for them",
    )
    g.add_argument(
        "--cpu-overlap-executor",
        default="process",
        choices=CPU_OVERLAP_EXECUTORS,
        help="on CPU, what runs the forward beside the overlap scheduler: a device process "
        "(default) or a thread of the scheduler's process (shares its GIL)",
    )
    g.add_argument("--attention-backend", default=None, choices=ATTENTION_BACKENDS)
    g.add_argument(
        "--prefill-attention-backend",
        default=None,
        choices=ATTENTION_BACKENDS,
        help="the backend of prefill (extend) batches only; default: --attention-backend's",
    )
    g.add_argument(
        "--decode-attention-backend",
        default=None,
        choices=ATTENTION_BACKENDS,
        help="the backend of decode batches (and their CUDA graphs) only; default: "
        "--attention-backend's (e.g. flashinfer prefill with triton decode)",
    )
    g.add_argument(
        "--triton-attention-num-kv-splits",
        type=int,
        default=None,
        help="KV splits of the Triton decode kernel (default: by batch size, 32 at batch 1 "
        "down to 8 from batch 4 for 8 KV heads on an H100): more help few requests over long "
        "contexts",
    )
    g.add_argument(
        "--triton-decode-merge",
        default="fused",
        choices=TRITON_DECODE_MERGES,
        help="how the Triton decode kernel merges its KV splits: fused (the last split program "
        "of each request and KV head merges, one launch a layer) or kernel (a second launch)",
    )
    g.add_argument(
        "--gemv-backend",
        default="auto",
        choices=GEMV_BACKENDS,
        help="triton: linear layers (and the lm_head) on inputs of up to --gemv-max-rows rows "
        "(decode at small batch) use the Triton GEMV instead of cuBLAS; torch: cuBLAS; auto "
        "(default): triton for 16-bit models on CUDA, torch elsewhere",
    )
    g.add_argument(
        "--gemv-max-rows",
        type=int,
        default=1,
        help=f"the most rows the Triton GEMV takes (1-{GEMV_MAX_ROWS}; default 1: on the H100 "
        "it lost to cuBLAS from 2 rows on for most projections)",
    )
    g.add_argument(
        "--disable-layer-kernels",
        action="store_true",
        help="the model layers' fused Triton kernels (RMSNorm / LayerNorm with the residual "
        "add, SiLU-and-mul, gelu_new, rotary with the K/V store) give way to their torch code",
    )
    g.add_argument(
        "--enable-pdl",
        action="store_const",
        const=True,
        default=None,
        help="launch the Triton kernels as programmatic dependent launches (Hopper and later): "
        "each may start while the one before it finishes, and waits for it in its first "
        "instruction; ignored with a warning on older GPUs and on the CPU. By default on "
        "where the Triton GEMV runs on such a GPU",
    )
    g.add_argument(
        "--disable-pdl",
        dest="enable_pdl",
        action="store_const",
        const=False,
        help="no programmatic dependent launches, also where the default would use them",
    )
    g.add_argument(
        "--flashinfer-decode-tensor-cores",
        default="auto",
        choices=DECODE_TENSOR_CORES,
        help="flashinfer decode kernel: on (tensor cores, its prefill kernel), off (CUDA "
        "cores), auto (on from 4 query heads per KV head, as SGLang)",
    )
    g.add_argument("--random-seed", type=int, default=0)
    g.add_argument(
        "--grammar-compile-threads",
        type=int,
        default=2,
        help="threads compiling structured-output grammars beside the scheduler (0: on the "
        "scheduler's thread, pausing the running requests while one compiles)",
    )
    g.add_argument("--disable-cuda-graph", action="store_true")
    g.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="largest decode batch captured in a CUDA graph (default min(max running, 256))",
    )
    g.add_argument(
        "--cuda-graph-bs",
        type=int,
        nargs="+",
        default=None,
        help="decode batch sizes to capture (default 1 2 4 8 16 24 ... up to the max)",
    )
    g.add_argument(
        "--lora-paths",
        "--lora-modules",
        nargs="+",
        default=(),
        metavar="NAME=PATH",
        help="LoRA adapters to serve (PEFT folders; NAME=PATH or PATH, named by its folder); "
        "a request picks one by `model` (NAME, or BASE:NAME) or `lora_path` on /generate",
    )
    g.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=8,
        help="LoRA adapters one batch may use (their device slots)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help="the rank the device slots hold (default: the adapters' largest, else 16); an "
        "adapter loaded later must not exceed it",
    )
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters loaded while running (POST /v1/load_lora_adapter or "
        "/load_lora_adapter), also with no --lora-paths",
    )

    _add_speculative_args(g)
    g.add_argument(
        "--is-embedding",
        action="store_true",
        help="serve an embedding model: /v1/embeddings pools each prompt's final hidden "
        "states into one normalised vector (no generation)",
    )
    g.add_argument(
        "--hf-overrides",
        "--json-model-override-args",
        dest="hf_overrides",
        default=None,
        metavar="JSON",
        help="config fields to replace (vLLM's --hf-overrides, SGLang's "
        "--json-model-override-args), e.g. a yes/no reranker served as a classifier: "
        '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
        '["no", "yes"], "is_original_qwen3_reranker": true}\'',
    )
    g.add_argument(
        "--pooling-type",
        type=str.lower,
        choices=POOLING_TYPES,
        default=None,
        help="with --is-embedding: the last token's state (decoder embedding models), the "
        "mean of all, or the first's (cls); mean and cls turn the radix cache off (default: "
        "the checkpoint's sentence-transformers pooling, else cls for BERT-style encoders "
        "and last for decoders)",
    )


class _VllmSpeculativeConfig(argparse.Action):
    """vLLM's --speculative-config JSON, set as the SGLang-named flags it stands for."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        try:
            fields = from_vllm_config(json.loads(values))
        except ValueError as e:  # (json.JSONDecodeError is one)
            parser.error(f"{option_string}: {e}")
        for name, value in fields.items():
            setattr(namespace, name, value)


def _add_speculative_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--speculative-algorithm",
        type=str.lower,
        choices=SPECULATIVE_ALGORITHM_NAMES,
        default=None,
        help="speculative decoding: ngram drafts each request's next tokens from its own "
        "text (prompt and output); standalone (or draft_model) has a smaller model of the "
        "same vocabulary draft them greedily (--speculative-draft-model-path); eagle / eagle3 "
        "(SGLang's EAGLE / EAGLE3) have an EAGLE head draft them from the model's hidden "
        "states (its folder in --speculative-draft-model-path; on DeepSeek-V3 or GLM-4.5 "
        "the model's own multi-token-prediction layer, as nextn / mtp: no path needed); the "
        "drafts are verified by the model in one forward (turns overlap off)",
    )
    g.add_argument(
        "--speculative-draft-model-path",
        type=str,
        default=None,
        help="with --speculative-algorithm standalone: the draft model's folder (a Hugging "
        "Face folder of a supported architecture, the same tokenizer as the model); with "
        "eagle / eagle3: the EAGLE head's folder (its published checkpoint format; default "
        "for eagle on a DeepSeek-V3 / GLM-4.5 checkpoint with an MTP layer: the model's own)",
    )
    g.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=4,
        help="draft tokens per request and step (vLLM's num_speculative_tokens); with "
        "--speculative-eagle-topk > 1, the draft tree's nodes (SGLang's "
        "--speculative-num-draft-tokens less one: SGLang counts the last token too)",
    )
    g.add_argument(
        "--speculative-eagle-topk",
        type=int,
        default=1,
        help="eagle / eagle3 / standalone: tokens kept per draft forward; above 1 the drafts "
        "are a tree (each step expands the best topk leaves by their topk tokens; the "
        "--speculative-num-draft-tokens best nodes are verified with a tree mask); ngram: "
        "the continuations of that many earlier matches merged into one tree",
    )
    g.add_argument(
        "--speculative-token-map",
        type=str,
        default=None,
        help="eagle: the head drafts over these of the model's tokens only (SGLang's flag, "
        "FR-Spec: a local .pt file of token ids, or a .json list), its lm_head those rows",
    )
    g.add_argument(
        "--speculative-num-steps",
        type=int,
        default=None,
        help="draft forwards per step: the tree's depth (default: the number of draft tokens "
        "with topk 1, a chain; num_draft_tokens // topk with a tree). With topk 1, steps = "
        "num_draft_tokens - 1 is SGLang's count and means a chain of `steps` drafts",
    )
    g.add_argument(
        "--speculative-ngram-min-match-window-size",
        type=int,
        default=2,
        help="shortest suffix of the request's tokens matched earlier (prompt_lookup_min)",
    )
    g.add_argument(
        "--speculative-ngram-max-match-window-size",
        type=int,
        default=4,
        help="longest suffix matched; the longest match wins (prompt_lookup_max)",
    )
    g.add_argument(
        "--speculative-config",
        action=_VllmSpeculativeConfig,
        default=None,
        metavar="JSON",
        help='vLLM\'s form, e.g. \'{"method": "ngram", "num_speculative_tokens": 5, '
        '"prompt_lookup_max": 4}\'',
    )


def ensure_model(path: str | None) -> str:
    """The given model folder, or a tiny generated Llama (built once, then reused)."""
    if path:
        return path
    if not os.path.exists(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
        from services.tiny_model import make_tiny_model

        make_tiny_model(DEFAULT_MODEL_DIR, arch="llama", preset="tiny")
    return DEFAULT_MODEL_DIR


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = {k: v for k, v in vars(ns).items() if k in names}
    kwargs["model_path"] = ensure_model(kwargs.get("model_path"))
    if getattr(ns, "enable_expert_parallel", False):
        kwargs["ep_size"] = kwargs.get("tp_size", 1)
    return EngineArgs.from_kwargs(**kwargs)
