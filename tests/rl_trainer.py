"""An RL trainer's side of a weights update through a process group, as the trainers that
drive SGLang do it (verl, slime, OpenRLHF, AReaL): rank 0 of a group built with
`init_custom_process_group` (a tcp:// rendezvous whose store rank 0 serves, under a prefix of
the group's name, and torch's process-group construction over it), then one
`torch.distributed.broadcast(t, src=0, group=...)` per tensor of a bucket. Written here
without the engine's code (engine/weight_groups.py is the other side, under test).

Run as a process: `python -m tests.rl_trainer --port P --world-size W --checkpoint DIR
--buckets N --order 0,1,2 [--router URL --rank-offset R --weight-version V]`. The checkpoint's
tensors, sorted by name, are split into N buckets (i::N); `--order` says which are sent, in
turn: "k" is bucket k of the (first) checkpoint, "c:k" bucket k of the c-th `--checkpoint`
given; an "f" after one sends it flattened (SGLang's load_format "flattened_bucket": one
uint8 tensor, each tensor's bytes in turn). With `--router`, the trainer also makes the HTTP
calls (SGLang's `/init_weights_update_group`, `/update_weights_from_distributed` with each
bucket's names, dtypes and shapes, `/destroy_weights_update_group`), each beside its side of
the collective, and prints each answer as a JSON line (`--rename-first` misnames a tensor of
the first bucket sent); without, the engine's side is the caller's.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import (
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

GROUP = "weight_update_group"


def free_port() -> int:
    """A free loopback TCP port for the rendezvous (this module needs no Redis package)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def trainer_group(port: int, world_size: int, name: str) -> Any:
    """Rank 0 of group `name`, at 127.0.0.1:`port` (serves the rendezvous store)."""
    timeout = datetime.timedelta(seconds=60)
    store, rank, size = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size,
                                        timeout=timeout))  # fmt: skip
    store.set_timeout(timeout)
    store = PrefixStore(name, store)
    group, _ = _new_process_group_helper(size, rank, [], "gloo", store, group_name=name,
                                         timeout=timeout)  # fmt: skip
    _world.pg_group_ranks[group] = {i: i for i in range(size)}
    return group


def buckets(checkpoint: str, n: int) -> list[list[tuple[str, torch.Tensor]]]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(f"{checkpoint}/*.safetensors")):
        tensors.update(load_file(file))
    named = sorted(tensors.items())
    return [named[i::n] for i in range(n)]


def post(router: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(router + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return {"status": resp.status, **json.loads(resp.read())}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, **json.loads(exc.read())}


class Trainer:
    """This module run as a process (the trainer), its answers read once it ended."""

    def __init__(self, *args: str) -> None:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH",
                                                                                 "")])}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.rl_trainer", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env)  # fmt: skip

    def answers(self, timeout: float = 120) -> list[dict]:
        """Its JSON lines, once it exited cleanly (AssertionError with its stderr else)."""
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, err[-3000:]
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--checkpoint", action="append", required=True)
    ap.add_argument("--buckets", type=int, default=1)
    ap.add_argument("--order", default="0")
    ap.add_argument("--router")
    ap.add_argument("--rank-offset", type=int, default=1)
    ap.add_argument("--weight-version")
    ap.add_argument("--rename-first", help="a wrong name for the first tensor of the first "
                    "bucket sent, in the HTTP body only (a bucket the engine refuses)")
    args = ap.parse_args(argv)
    parts = [buckets(path, args.buckets) for path in args.checkpoint]
    pool = ThreadPoolExecutor(1)
    init = None
    if args.router:
        init = pool.submit(post, args.router, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": args.port,
            "rank_offset": args.rank_offset, "world_size": args.world_size,
            "group_name": GROUP, "backend": "gloo",
        })  # fmt: skip
    group = trainer_group(args.port, args.world_size, GROUP)
    if init is not None:
        print(json.dumps({"call": "init", **init.result()}), flush=True)
    for turn, item in enumerate(args.order.split(",")):
        flattened = item.endswith("f")
        checkpoint, _, index = item.removesuffix("f").rpartition(":")
        bucket = parts[int(checkpoint or 0)][int(index)]
        sent = None
        if args.router:
            names = [n for n, _ in bucket]
            if turn == 0 and args.rename_first:
                names[0] = args.rename_first
            body = {"names": names,
                    "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket], "group_name": GROUP}  # fmt: skip
            if args.weight_version:
                body["weight_version"] = args.weight_version
            if flattened:
                body["load_format"] = "flattened_bucket"
            sent = pool.submit(post, args.router, "/update_weights_from_distributed", body)
        if flattened:  # (SGLang's FlattenedTensorBucket: each tensor's bytes in turn)
            flat = torch.cat([t.flatten().view(torch.uint8) for _, t in bucket])
            dist.broadcast(flat, src=0, group=group)
        for _, tensor in [] if flattened else bucket:
            dist.broadcast(tensor, src=0, group=group)
        if sent is not None:
            print(json.dumps({"call": "update", **sent.result()}), flush=True)
    if args.router:
        answer = post(args.router, "/destroy_weights_update_group", {"group_name": GROUP})
        print(json.dumps({"call": "destroy", **answer}), flush=True)
    dist.destroy_process_group(group)
    print(json.dumps({"call": "done"}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
