"""Model and engine configuration.

`ModelConfig` is read from a Hugging Face folder's `config.json` (through transformers'
`AutoConfig`, the only part of transformers the engine uses besides the tokenizer).
`EngineArgs` carries SGLang's argument names; derived values are properties.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import torch

from engine.hf_overrides import apply_hf_overrides, parse_hf_overrides
from engine.layer_windows import attn_logit_cap, layer_sliding_windows, position_limit
from engine.mem_cache.host_pool import HICACHE_WRITE_POLICIES
from engine.mem_cache.kv_quant import KV_CACHE_DTYPES
from engine.models.registry import ENCODER_ARCHITECTURES
from engine.pooling import check_embedding_args, classifier_labels
from engine.quantization import sidecar_quantization_config
from engine.speculative import check_speculative_args

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(name: str | torch.dtype, config_dtype: str | None = None) -> torch.dtype:
    """`auto` takes the checkpoint's dtype (float32 on CPU, where half precision is slow)."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return _DTYPES.get(str(config_dtype), torch.float32)
    if name not in _DTYPES:
        raise ValueError(f"dtype: unknown dtype {name!r}; choose one of {sorted(_DTYPES)} or auto")
    return _DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    """The shape facts the engine needs, uniform over architectures."""

    path: str
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_len: int
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    hf_config: object = field(repr=False, compare=False)
    # per layer: the sliding attention window (keys a query sees, itself included), or None
    sliding_windows: tuple[int | None, ...] = ()
    # attention scores soft-capped to c * tanh(s / c) on every layer (Gemma 2), or None
    attn_logit_cap: float | None = None
    # a sequence classifier's label names by index (`*ForSequenceClassification`; its
    # requests come back as the scores of these); () for every other model
    labels: tuple[str, ...] = ()
    # bidirectional attention (BERT, RoBERTa: engine/models/bert.py): served as a pooling
    # model, each prompt in one piece, no prefix cache
    is_encoder: bool = False
    # multi-head latent attention (DeepSeek, engine/models/deepseek.py): one cached K/V head
    # (`head_dim`: the latent) read as both key and value, so the pool keeps one buffer
    kv_shared: bool = False

    @classmethod
    def from_args(cls, args: EngineArgs) -> ModelConfig:
        overrides = json.loads(args.hf_overrides) if args.hf_overrides else None
        return cls.from_pretrained(args.model_path, args.context_length, overrides)

    @classmethod
    def from_pretrained(
        cls, path: str, context_length: int | None = None, hf_overrides: dict | None = None
    ) -> ModelConfig:
        """`hf_overrides`: config fields to replace first (engine/hf_overrides.py)."""
        from transformers import AutoConfig

        outer = AutoConfig.from_pretrained(path)
        if hf_overrides:
            apply_hf_overrides(outer, hf_overrides)
        arch = (getattr(outer, "architectures", None) or [""])[0]
        # a multimodal checkpoint served as its text model: the text config describes it
        hf = outer.get_text_config() if arch in TEXT_OF_MULTIMODAL else outer
        if not getattr(outer, "quantization_config", None) and os.path.isdir(path):
            qc = sidecar_quantization_config(path)  # (AutoGPTQ's quantize_config.json)
            if qc is not None:
                hf.quantization_config = qc
        hidden = getattr(hf, "hidden_size", None) or hf.n_embd
        num_heads = getattr(hf, "num_attention_heads", None) or hf.n_head
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf, "head_dim", None) or hidden // num_heads
        num_layers = getattr(hf, "num_hidden_layers", None) or hf.n_layer
        mla = hf.model_type in MLA_MODEL_TYPES
        if mla:  # the cache holds each token's latent as one head
            num_kv_heads, head_dim = 1, hf.kv_lora_rank + hf.qk_rope_head_dim
        max_pos = getattr(hf, "max_position_embeddings", None) or getattr(hf, "n_positions", 2048)
        max_pos = position_limit(hf.model_type, max_pos, getattr(hf, "pad_token_id", None))
        return cls(
            path=path,
            architecture=arch,
            model_type=hf.model_type,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=hf.vocab_size,
            context_len=context_length or max_pos,
            eos_token_ids=_eos_token_ids(path, outer),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            hf_config=hf,
            sliding_windows=layer_sliding_windows(hf, num_layers),
            attn_logit_cap=attn_logit_cap(hf),
            labels=classifier_labels(arch, hf),
            is_encoder=arch in ENCODER_ARCHITECTURES,
            kv_shared=mla,
        )

    @property
    def sliding_window_sizes(self) -> set[int]:
        """The distinct windows of the model's windowed layers (empty: full attention)."""
        return {w for w in self.sliding_windows if w is not None}


