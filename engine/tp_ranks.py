"""Tensor parallelism's processes: where each rank runs, how the ranks meet, the followers'
loop (engine/tensor_parallel.py has what goes between them each forward).

Rank 0 (the engine's model runner) checks that the model splits, starts ranks 1..k-1 of its
machine from the forkserver (`start_followers`) and meets them and the other machines' ranks
(`join_ranks`); a follower builds its runner and runs rank 0's forwards until told to stop
(`follower_main`). Over several machines node n > 0 runs only followers (`run_node`, from
`sluice worker --node-rank n`). Every rank checks that all run with the same engine
arguments (`check_same_args`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from engine.distributed import TensorParallel, free_port, group_on, rendezvous
from engine.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from engine.config import EngineArgs, ModelConfig

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600.0  # loading a large model on each rank takes a while


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device: the one `rank` past `device`'s index on CUDA; CPU for CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return str(dev)
    return f"cuda:{(dev.index or 0) + rank}"


def rank_threads(size: int) -> int:
    """Each CPU rank's torch threads: the cores split between the ranks."""
    return max(1, (os.cpu_count() or 1) // size)


def group_host(args: EngineArgs) -> str:
    """Where the group meets: `dist_init_addr`'s host, else this machine's loopback."""
    address = args.dist_init_address
    return address[0] if address else "127.0.0.1"


def join(
    rank: int, size: int, port: int, device: str, ep_size: int = 1, host: str = "127.0.0.1"
) -> TensorParallel:
    """This process as `rank` of the engine's group at `host`:`port`."""
    store = rendezvous(host, port, rank, size, JOIN_TIMEOUT_S)
    cuda = torch.device(device).type == "cuda"
    name = f"sluice-tp-{port}"
    device_group = group_on(store, rank, size, name, "nccl" if cuda else "gloo")
    cpu_group = group_on(store, rank, size, f"{name}-cpu", "gloo") if cuda else device_group
    return TensorParallel(rank, size, device_group, cpu_group, ep_size)


def join_ranks(
    args: EngineArgs, model_config: ModelConfig, rank: int, port: int | None,
    device: torch.device,
) -> tuple[TensorParallel, list[Any], int]:  # fmt: skip
    """This model runner's place in the group: rank 0 checks that the model splits (before
    any process starts), starts the followers and meets them; a follower meets rank 0. CPU
    ranks share the cores. (The group, the followers' processes, the torch threads before.)"""
    from engine.config import resolve_dtype
    from engine.loader import build_model
    from engine.quantization import resolve_quantization

    size, local = args.tp_size, args.ranks_per_node
    if rank == 0:
        dtype = resolve_dtype(args.dtype, "float32")
        quantization = resolve_quantization(args.quantization, model_config.hf_config)
        build_model(model_config, dtype, "meta", quantization,
                    TensorParallel(0, size, ep_size=args.ep_size))  # fmt: skip
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(rank_threads(local))
    elif device.type == "cuda":
        torch.cuda.set_device(device)  # (NCCL's communicator is the current device's)
    if rank != 0:
        assert port is not None, "a follower rank needs rank 0's port"
        tp = join(rank, size, port, str(device), args.ep_size, group_host(args))
        check_same_args(tp, args)
        return tp, [], threads
    if device.type == "cpu" and not args.disable_overlap_schedule:
        logger.info("tensor parallelism: the overlap loop's forward thread plays the device "
                    "(not a device process: rank 0 starts the other ranks itself)")  # fmt: skip
    tp, procs = start_followers(args)
    check_same_args(tp, args)
    logger.info("tensor parallelism: %d ranks met (here %s; the others' pids %s%s)", size,
                ", ".join(rank_device(args.device, r) for r in range(local)),
                " ".join(str(p.pid) for p in procs) or "-",
                f"; {args.nnodes - 1} other nodes" if args.nnodes > 1 else "")  # fmt: skip
    return tp, procs, threads


# what may differ between the nodes' engine arguments (each node is given its own)
_NODE_OWN = ("model_path", "tokenizer_path", "node_rank")


def check_same_args(tp: TensorParallel, args: EngineArgs) -> None:
    """ValueError on every rank unless every rank runs with the same engine arguments (a node
    started with other flags would build another model or KV pool and hang or garble the
    collectives)."""
    mine = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
            if f.name not in _NODE_OWN}  # fmt: skip
    every: list[Any] = [None] * tp.size
    torch.distributed.all_gather_object(every, mine, group=tp.cpu_group)
    for rank, theirs in enumerate(every):
        diff = sorted(k for k in mine if mine[k] != theirs.get(k))
        if diff:
            k = diff[0]
            tp.destroy()
            raise ValueError(f"tensor parallelism: rank {rank} runs with other engine arguments "
                             f"than rank {tp.rank}: {k} = {theirs.get(k)!r}, not {mine[k]!r} "
                             f"(and {len(diff) - 1} more); start every node with the same "
                             "flags")  # fmt: skip


