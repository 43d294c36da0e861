"""Tensor parallelism: one engine over `tp_size` devices, rank 0 scheduling for all.

Rank 0 is the engine's model runner: it schedules, holds the KV-slot bookkeeping and samples.
Ranks 1..N-1 are follower processes (started by rank 0's runner: engine/tp_ranks.py), each
holding its part of every weight (engine/layers/parallel.py) and a KV pool of its own heads
with as many slots as rank 0's (the smallest any rank can hold: `TensorParallel.min_int`).
They only run forwards: for each one, rank 0 sends what its layers and attention read
(`TPLink.send`, just before rank 0's own forward, after the overlap scheduler's placeholders
are resolved), and every rank runs the same forward, meeting in the collectives of the
row-parallel layers and the logits' gather. The followers' logits are dropped. vLLM's
multiprocessing executor works the same way (the driver sends the scheduler's output); SGLang
runs a scheduler on every rank and broadcasts the requests instead, which needs every rank to
make the same decisions (timing-free), which this engine's schedulers do not promise.

Per forward: a small message over the gloo group (the batch's shape, its host lists, the
hierarchical cache's copies to run first, the requests' LoRA adapters, whether rank 0 replays a
decode graph), then one int64 tensor over the device group (NCCL on CUDA; on CPU the tensor
travels inside the message, one broadcast for both): the input ids,
positions, KV slots, sequence lengths, cut to the longest sequence the batch's rows of the
request-to-token table and, with hybrid window memory, the window slots of those slots. On
CUDA the tensor stays on the device: no host synchronisation on rank 0. An eager follower
attends through the rows it was sent; where rank 0 replays a graph, the follower writes them
into its own table (which its graphs read) and replays its graph of the same padded size.

Between forwards rank 0 has every rank run the same runner method (`TPLink.on_every_rank`):
weight updates, memory release, LoRA adapters, graph capture, reading a weight back, joining a
trainer's group. A rank that dies fails the next forward with its name; after a failure on
some ranks only, the link refuses every forward (the ranks' states may differ).

Devices: rank r takes the device `r` past rank 0's (`cuda:1`, `cuda:2`, ... for `cuda:0`);
on CPU every rank is a process on the same cores, each given its share of the threads. Over
several machines (`nnodes`), node n runs ranks n*k .. n*k+k-1 (k = tp_size / nnodes) on its
devices from `device` on (`run_node`: followers only, no scheduler); the group meets at
`dist_init_addr`, and every rank checks that all run with the same engine arguments.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.distributed import TensorParallel
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.layers.parallel import kv_heads_per_rank

if TYPE_CHECKING:
    from engine.config import ModelConfig

logger = logging.getLogger(__name__)

# rank 0's messages travel in one broadcast of this many bytes when they fit (on CPU with the
# batch's int64 tensor inside: a decode step of 16 requests over 400 tokens; a larger one takes
# a second broadcast of the rest). torch's broadcast_object_list takes two every time (the
# size, then the bytes): a forward was sent in ~1.0 ms on this 2-core CPU, now ~0.3-0.5 ms.
MESSAGE_BYTES = 1 << 16


def rank_model_config(mc: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """`mc` as one rank sees it: its attention heads and K/V heads (its KV pool's shape)."""
    if tp.size == 1:
        return mc
    _, kv_heads = kv_heads_per_rank(mc.num_kv_heads, tp)
    return dataclasses.replace(mc, num_heads=mc.num_heads // tp.size, num_kv_heads=kv_heads)


@dataclass
class _Call:
    """A runner method every rank runs, between forwards (a weights update, a release)."""

    method: str
    args: tuple
    every_result: bool = False  # (the followers send their results too)


@dataclass
class _Shape:
    """What a follower needs to rebuild rank 0's ForwardBatch, besides the tensor."""

    mode: int
    batch_size: int
    num_tokens: int
    width: int  # the longest sequence: the request rows' length
    seq_lens: list[int]
    extend_prefix_lens: list[int] | None
    extend_seq_lens: list[int] | None
    prompt_rows: int  # prompt-logprob rows (-1: none)
    return_all_logits: bool
    pooling: str | None
    # the hierarchical cache's copies between the KV pool and host memory before the forward
    # (every rank's pools hold its heads at the same slots): (kind, source, destination slots)
    transfers: list[tuple[str, torch.Tensor, torch.Tensor]] | None = None
    graph: bool = False  # rank 0 replays a graph (decode, verify): so do the followers
    lora_ids: list[int] | None = None  # each request's LoRA adapter (0: none)
    spec_draft_lens: list[int] | None = None  # a speculative verify step's drafts a request
    spec_parents: list[list[int]] | None = None  # its draft trees (engine/speculative/tree.py)
    # K/V copies rank 0 made since the last forward, first (every rank's pool holds its heads
    # at the same slots): a tree verify step's accepted nodes moved to their path's positions
    kv_moves: tuple[list[int], list[int]] | None = None  # (source slots, destination slots)
    payload: Any = None  # on CPU the batch's int64 tensor itself (numpy), in the same message


def dead_ranks(procs: list[Any]) -> str:
    """The rank processes of `procs` that have exited, with their exit codes ("" if none)."""
    return ", ".join(f"{p.name} exited with code {p.exitcode}" for p in procs
                     if p.exitcode is not None)  # fmt: skip


def reaped_ranks(procs: list[Any]) -> str:
    """`dead_ranks`, waiting up to a second for a rank whose death broke a collective to be
    reaped (its peer may see the closed connection first); "" if none has exited by then."""
    for _ in range(10):
        dead = dead_ranks(procs)
        if dead:
            return dead
        time.sleep(0.1)
    return ""


class TPLink:
    """Rank 0's sending side and the followers' receiving side of the per-forward message."""

    def __init__(self, tp: TensorParallel, device: torch.device, procs: list[Any]) -> None:
        self.tp = tp
        self.device = device
        self.procs = procs  # (rank 0) the followers' processes, to say which one is gone
        # hybrid sliding-window memory: the allocator whose full-to-window slot map rank 0
        # sends for the batch's slots (its own on a follower, where the sent values go)
        self.swa_allocator: Any = None
        self.broken: str | None = None  # why the ranks are out of step (no more forwards)
        # (rank 0) K/V slot copies made since the last forward, sent with the next one: no
        # rank reads its pool between forwards (`queue_kv_moves`)
        self._kv_moves: tuple[list[int], list[int]] = ([], [])

    def send(self, fb: ForwardBatch, transfers: list | None = None, graph: bool = False) -> None:
        """(Rank 0) the forward `fb` to every follower, with the hierarchical cache's copies
        that rank 0 ran before it (`transfers`); `graph`: rank 0 replays a CUDA graph for it
        (the followers replay theirs of the same size: their collectives meet)."""
        if self.broken:
            raise RuntimeError(f"tensor-parallel ranks out of step ({self.broken}): restart "
                               "the worker")  # fmt: skip
        extend = fb.forward_mode.is_extend()
        rows = fb.prompt_logprob_rows
        shape = _Shape(
            int(fb.forward_mode), fb.batch_size, fb.num_tokens, max(fb.seq_lens_cpu),
            list(fb.seq_lens_cpu),
            list(fb.extend_prefix_lens_cpu) if extend else None,
            list(fb.extend_seq_lens_cpu) if extend else None,
            -1 if rows is None else int(rows.shape[0]), fb.return_all_logits, fb.pooling,
            [(kind, src.cpu(), dst.cpu()) for kind, src, dst in transfers] if transfers
            else None, graph, fb.lora_ids, fb.spec_draft_lens, fb.spec_parents,
            self._kv_moves if self._kv_moves[0] else None,
        )  # fmt: skip
        self._kv_moves = ([], [])
        parts = [fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens]
        if rows is not None:
            parts.append(rows)
        table = fb.req_to_token[fb.req_pool_indices, : shape.width]
        parts.append(table.reshape(-1))
        if self.swa_allocator is not None:  # (the window slots of the same slots)
            full_to_swa = self.swa_allocator.full_to_swa
            parts += [full_to_swa[table.reshape(-1).long()], full_to_swa[fb.out_cache_loc]]
        payload = torch.cat([p.to(torch.int64) for p in parts])
        on_cpu = payload.device.type == "cpu"
        if on_cpu:  # (one message: the tensor travels inside it)
            shape.payload = payload.numpy()
        try:
            self._send(shape)
            if not on_cpu:
                torch.distributed.broadcast(payload, src=0, group=self.tp.device_group)
        except Exception as exc:
            dead = reaped_ranks(self.procs)
            self.broken = dead or f"sending a forward failed: {exc}"
            raise RuntimeError(f"tensor parallelism: {self.broken}") from exc

    def queue_kv_moves(self, src: list[int], dst: list[int]) -> None:
        """(Rank 0) it copied its K/V of slots `src` to `dst` (every source read before any
        destination is written): the followers do the same before the next forward, which is
        the first thing after it to read their pools; calls between forwards (weights,
        memory) do not read K/V, and after a release of the KV pool no request holds the
        slots, so copies that land in it then are harmless."""
        self._kv_moves[0].extend(src)
        self._kv_moves[1].extend(dst)

    def forward_failed(self, exc: BaseException) -> None:
        """Rank 0's part of a forward raised `exc`: where a rank process has exited (killed:
        its collective's peer is gone), raise an error that names it, as `send` does. A
        rank that just died is reaped within a second."""
        dead = reaped_ranks(self.procs)
        if dead:
            self.broken = dead
            raise RuntimeError(f"tensor parallelism: {dead}") from exc
        # (no rank has exited: the forward's own error stands)

    def on_every_rank(
        self, runner: Any, method: str, *args: Any, every_result: bool = False,
        local: Callable[[], Any] | None = None,
    ) -> Any:  # fmt: skip
        """(Rank 0) `runner.method(*args)` on every rank, the followers' at the same time as
        rank 0's (`local()` instead on rank 0, when given); rank 0's result (with
        `every_result`, every rank's, in rank order). Raises rank 0's exception, or a
        follower's where only it failed (the ranks then hold different weights: no more
        forwards)."""
        if self.broken:
            raise RuntimeError(f"tensor-parallel ranks out of step ({self.broken}): restart "
                               "the worker")  # fmt: skip
        self._send(_Call(method, args, every_result))
        error: BaseException | None = None
        try:
            result = local() if local is not None else getattr(runner, method)(*args)
        except Exception as exc:  # noqa: BLE001 - raised below, once the ranks reported
            error, result = exc, None
        outcomes: list[Any] = [None] * self.tp.size
        torch.distributed.all_gather_object(
            outcomes, (None if error is None else repr(error), None), group=self.tp.cpu_group
        )
        failed = [(rank, why) for rank, (why, _) in enumerate(outcomes) if why is not None]
        if failed and len(failed) < self.tp.size:
            self.broken = f"{method} failed on rank {failed[0][0]} only: {failed[0][1]}"
            if error is None:
                raise RuntimeError(f"tensor parallelism: {self.broken}")
        if error is not None:
            raise error
        if every_result:
            return [result] + [value for _, value in outcomes[1:]]
        return result

    def stop(self) -> None:
        """(Rank 0) tell the followers to exit."""
        if self.broken:
            return
        self.broken = "stopped"
        try:
            self._send(None)
        except Exception:  # noqa: BLE001 - the followers are gone already
            logger.debug("tensor parallelism: followers gone before the stop", exc_info=True)

    def receive(self, runner: Any) -> tuple[ForwardBatch, bool] | None:
        """(A follower) the next forward, over `runner`'s KV pool and attention backend, and
        whether rank 0 replays a graph for it; None when rank 0 stops. Calls that every rank
        runs (`on_every_rank`) run here first."""
        while isinstance(message := self._receive(), _Call):
            self._run_call(runner, message)
        shape: _Shape | None = message
        if shape is None:
            return None
        if shape.kv_moves:  # (before the host copies: rank 0 made them first)
            src, dst = (torch.tensor(s, dtype=torch.int64, device=self.device)
                        for s in shape.kv_moves)  # fmt: skip
            swa = self.swa_allocator  # (its map still has the slots of the last forward)
            runner.kv_pool.copy_slots(src, dst, None if swa is None else swa.full_to_swa)
        if shape.transfers:
            runner.host_kv_pool.apply(shape.transfers)
        bs, n, width = shape.batch_size, shape.num_tokens, shape.width
        prompt_rows = max(shape.prompt_rows, 0)
        sizes = [n, n, n, bs, bs, prompt_rows, bs * width]
        if self.swa_allocator is not None:
            sizes += [bs * width, n]
        if shape.payload is not None:
            payload = torch.from_numpy(shape.payload)
        else:
            payload = torch.empty(sum(sizes), dtype=torch.int64, device=self.device)
            torch.distributed.broadcast(payload, src=0, group=self.tp.device_group)
        input_ids, positions, out_cache_loc, pool_rows, seq_lens, prompt, table, *swa = (
            payload.split(sizes)
        )
        if swa:  # (the follower's map, for the slots this batch reads and writes)
            full_to_swa = self.swa_allocator.full_to_swa
            full_to_swa[table] = swa[0].to(full_to_swa.dtype)
            full_to_swa[out_cache_loc] = swa[1].to(full_to_swa.dtype)
        mode = ForwardMode(shape.mode)
        start_loc = lens = None
        if mode.is_extend():
            lens = torch.tensor(shape.extend_seq_lens, dtype=torch.int64, device=self.device)
            start_loc = torch.cumsum(lens, 0) - lens
        rows = table.view(bs, width).to(torch.int32)
        if shape.graph:  # (a graph reads the pool's own table: the rows go there)
            runner.req_to_token_pool.req_to_token[pool_rows, :width] = rows
            rows = runner.req_to_token_pool.req_to_token
        else:  # (the followers index their copy of the rows by batch position)
            pool_rows = torch.arange(bs, device=self.device)
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=bs,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=pool_rows,
            seq_lens=seq_lens,
            seq_lens_cpu=shape.seq_lens,
            req_to_token=rows,
            kv_pool=runner.kv_pool,
            attn_backend=runner.attn_backend,
            extend_prefix_lens_cpu=shape.extend_prefix_lens,
            extend_seq_lens_cpu=shape.extend_seq_lens,
            extend_start_loc=start_loc,
            extend_seq_lens=lens,
            return_all_logits=shape.return_all_logits,
            prompt_logprob_rows=prompt if shape.prompt_rows >= 0 else None,
            pooling=shape.pooling,
            lora_ids=shape.lora_ids,
            spec_draft_lens=shape.spec_draft_lens,
            spec_parents=shape.spec_parents,
        )
        return fb, shape.graph

    def _run_call(self, runner: Any, call: _Call) -> None:
        why = result = None
        try:
            result = getattr(runner, call.method)(*call.args)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it
            logger.exception("tensor parallelism: %s on this rank", call.method)
            why = repr(exc)
        outcomes: list[Any] = [None] * self.tp.size
        torch.distributed.all_gather_object(
            outcomes, (why, result if call.every_result else None), group=self.tp.cpu_group
        )

    # -- messages from rank 0: one broadcast of a fixed size when they fit, as most do --------
    def _send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        head = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        first = min(len(data), MESSAGE_BYTES - 8)
        head[8 : 8 + first] = torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8)
        torch.distributed.broadcast(head, src=0, group=self.tp.cpu_group)
        if len(data) > first:
            rest = torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8)
            torch.distributed.broadcast(rest, src=0, group=self.tp.cpu_group)

    def _receive(self) -> Any:
        head = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
        torch.distributed.broadcast(head, src=0, group=self.tp.cpu_group)
        size = int(head[:8].view(torch.int64)[0])
        first = min(size, MESSAGE_BYTES - 8)
        data = head[8 : 8 + first].numpy().tobytes()
        if size > first:
            rest = torch.empty(size - first, dtype=torch.uint8)
            torch.distributed.broadcast(rest, src=0, group=self.tp.cpu_group)
            data += rest.numpy().tobytes()
        return pickle.loads(data)