# model types with multi-head latent attention (engine/models/deepseek.py)
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


# Multimodal architectures whose checkpoints are served as their text model (the vision
# tower is not loaded; the router refuses image inputs).
TEXT_OF_MULTIMODAL = ("Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration")


def _eos_token_ids(path: str, hf: object) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (it may list several), else config."""
    ids: object = None
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            ids = json.load(f).get("eos_token_id")
    if ids is None:
        ids = getattr(hf, "eos_token_id", None)
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list) else (int(ids),)


SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight", "random")
ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer")
GEMV_BACKENDS = ("auto", "torch", "triton")
GEMV_MAX_ROWS = 16  # kernels.gemv.MAX_M
DECODE_TENSOR_CORES = ("auto", "on", "off")
TRITON_DECODE_MERGES = ("fused", "kernel")
CPU_OVERLAP_EXECUTORS = ("process", "thread")


@dataclass(frozen=True)
class EngineArgs:
    """Engine arguments, named as SGLang's `ServerArgs`."""

    model_path: str
    dtype: str = "auto"
    device: str = "cpu"
    page_size: int = 1
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    max_running_requests: int = 256
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    context_length: int | None = None
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    # SGLang's priority scheduling: the waiting queue goes by each request's `priority`
    # (larger first, or smaller with low_values_first) before the policy's order, and a
    # waiting request that cannot be admitted preempts running ones whose priority is worse
    # by more than the threshold (they go back to waiting, keeping their output).
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_radix_cache: bool = False
    # SGLang's hierarchical cache (HiCache): prefixes evicted from the device's KV pool stay
    # in a host-memory pool (hicache_ratio x the device pool's tokens, or hicache_size GB)
    # and are loaded back when a request reuses them (engine/mem_cache/hiradix_cache.py).
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    hicache_write_policy: str = "write_through"
    # Hybrid sliding-window memory (SGLang's SWA memory pool): the windowed layers of a model
    # keep K/V only for the tokens their window still reads, in a pool of
    # swa_full_tokens_ratio x the full pool's tokens (engine/mem_cache/swa_allocator.py).
    hybrid_swa_memory: bool = False
    swa_full_tokens_ratio: float = 0.8
    disable_overlap_schedule: bool = False
    # Running requests decode inside each prefill batch (one-token extends) instead of
    # waiting for it: SGLang's mixed chunk.
    enable_mixed_chunk: bool = False
    # What plays the asynchronous device for the overlap loop on CPU (see engine/overlap/).
    cpu_overlap_executor: str = "process"
    attention_backend: str | None = None
    # one backend for EXTEND batches, another for DECODE ones (SGLang's flags of the same
    # names; engine/attention/hybrid_attn.py); None: attention_backend's choice
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    # KV splits of the Triton decode kernel (SGLang's flag); None: by batch size, 8-32 on
    # CUDA (kernels.decode_attention.kv_splits_for), 1-4 in the interpreter. More splits feed
    # the GPU on few requests over long contexts.
    triton_attention_num_kv_splits: int | None = None
    # how the Triton decode kernel merges its splits: "fused" in the last split program of
    # each (request, KV head), "kernel" a second launch (the earlier way; A/B on a GPU)
    triton_decode_merge: str = "fused"
    # "triton": inputs of 1..gemv_max_rows rows (decode at small batch) of the dense linear
    # layers and the lm_head go to the Triton GEMV (kernels/gemv.py) instead of cuBLAS;
    # "auto": triton for 16-bit models on CUDA, torch elsewhere
    # (engine.layers.linear.resolve_gemv_backend). One row: on the H100 the GEMV beat cuBLAS
    # at one row on every Llama-3.2-1B projection (1.01-1.33x) and lost at 2-16 on three of
    # them (0.60-0.78x; benchmarks/results/gpu_gemv.json)
    gemv_backend: str = "auto"
    gemv_max_rows: int = 1
    # the model layers' fused Triton kernels (norms with the residual add, SiLU-and-mul,
    # gelu_new, rotary writing the K/V; GPT-2's GELU in its c_fc GEMM's epilogue) off, their
    # torch code instead: A/B runs on a GPU
    disable_layer_kernels: bool = False
    # programmatic dependent launch of the Triton kernels (compute capability 9.0+; asked
    # for elsewhere, ignored with a warning): each may start while the one before it ends,
    # its programs waiting for it (kernels.jit.use_pdl). None: on where the Triton GEMV runs
    # on such a GPU (a decode layer is then Triton kernels but for attention's; on the H100
    # it made batch-1 decode on the GEMV 1.02-1.04x faster, where beside cuBLAS's GEMMs it
    # gave 0.90x and 1.02x in two runs: gpu_decode_bs1_pdl.json, gpu_decode_bs1_ab2.json)
    enable_pdl: bool | None = None
    # flashinfer's decode kernel: "on" the tensor-core (prefill) kernel, "off" the CUDA-core
    # one, "auto" tensor cores from 4 query heads per KV head on (SGLang's rule)
    flashinfer_decode_tensor_cores: str = "auto"
    random_seed: int = 0
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    skip_tokenizer_init: bool = False
    disable_cuda_graph: bool = False
    # SGLang's: weights released while idle (release_memory_occupation) are copied to host
    # memory first; without it they are discarded and read from the checkpoint again when
    # next needed (engine/memory_occupation.py; vLLM's sleep levels say it per call)
    enable_weights_cpu_backup: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: tuple[int, ...] | None = None
    # Threads compiling structured-output grammars beside the scheduler (0: on its thread,
    # pausing every running request while one compiles; engine/scheduler/grammar_queue.py).
    grammar_compile_threads: int = 2
    # LoRA adapters (SGLang's --lora-paths: NAME=PATH or PATH, PEFT folders), the adapters one
    # batch may use (device slots) and the rank they are padded to (default: their largest, or
    # 16 without any). `enable_lora` serves adapters loaded while running, with none at start.
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    enable_lora: bool = False
    # Speculative decoding (SGLang's flags): "ngram" drafts up to num_draft_tokens tokens a
    # step from the request's own text, matching its last min..max tokens; "standalone" has
    # the model at speculative_draft_model_path (same vocabulary) draft them greedily
    # (engine/speculative/).
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_draft_tokens: int = 4
    # EAGLE / draft model: drafts as a tree (engine/speculative/tree.py) of
    # speculative_num_draft_tokens nodes, from `speculative_num_steps` draft forwards keeping
    # the `speculative_eagle_topk` best tokens of each (1: a chain; steps default to its
    # length)
    speculative_eagle_topk: int = 1
    speculative_num_steps: int | None = None
    # EAGLE: draft over these of the model's tokens only (SGLang's FR-Spec token map: a .pt
    # file of token ids, or .json list)
    speculative_token_map: str | None = None
    speculative_ngram_min_match_window_size: int = 2
    speculative_ngram_max_match_window_size: int = 4
    # An embedding model (SGLang's --is-embedding): requests come back as one vector pooled
    # from the prompt's final hidden states, "last", "mean" or "cls" (engine/pooling.py;
    # None: the checkpoint's sentence-transformers pooling, else cls for an encoder, last
    # for a decoder).
    is_embedding: bool = False
    pooling_type: str | None = None  # None: the model's (engine/pooling.py)
    # vLLM's --hf-overrides (SGLang's --json-model-override-args): config fields replaced
    # before the model is built (engine/hf_overrides.py); a dict or its JSON, kept as JSON
    hf_overrides: str | None = None
    # "fp8": the blocks' linear layers quantized once loaded (an FP8 checkpoint runs in FP8
    # without it); engine/quantization.py
    quantization: str | None = None
    # "fp8" / "fp8_e4m3" / "fp8_e5m2": K/V stored in float8 (engine/mem_cache/kv_quant.py)
    kv_cache_dtype: str = "auto"
    # Tensor parallelism (SGLang's --tp-size, vLLM's --tensor-parallel-size): the model split
    # over this many devices (`device` and the ones after it), rank 0 scheduling for all
    # (engine/tensor_parallel.py)
    tp_size: int = 1
    # Expert parallelism (SGLang's --ep-size): a mixture-of-experts layer's experts split into
    # this many groups of the tp_size ranks (which it divides), each group holding its share
    # of the experts whole or split tp_size / ep_size ways (engine/layers/moe.py)
    ep_size: int = 1
    # Several machines (SGLang's --nnodes / --node-rank / --dist-init-addr): node n runs ranks
    # n * tp_size / nnodes ... of the group, which meets at dist_init_addr (HOST:PORT, where
    # node 0's rank 0 listens); node 0 schedules, the others only run forwards
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy: {self.schedule_policy!r} not in {SCHEDULE_POLICIES}"
            )
        if self.flashinfer_decode_tensor_cores not in DECODE_TENSOR_CORES:
            raise ValueError(
                f"flashinfer_decode_tensor_cores: {self.flashinfer_decode_tensor_cores!r} not in "
                f"{DECODE_TENSOR_CORES}"
            )
        for name in ("attention_backend", "prefill_attention_backend",
                     "decode_attention_backend"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value not in ATTENTION_BACKENDS:
                raise ValueError(f"{name}: {value!r} not in {ATTENTION_BACKENDS}")
        splits = self.triton_attention_num_kv_splits
        if splits is not None and splits < 1:
            raise ValueError(f"triton_attention_num_kv_splits: {splits} is not a positive count")
        if self.triton_decode_merge not in TRITON_DECODE_MERGES:
            raise ValueError(
                f"triton_decode_merge: {self.triton_decode_merge!r} not in {TRITON_DECODE_MERGES}"
            )
        if self.gemv_backend not in GEMV_BACKENDS:
            raise ValueError(f"gemv_backend: {self.gemv_backend!r} not in {GEMV_BACKENDS}")
        if not 1 <= self.gemv_max_rows <= GEMV_MAX_ROWS:
            raise ValueError(f"gemv_max_rows: {self.gemv_max_rows} not in 1..{GEMV_MAX_ROWS}")
        if self.cpu_overlap_executor not in CPU_OVERLAP_EXECUTORS:
            raise ValueError(
                f"cpu_overlap_executor: {self.cpu_overlap_executor!r} not in "
                f"{CPU_OVERLAP_EXECUTORS}"
            )
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(
                f"swa_full_tokens_ratio must be in (0, 1], got {self.swa_full_tokens_ratio}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype!r} not in {KV_CACHE_DTYPES}")
        self._check_hicache_args()
        if self.grammar_compile_threads < 0:
            raise ValueError("grammar_compile_threads must be >= 0")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_loras_per_batch < 1 or (self.max_lora_rank or 1) < 1:
            raise ValueError("max_loras_per_batch and max_lora_rank must be >= 1")
        object.__setattr__(self, "lora_paths", tuple(self.lora_paths))
        overrides = parse_hf_overrides(self.hf_overrides)
        object.__setattr__(self, "hf_overrides", json.dumps(overrides) if overrides else None)
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == 0:
            raise ValueError("chunked_prefill_size must be positive, or -1 to disable chunking")
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError("max_total_tokens is too small for one page")
        self._check_cuda_graph_args()
        self._check_tp_args()
        check_embedding_args(self)
        check_speculative_args(self)

    def _check_hicache_args(self) -> None:
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(
                f"hicache_write_policy: {self.hicache_write_policy!r} not in "
                f"{HICACHE_WRITE_POLICIES}"
            )
        if self.hicache_ratio <= 1 and self.hicache_size <= 0:
            raise ValueError(
                f"hicache_ratio must be > 1 (the host pool is larger than the device's), got "
                f"{self.hicache_ratio}"
            )
        if self.hicache_size < 0:
            raise ValueError(f"hicache_size must be >= 0 GB, got {self.hicache_size}")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache needs the radix cache (not with "
                             "disable_radix_cache)")  # fmt: skip

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def dist_init_address(self) -> tuple[str, int] | None:
        """(host, port) of `dist_init_addr`, None without one."""
        if self.dist_init_addr is None:
            return None
        host, _, port = self.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"dist_init_addr must be HOST:PORT, got {self.dist_init_addr!r}")
        return host.strip("[]"), int(port)

    def _check_tp_args(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"nnodes must be >= 1 and divide tp_size {self.tp_size} (each node "
                             f"runs as many ranks), got {self.nnodes}")  # fmt: skip
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes {self.nnodes}), got "
                             f"{self.node_rank}")  # fmt: skip
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr: HOST:PORT where node 0's rank 0 "
                             "listens, the same on every node")  # fmt: skip
        if self.dist_init_addr is not None:
            _ = self.dist_init_address  # (a ValueError if it is not HOST:PORT)
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"ep_size must be >= 1 and divide tp_size {self.tp_size} (the "
                             f"experts are split over the tensor-parallel ranks), got "
                             f"{self.ep_size}")  # fmt: skip

    def _check_cuda_graph_args(self) -> None:
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_bs is None:
            return
        sizes = tuple(int(bs) for bs in self.cuda_graph_bs)
        if not sizes or min(sizes) < 1:
            raise ValueError(f"cuda_graph_bs must be batch sizes >= 1, got {list(sizes)}")
        if self.cuda_graph_max_bs is not None and max(sizes) > self.cuda_graph_max_bs:
            raise ValueError(
                f"cuda_graph_bs {list(sizes)} has sizes above cuda_graph_max_bs "
                f"{self.cuda_graph_max_bs}"
            )
        # Frozen: normalise a CLI list (or any iterable) to a sorted tuple of unique sizes.
        object.__setattr__(self, "cuda_graph_bs", tuple(sorted(set(sizes))))

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine arguments: {unknown}")
        return cls(**kwargs)  # type: ignore[arg-type]

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend:
            return self.attention_backend
        return "flashinfer" if self.device.startswith("cuda") else "torch_native"

    @property
    def lora_enabled(self) -> bool:
        """Whether LoRA adapters are served (at start, or loaded later)."""
        return self.enable_lora or bool(self.lora_paths)

    @property
    def use_cuda_graph(self) -> bool:
        """Decode graphs are a CUDA feature; on any other device they are simply off."""
        return self.device.startswith("cuda") and not self.disable_cuda_graph

    @property
    def resolved_cuda_graph_bs(self) -> tuple[int, ...]:
        """The decode batch sizes to capture, ascending.

        Default: 1, 2, 4, 8, then every multiple of 8 up to the largest size (which is
        `cuda_graph_max_bs`, else min(max_running_requests, 256)), that size included. A batch
        is padded to the next captured size, so past 8 a step computes at most 7 padded rows;
        decode is bound by reading the weights, so those rows cost little, while the number of
        graphs (capture time, graph memory) stays near max_bs / 8.
        """
        if self.cuda_graph_bs is not None:
            return self.cuda_graph_bs
        max_bs = self.cuda_graph_max_bs or min(self.max_running_requests, 256)
        sizes = {bs for bs in (1, 2, 4, 8) if bs <= max_bs}
        sizes.update(range(16, max_bs + 1, 8))
        sizes.add(max_bs)
        return tuple(sorted(sizes))

    @property
    def overlap_device_process(self) -> bool:
        """The overlap loop on CPU with a device process: the model, KV pool and sampler
        then live in that process, and the scheduler's model runner is host-only."""
        overlap_on_cpu = self.device.split(":")[0] == "cpu" and not self.disable_overlap_schedule
        # (with tensor parallelism rank 0 starts the other ranks itself: the forward thread)
        return overlap_on_cpu and self.cpu_overlap_executor == "process" and self.tp_size == 1

    @property
    def min_new_token_ratio(self) -> float:
        return self.init_new_token_ratio * self.min_new_token_ratio_factor

    @property
    def new_token_ratio_decay(self) -> float:
        return (self.init_new_token_ratio - self.min_new_token_ratio) / max(
            1, self.new_token_ratio_decay_steps
        )
