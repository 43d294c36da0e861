"""Owns the model and the device memory; turns a ModelWorkerBatch into a forward + sample."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineArgs, ModelConfig, resolve_dtype
from engine.cuda_graph_runner import (
    CudaGraphCapturer,
    CudaGraphRunner,
    EagerGraphCapturer,
    GraphCapturer,
)
from engine.distributed import SINGLE
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.host_tensors import int64_rows
from engine.layers.linear import resolve_gemv_backend
from engine.loader import load_model
from engine.mem_cache.kv_memory import plan_kv_memory
from engine.mem_cache.memory_pool import ReqToTokenPool
from engine.memory_occupation import MemoryOccupation
from engine.pooling import EmbeddingBatchResult
from engine.quantization import resolve_quantization
from engine.runner_attention import RunnerAttention
from engine.runner_weights import RunnerWeights
from engine.sampling.sampler import PromptLogprobs, Sampler, sample_batch
from engine.sampling.sampling_batch_info import SamplingInfoCache
from engine.scheduler.schedule_batch import ModelWorkerBatch
from engine.speculative import EAGLE_ALGORITHMS
from engine.speculative.verify import VerifyResult, verify
from engine.speculative.verify_graphs import VerifyGraphRunner, verify_graph_sizes
from engine.tensor_parallel import TPLink, rank_model_config
from engine.tp_ranks import join_ranks, rank_device, stop_followers
from engine.weight_groups import WeightGroups
from kernels.jit import pdl_supported, use_layer_kernels, use_pdl

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.lora import AdapterSpec
    from engine.overlap.future_map import FutureMap

logger = logging.getLogger(__name__)


@dataclass
class GenerationBatchResult:
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B]
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    prompt_logprobs: list[PromptLogprobs | None] | None = None  # per request, see the sampler


class ModelRunner(RunnerWeights, RunnerAttention):
    """The model, its KV pool and attention backend, the sampler, and the scheduler's host
    bookkeeping of device memory (request rows, KV slot allocator).

    `host_only`: only the bookkeeping (`model`, `kv_pool`, `attn_backend`, `sampler` are
    None): the scheduler's runner when a device process owns the rest (CPU overlap, see
    engine/overlap/process_executor.py). The KV budget is computed the same way, so both
    sides agree on the pool's size.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        args: EngineArgs,
        host_only: bool = False,
        tp_rank: int = 0,
        tp_port: int | None = None,
        verify_graph_width: int | None = None,
    ) -> None:
        self.args = args
        # tokens a request of the speculative verify steps captured in CUDA graphs (the
        # drafts + 1; engine/speculative/verify_graphs.py): speculation's, or a draft model's
        # catch-up extends (given); None: no verify graphs
        if verify_graph_width is None and args.speculative_algorithm is not None:
            verify_graph_width = args.speculative_num_draft_tokens + 1
        self.verify_graph_width = verify_graph_width
        self.device = torch.device(rank_device(args.device, tp_rank % args.ranks_per_node))
        # tensor parallelism (engine/tensor_parallel.py): rank 0 starts the other ranks, which
        # come here with their rank and the group's port; the runner's model config is then
        # this rank's view (its attention and K/V heads)
        self.tp, self.tp_followers, self.tp_link = SINGLE, [], None
        if args.tp_size > 1 and not host_only:
            self.tp, self.tp_followers, self._threads = join_ranks(
                args, model_config, tp_rank, tp_port, self.device
            )
            self.tp_link = TPLink(self.tp, self.device, self.tp_followers)
        self.model_config = model_config = rank_model_config(model_config, self.tp)
        # `dtype` first: transformers 5 warns on every read of its old name, `torch_dtype`
        config_dtype = getattr(model_config.hf_config, "dtype", None) or getattr(
            model_config.hf_config, "torch_dtype", None
        )
        self.dtype = resolve_dtype(args.dtype, str(config_dtype).replace("torch.", ""))
        if self.device.type == "cpu" and args.dtype == "auto":
            self.dtype = torch.float32
        torch.manual_seed(args.random_seed)
        use_layer_kernels(not args.disable_layer_kernels)
        self.gemv_backend = resolve_gemv_backend(args.gemv_backend, self.device, self.dtype)
        use_pdl(self._pdl(args.enable_pdl))
        self.quantization = resolve_quantization(args.quantization, model_config.hf_config)
        self.model = (
            None if host_only
            else load_model(model_config, self.dtype, self.device, self.quantization, self.tp)
        )  # fmt: skip
        if self.model is not None:
            self._pad_lm_head()
        if self.model is not None and self.gemv_backend == "triton":
            self._use_triton_gemv()
        self.weights_path = model_config.path  # the checkpoint the weights are from
        self.lora = (
            None if host_only else make_lora_manager(self.model, args, self.dtype, self.device)
        )
        self.page_size = args.page_size
        # an embedding model's pooling: its forwards return pooled states (engine/pooling.py)
        self.pooling = args.pooling_type if args.is_embedding else None
        assert self.pooling or not args.is_embedding, "resolve_model_kind resolves the pooling"
        memory = plan_kv_memory(model_config, args, self.dtype, self.device)
        # (every rank holds as many slots: each rank's free memory gives its own number)
        memory.tokens, memory.swa_tokens, memory.host_tokens = (
            self.tp.min_int(n) for n in (memory.tokens, memory.swa_tokens, memory.host_tokens)
        )
        self.max_total_tokens = memory.tokens
        # hybrid sliding-window memory: the longest window (None without it)
        self.swa_window = memory.swa_window
        mc = model_config
        self.req_to_token_pool = ReqToTokenPool(
            args.max_running_requests + 2, mc.context_len + 8, self.device
        )
        self.padding_req_row = self.req_to_token_pool.reserve_last_row()
        self.allocator = memory.make_allocator(self.page_size, self.device)
        if self.tp_link is not None and self.swa_window is not None:
            self.tp_link.swa_allocator = self.allocator
        # hierarchical cache: the host pool's tokens (its allocator is the tree's, its buffer
        # is made below, beside the KV pool)
        self.host_kv_tokens = memory.host_tokens
        self.host_kv_pool = None
        self.graph_runner: CudaGraphRunner | None = None
        # speculative verify steps' graphs (engine/speculative/verify_graphs.py), captured
        # with the decode graphs
        self.verify_graph_runner: VerifyGraphRunner | None = None
        self._graphs_stale = False  # recapture before the next replay (new KV-cache scales)
        self.memory = MemoryOccupation()  # memory given back while idle, if any
        self.weight_groups = WeightGroups(self.device)  # trainers' groups that send weights
        self.weights_on_disk = True  # the weights are the checkpoint's in `weights_path`
        # after weights not on disk were discarded: the checkpoint tensors not sent since
        self.unsent: set[str] | None = None
        self.sampling_cache = SamplingInfoCache()
        # EAGLE speculation: the model's hidden states kept by KV slot for the draft head
        # (engine/speculative/eagle.py)
        self.hidden_capture = None
        if host_only:
            self.kv_pool = self.attn_backend = self.sampler = None
            self.use_cuda_graph = False
            return
        scales = getattr(self.model, "kv_cache_scales", None)  # the checkpoint's, if any
        self.kv_pool = memory.make_pool(mc, self.dtype, self.device, self.page_size, scales)
        if args.speculative_algorithm in EAGLE_ALGORITHMS and self.tp.rank == 0:
            from engine.speculative.eagle import install_hidden_capture

            self.hidden_capture = install_hidden_capture(self)
        if memory.host_tokens:
            from engine.mem_cache.host_pool import HostKVPool

            # (an EAGLE model's kept hidden states go to the host and back with the K/V)
            capture = () if self.hidden_capture is None else (self.hidden_capture,)
            self.host_kv_pool = HostKVPool(
                self.kv_pool, memory.host_tokens + self.page_size, self.device, capture
            )
        self.attn_backend = self._make_attention_backend(memory.swa_layers)
        self.sampler = Sampler(seed=args.random_seed, device=self.device)
        logger.info(
            "KV pool: %d tokens%s, page size %d, %s",
            self.max_total_tokens,
            f" (windowed layers: {memory.swa_tokens})" if self.swa_window else "",
            self.page_size,
            str(memory.kv_dtype).replace("torch.", ""),
        )
        # the seam for tests: how graphs are recorded (CPU tests replay them eagerly)
        self.graph_capturer_factory: Callable[[torch.device], GraphCapturer] = CudaGraphCapturer
        # (decode graphs: an embedding model never decodes)
        wants_graphs = args.use_cuda_graph and not args.is_embedding
        self.use_cuda_graph = wants_graphs and self.attn_backend.supports_cuda_graph
        if wants_graphs and not self.use_cuda_graph:
            logger.info(
                "CUDA graphs off: the %s backend cannot be captured",
                type(self.attn_backend).__name__,
            )
        if self.use_cuda_graph and args.disable_overlap_schedule and self.tp.rank == 0:
            self.capture_cuda_graphs()  # with overlap: at the first forward, with its FutureMap

    def _pdl(self, asked: bool | None) -> bool:
        """`--enable-pdl` where it can work: compiled Triton kernels on a GPU of compute
        capability 9.0 or later; elsewhere a warning, and ordinary launches. Not asked either
        way (None): on where it can work and the linear layers run on the Triton GEMV."""
        if asked is None:
            return self.gemv_backend == "triton" and pdl_supported(self.device)
        if not asked:
            return False
        if pdl_supported(self.device):
            return True
        logger.warning(
            "--enable-pdl ignored: programmatic dependent launch needs compiled Triton kernels "
            "on a CUDA device of compute capability 9.0 or later (device %s)", self.device
        )
        return False

    def _pad_lm_head(self) -> None:
        """The lm_head weight of a vocabulary that is not a multiple of 8 into a storage of a
        multiple of 64 rows where the matmul pads (engine/layers/logits.py): on CUDA, 16-bit."""
        from engine.layers.logits import pad_vocab_rows, padded_vocab, pads_vocab

        weight = getattr(self.model, "lm_head_weight", None)
        processor = getattr(self.model, "logits_processor", None)
        if weight is None or processor is None or weight.shape[0] != processor.vocab_size:
            return  # no lm_head (a classifier's score rows, an embedding model)
        vocab = weight.shape[0]
        if pads_vocab(weight, vocab) and pad_vocab_rows(weight):
            torch.cuda.empty_cache()  # the unpadded copy's memory goes to the KV pool
            logger.info("lm_head: a vocabulary of %d in %d rows", vocab, padded_vocab(vocab))

    def _use_triton_gemv(self) -> None:
        from engine.layers.linear import use_triton_gemv
        from kernels.jit import triton_runs_on

        if not triton_runs_on(self.device):
            raise RuntimeError(
                "gemv_backend='triton' runs on CUDA, or on CPU under TRITON_INTERPRET=1"
            )
        layers = use_triton_gemv(self.model, self.args.gemv_max_rows)
        logger.info(
            "Triton GEMV: %d linear layers and the lm_head, inputs of up to %d rows",
            layers, self.args.gemv_max_rows,
        )  # fmt: skip

    # -- batches --------------------------------------------------------------------------------
    def build_forward_batch(self, mwb: ModelWorkerBatch) -> ForwardBatch:
        """The batch's index lists as device tensors. Lists of one length travel together, as
        rows of one tensor: one conversion (engine/host_tensors.py) and one host-to-device
        copy (synchronous on CUDA, from pageable memory) instead of one of each per list."""
        dev = self.device
        extend = mwb.forward_mode == ForwardMode.EXTEND
        per_req = [mwb.req_pool_indices, mwb.seq_lens]
        if extend:
            per_req.append(mwb.extend_seq_lens)
            input_ids, positions = int64_rows([mwb.input_ids, mwb.positions]).to(dev)
        else:  # one token per request: everything is per request
            per_req += [mwb.input_ids, mwb.positions]
        rows = mwb.decode_rows  # (copied once already, by the scheduler: no second copy)
        if extend or rows is None:
            rows = int64_rows(per_req).to(dev)
        start_loc = lens = None
        if extend:
            req_pool_indices, seq_lens, lens = rows
            start_loc = torch.cumsum(lens, 0) - lens
        else:
            req_pool_indices, seq_lens, input_ids, positions = rows
        return ForwardBatch(
            forward_mode=mwb.forward_mode,
            batch_size=mwb.batch_size,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=mwb.out_cache_loc.to(dev, torch.int64),
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            seq_lens_cpu=list(mwb.seq_lens),
            req_to_token=self.req_to_token_pool.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            extend_prefix_lens_cpu=mwb.extend_prefix_lens,
            extend_seq_lens_cpu=mwb.extend_seq_lens,
            extend_start_loc=start_loc,
            extend_seq_lens=lens,
            prompt_logprob_rows=None
            if mwb.prompt_logprob_rows is None
            else torch.tensor(mwb.prompt_logprob_rows, dtype=torch.int64).to(dev),
            lora_ids=mwb.lora_ids,
            pooling=self.pooling,
            token_type_ids=None
            if mwb.token_type_ids is None
            else torch.tensor(mwb.token_type_ids, dtype=torch.int64).to(dev),
            kv_transfers=mwb.kv_transfers,
            decode_rows=None if extend else rows,
            spec_draft_lens=mwb.spec_draft_lens,
            spec_parents=mwb.spec_parents,
        )

    @torch.inference_mode()
    def forward(
        self, forward_batch: ForwardBatch, future_map: FutureMap | None = None
    ) -> torch.Tensor:
        """Logits of the batch: replayed from a CUDA graph when one fits, else eager.

        With `future_map`, the batch's input ids may hold placeholders, resolved on the device
        before the model reads them (inside the graph, or first thing in the eager path).
        """
        if self.memory.stale_weights:  # (discarded while released: read them now)
            self.read_stale_weights()
        transfers = forward_batch.kv_transfers
        if transfers:
            assert self.host_kv_pool is not None, "K/V transfers without a host pool"
            self.host_kv_pool.apply(transfers)
            forward_batch.kv_transfers = None
        graphs: CudaGraphRunner | VerifyGraphRunner | None = self._graphs_for(future_map)
        if forward_batch.spec_draft_lens is not None:  # a verify step: its own graphs
            graphs = self.verify_graph_runner
            replay = graphs is not None and graphs.can_run(forward_batch)
        else:
            replay = graphs is not None and graphs.can_run(forward_batch, future_map)
        if self.lora is not None:  # (before the other ranks are sent a forward it may refuse;
            # a replay's mask into its graph's static rows)
            self.lora.prepare(forward_batch, graphs.lora_rows(forward_batch) if replay else None)
        if replay and self.tp_link is None:
            return graphs.replay(forward_batch)
        if future_map is not None:  # (with tensor parallelism before a replay too: the ids
            future_map.resolve_future(forward_batch.input_ids)  # go to the other ranks)
        if self.tp_link is not None:  # the other ranks run the same forward (and copies)
            self.tp_link.send(forward_batch, transfers, replay)
            try:
                if replay:
                    return graphs.replay(forward_batch)
                return self._eager_forward(forward_batch)
            except Exception as exc:  # a collective whose peer is gone: name the dead rank
                self.tp_link.forward_failed(exc)
                raise
        return self._eager_forward(forward_batch)

    def _eager_forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

    # -- LoRA adapters loaded and unloaded while running (engine/scheduler/model_updates.py) --
    def add_lora_adapter(self, spec: AdapterSpec) -> None:
        self._every_rank("_add_lora_adapter", spec)  # (each rank takes its part of it)

    def _add_lora_adapter(self, spec: AdapterSpec) -> None:
        assert self.lora is not None, "LoRA is not enabled on this runner"
        wrapped = len(self.lora.layers)
        self.lora.add(spec)
        if len(self.lora.layers) > wrapped and self.graph_runner is not None:
            self._graphs_stale = True  # (graphs recorded without its new layers: recapture)

    def remove_lora_adapter(self, adapter_id: int) -> None:
        self._every_rank("_remove_lora_adapter", adapter_id)

    def _remove_lora_adapter(self, adapter_id: int) -> None:
        assert self.lora is not None, "LoRA is not enabled on this runner"
        self.lora.remove(adapter_id)

    def release_memory(self) -> None:
        """Drop the weights, the KV pools and the graphs (`Engine.shutdown`): a process that
        makes engines one after another gets the device memory back at once, not when the
        garbage collector finds the runner. Trainers' groups still joined are left (their
        names free for the next engine's)."""
        self.weight_groups.close()
        self.stop_tensor_parallel()
        self.graph_runner = self.verify_graph_runner = None
        self.model = self.kv_pool = self.attn_backend = self.host_kv_pool = None
        if self.device.type == "cuda":
            # (a full collection finds tensors held in reference cycles: 0.2-1 s in a process
            # with a large heap, so only where device memory is what is given back)
            gc.collect()
            torch.cuda.empty_cache()

    def stop_tensor_parallel(self) -> None:
        """(Rank 0) stop the follower ranks and leave the group."""
        if self.tp_link is None or self.tp.rank != 0:
            return
        self.tp_link.stop()
        stop_followers(self.tp_followers)
        self.tp.destroy()
        self.tp_link, self.tp_followers = None, []
        torch.set_num_threads(self._threads)  # (as before the ranks started)

    # -- CUDA graphs ----------------------------------------------------------------------------
    def capture_cuda_graphs(self, future_map: FutureMap | None = None) -> None:
        """(Re)capture the decode graphs of every size in `args.resolved_cuda_graph_bs`,
        resolving placeholders from `future_map` when given (see engine/cuda_graph_runner.py).
        With tensor parallelism every rank captures its graphs at the same time (their
        collectives meet), the way rank 0 does (`eager`: the CPU tests' double)."""
        capturer = self.graph_capturer_factory(self.device)
        if self.tp_link is None or self.tp.rank != 0:
            self._capture_graphs(False, future_map, capturer)
            return
        eager = isinstance(capturer, EagerGraphCapturer)
        self.tp_link.on_every_rank(self, "_capture_graphs", eager,
                                   local=lambda: self._capture_graphs(eager, future_map, capturer))

    def _capture_graphs(
        self, eager: bool, future_map: FutureMap | None = None, capturer: Any = None
    ) -> None:
        if self.graph_runner is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no replay of the old graphs in flight
            self.graph_runner = None  # free the old graphs before recording new ones
        self.verify_graph_runner = None
        if capturer is None:  # (a follower rank: as rank 0 captures)
            capturer = EagerGraphCapturer() if eager else CudaGraphCapturer(self.device)
        sizes = self.args.resolved_cuda_graph_bs
        start = time.perf_counter()
        runner = CudaGraphRunner(self, sizes, future_map, capturer=capturer)
        runner.capture()
        self.graph_runner = runner
        logger.info(
            "CUDA graphs: captured decode batch sizes %s in %.1f s%s",
            list(sizes),
            time.perf_counter() - start,
            " (resolving FutureMap placeholders)" if future_map is not None else "",
        )
        width = self.verify_graph_width
        if width is not None and self.attn_backend.supports_verify_cuda_graph:
            start = time.perf_counter()
            # (with draft trees every verify step has them: the graphs mask trees)
            trees = self.args.speculative_algorithm is not None and (
                self.args.speculative_eagle_topk > 1
            )
            verify = VerifyGraphRunner(self, verify_graph_sizes(sizes), width, capturer, trees)
            verify.capture()
            self.verify_graph_runner = verify
            logger.info(
                "CUDA graphs: captured speculative verify steps of %d tokens a request, batch "
                "sizes %s, in %.1f s", verify.width, verify.batch_sizes,
                time.perf_counter() - start,
            )  # fmt: skip

    def _graphs_for(self, future_map: FutureMap | None) -> CudaGraphRunner | None:
        """The graph runner for a forward with `future_map`, capturing first if there is none
        yet or if it resolves from another map (the overlap scheduler's map is created after
        the model runner: its first forward captures; a map stays for the scheduler's life)."""
        if not self.use_cuda_graph:
            return None
        graphs = self.graph_runner
        if graphs is not None and self._graphs_stale:  # constants baked in changed
            self._graphs_stale = False
            self.capture_cuda_graphs(graphs.future_map if future_map is None else future_map)
        elif graphs is None or (future_map is not None and graphs.future_map is not future_map):
            self.capture_cuda_graphs(future_map)
        return self.graph_runner

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        info = self.sampling_cache.get(
            mwb.sampling_params,
            self.model_config.vocab_size,
            self.device,
            output_ids=mwb.output_ids,
            input_ids=mwb.prompt_ids,  # (seeded rows' step positions: len(output_ids))
            eos_token_ids=self.model_config.eos_token_ids,
        ).with_vocab_mask(mwb.vocab_mask, self.device)
        out = sample_batch(self.sampler, logits, info, mwb)
        return GenerationBatchResult(
            out.next_token_ids, out.logprobs, out.top_logprobs, out.prompt_logprobs
        )

    def forward_batch_generation(
        self, mwb: ModelWorkerBatch
    ) -> GenerationBatchResult | VerifyResult | EmbeddingBatchResult:
        if mwb.spec_draft_lens is not None:
            return verify(self, mwb)
        if self.pooling is not None:
            return EmbeddingBatchResult(self.forward(self.build_forward_batch(mwb)).cpu())
        logits = self.forward(self.build_forward_batch(mwb))
        return self.sample(logits, mwb)


def make_lora_manager(model, args: EngineArgs, dtype: torch.dtype, device: torch.device):
    """The LoRA manager of `args.lora_paths` over `model` (None with LoRA off)."""
    if not args.lora_enabled:
        return None
    from engine.lora import lora_rank, read_adapter_specs
    from engine.lora.manager import LoRAManager

    specs = read_adapter_specs(args.lora_paths)
    return LoRAManager(
        model, specs, args.max_loras_per_batch, lora_rank(args, specs), dtype, device
    )