def start_followers(args: EngineArgs) -> tuple[TensorParallel, list[Any]]:
    """Start ranks 1..tp_size-1 and join them as rank 0: (the group, the processes). A
    follower that fails before joining fails this too (with its exit code), rather than waiting
    out the join's timeout."""
    from engine.overlap.process_executor import mp_context, start_process

    ctx = mp_context()
    address = args.dist_init_address
    port = address[1] if address else free_port()
    procs = []
    for rank in range(1, args.ranks_per_node):
        proc = ctx.Process(target=follower_main, args=(args, rank, port),
                           name=f"sluice-tp{rank}", daemon=True)  # fmt: skip
        start_process(proc)
        procs.append(proc)
    joined: dict[str, Any] = {}

    def join_rank0() -> None:
        try:
            joined["tp"] = join(0, args.tp_size, port, args.device, args.ep_size,
                                group_host(args))  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - raised below, on the caller's thread
            joined["error"] = exc

    thread = threading.Thread(target=join_rank0, name="sluice-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        dead = [p for p in procs if p.exitcode is not None]
        if dead and thread.is_alive():
            stop_followers(procs)
            raise RuntimeError(
                f"tensor parallelism: rank process {dead[0].name} exited with code "
                f"{dead[0].exitcode} before joining (its log says why)"
            )
    if "error" in joined:
        stop_followers(procs)
        raise RuntimeError(f"tensor parallelism: the ranks did not meet: {joined['error']}")
    return joined["tp"], procs


def run_node(args: EngineArgs) -> int:
    """Node `args.node_rank` > 0 of a group over several machines: its ranks' processes, until
    rank 0 (on node 0) stops them or a signal does; the worst exit code of its ranks."""
    import signal

    from engine.config import ModelConfig
    from engine.overlap.process_executor import mp_context, start_process
    from engine.pooling import resolve_model_kind

    args = resolve_model_kind(args, ModelConfig.from_args(args))  # (as node 0's scheduler)
    address = args.dist_init_address
    assert args.node_rank > 0 and address is not None
    ctx, first = mp_context(), args.node_rank * args.ranks_per_node
    procs = []
    for rank in range(first, first + args.ranks_per_node):
        proc = ctx.Process(target=follower_main, args=(args, rank, address[1]),
                           name=f"sluice-tp{rank}", daemon=True)  # fmt: skip
        start_process(proc)
        procs.append(proc)
    logger.info("node %d of %d: ranks %d..%d (pids %s) meet rank 0 at %s:%d", args.node_rank,
                args.nnodes, first, first + len(procs) - 1,
                " ".join(str(p.pid) for p in procs), *address)  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5) and any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            break  # (a rank failed: the others cannot go on)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    stop_followers(procs)
    return max((abs(p.exitcode or 0) for p in procs), default=0)


def stop_followers(procs: list[Any], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


def follower_main(args: EngineArgs, rank: int, port: int) -> None:
    """A follower rank: its part of the model, then forwards as rank 0 sends them."""
    from engine.config import ModelConfig
    from engine.model_runner import ModelRunner

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{rank} %(name)s: %(message)s")
    torch.set_num_threads(rank_threads(args.ranks_per_node))
    runner = ModelRunner(ModelConfig.from_args(args), args, tp_rank=rank, tp_port=port)
    link = runner.tp_link
    assert link is not None
    try:
        with torch.inference_mode():
            while (received := link.receive(runner)) is not None:
                follower_forward(runner, *received)
    finally:
        link.tp.destroy()


def follower_forward(runner: Any, fb: ForwardBatch, replay: bool) -> None:
    """A follower's part of rank 0's forward: its graph of the same size where rank 0 replays
    one (`replay`), else eagerly (its logits are dropped)."""
    if replay:
        verify = fb.spec_draft_lens is not None
        graphs = runner.verify_graph_runner if verify else runner.graph_runner
        if graphs is None or not graphs.can_run(fb):
            raise RuntimeError("rank 0 replays a graph this rank has not captured")
        if runner.lora is not None:
            runner.lora.prepare(fb, graphs.lora_rows(fb))
        graphs.replay(fb)
        return
    if runner.lora is not None:  # (the same slots as rank 0's: the same calls, in order)
        runner.lora.prepare(fb)
    runner.attn_backend.init_forward_metadata(fb)
    runner.model(fb.input_ids, fb.positions, fb)
