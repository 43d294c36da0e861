"""`sluice serve`: every service on one machine, as child processes.

    sluice serve [--model PATH] [--redis-url URL] [--dp-size D] [--tokenizers N]
                 [--detokenizers M] [--host H] [--port P] [--incremental-streaming-output]
                 [--tool-call-parser hermes|llama3|mistral] [--reasoning-parser P]
                 [--policy cache_aware|shortest_queue|...] [engine flags: --device, ...]

Starts an embedded redis-server when no Redis URL is given, generates a small model when
none is given, then D workers (`sluice worker`, with the engine flags; ids 0..D-1, on CUDA
one GPU each), N tokenizers, M detokenizers and the router (`sluice router`, with those of
its flags named in `ROUTER_FLAGS`). Children get their configuration through `SLUICE_*`
variables and die with the launcher (PR_SET_PDEATHSIG), so even a `kill -9` of the launcher
leaves no orphans. Ready when the workers', tokenizers' and detokenizers' heartbeats are
up and the router accepts connections; Ctrl-C or SIGTERM stops the children (SIGTERM, then
SIGKILL after a grace period) and Redis. A child that exits on its own stops the whole
deployment with an error.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

import redis

from shared.heartbeat import list_live
from shared.keys import DETOKENIZER_KIND, TOKENIZER_KIND, WORKER_KIND
from shared.logging import setup_logging
from shared.redis_clients import connect
from shared.redis_server import EmbeddedRedis
from shared.settings import RouterSettings, ServeSettings, add_settings_args, settings_from_args

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
STOP_GRACE_S = 10.0
# RouterSettings fields that `serve` takes as flags too and passes on to its router.
ROUTER_FLAGS = ("incremental_streaming_output", "tool_call_parser", "reasoning_parser",
                "responses_store_ttl_s", "policy", "cache_threshold", "balance_abs_threshold",
                "balance_rel_threshold", "max_tree_size", "files_ttl_s", "files_max_bytes",
                "batch_concurrency", "batch_max_requests", "batch_priority")  # fmt: skip


def _die_with_parent() -> None:
    """In a child before exec: receive SIGTERM when the launching thread dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def service_command(service: str, *args: str) -> list[str]:
    """The command line of `sluice <service> ...` with this interpreter."""
    return [sys.executable, "-m", "services.cli", service, *args]


def spawn(
    command: Sequence[str], env: Mapping[str, str] | None = None, **popen: object
) -> subprocess.Popen:
    """Start a child that gets SIGTERM when this process dies."""
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    return subprocess.Popen(  # type: ignore[call-overload]
        list(command), env=dict(env) if env is not None else None, preexec_fn=preexec, **popen
    )


def stop_processes(procs: Sequence[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every running child, wait up to `grace_s` in all, SIGKILL the rest."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("pid %d ignored SIGTERM; killing it", proc.pid)
            proc.kill()
            proc.wait()


def count_live(client: redis.Redis, prefix: str) -> dict[str, int]:
    kinds = (WORKER_KIND, TOKENIZER_KIND, DETOKENIZER_KIND)
    return {kind: len(list_live(client, prefix, kind)) for kind in kinds}


def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def engine_flags(ns: argparse.Namespace) -> list[str]:
    """The engine flags given to `serve` (those not at their default), for the worker."""
    from services.engine_args import add_engine_args

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    flags: list[str] = []
    for action in parser._actions:
        value = getattr(ns, action.dest, action.default)
        if action.dest == "model_path" or value == action.default:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:
            flags.append(flag)
        elif isinstance(value, list | tuple):  # nargs="+": --cuda-graph-bs, --lora-paths
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def _router_actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser(add_help=False)
    add_settings_args(parser, RouterSettings)
    return [a for a in parser._actions if a.dest in ROUTER_FLAGS]


def add_router_args(parser: argparse.ArgumentParser) -> None:
    for action in _router_actions():
        parser._add_action(action)


def router_flags(ns: argparse.Namespace) -> list[str]:
    """The `ROUTER_FLAGS` given to `serve`, as `sluice router` flags."""
    flags: list[str] = []
    for action in _router_actions():
        if not hasattr(ns, action.dest):
            continue  # not given: the router reads its SLUICE_* variable or default
        value = getattr(ns, action.dest)
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(action.option_strings[0 if value else 1])
        else:
            flags += [action.option_strings[0], str(value)]
    return flags


class Launcher:
    def __init__(
        self,
        settings: ServeSettings,
        model: str,
        worker_flags: list[str],
        router_flags: list[str] | None = None,
    ) -> None:
        self.settings = settings
        self.model = model
        self.worker_flags = worker_flags
        self.router_flags = router_flags or []
        self.redis: EmbeddedRedis | None = None
        self.children: dict[str, subprocess.Popen] = {}
        self.stop = threading.Event()

    def run(self) -> int:
        try:
            url = self._start_redis()
            self._start_children(url)
            if not self._wait_ready(url):
                return 1
            return self._supervise()
        finally:
            stop_processes(list(self.children.values()))
            if self.redis is not None:
                self.redis.stop()

    def _start_redis(self) -> str:
        if self.settings.common.redis_url:
            return self.settings.common.redis_url
        self.redis = EmbeddedRedis().start()
        logger.info("embedded redis-server at %s", self.redis.url)
        return self.redis.url

    def _start_children(self, url: str) -> None:
        s = self.settings
        env = dict(os.environ)
        env.update(
            SLUICE_REDIS_URL=url,
            SLUICE_PREFIX=s.common.prefix,
            SLUICE_MODEL=self.model,
            SLUICE_LOG_LEVEL=s.common.log_level,
        )
        start = [(f"worker-{i}", ["--worker-id", str(i), *self.worker_flags])
                 for i in range(s.dp_size)]  # fmt: skip
        start += [(f"tokenizer-{i}", []) for i in range(s.tokenizers)]
        start += [(f"detokenizer-{i}", []) for i in range(s.detokenizers)]
        if importlib.util.find_spec("services.router") is not None:
            start.append(("router", ["--host", s.host, "--port", str(s.port), *self.router_flags]))
        else:
            logger.warning("services.router is missing: serving without the HTTP API")
        gpus = self._worker_gpus()
        for name, args in start:
            service, _, index = name.partition("-")
            child_env = env
            if service == "worker" and gpus:
                child_env = {**env, "CUDA_VISIBLE_DEVICES": gpus[int(index)]}
            self.children[name] = spawn(service_command(service, *args), child_env)

    @property
    def device(self) -> str:
        flags = self.worker_flags
        return flags[flags.index("--device") + 1] if "--device" in flags else "cpu"

    @property
    def tp_size(self) -> int:
        """The workers' `--tp-size` (or its other spellings), 1 without it."""
        flags, size = self.worker_flags, 1
        for i, flag in enumerate(flags):
            name, eq, value = flag.partition("=")
            if name in ("--tp-size", "--tp", "--tensor-parallel-size"):
                size = int(value if eq else flags[i + 1])
        return size

    def _worker_gpus(self) -> list[str]:
        """Each worker's GPUs (comma-separated: `--tp-size` of them), when several workers run
        on CUDA: the visible devices in turn."""
        n, tp = self.settings.dp_size, self.tp_size
        if n < 2 or not self.device.startswith("cuda"):
            return []
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = (
            [g.strip() for g in visible.split(",") if g.strip()] if visible
            else list(map(str, range(n * tp)))
        )  # fmt: skip
        if len(gpus) < n * tp:
            raise SystemExit(f"--dp-size {n} x --tp-size {tp} needs {n * tp} GPUs; "
                             f"CUDA_VISIBLE_DEVICES has {visible}")  # fmt: skip
        return [",".join(gpus[i * tp:(i + 1) * tp]) for i in range(n)]

    def _wait_ready(self, url: str) -> bool:
        s = self.settings
        want = {
            WORKER_KIND: s.dp_size, TOKENIZER_KIND: s.tokenizers, DETOKENIZER_KIND: s.detokenizers
        }  # fmt: skip
        client = connect(url)
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while not self.stop.wait(0.25):
                if self._exited():
                    return False
                live = count_live(client, s.common.prefix)
                http = "router" not in self.children or port_open(s.host, s.port)
                if http and all(live[k] >= n for k, n in want.items()):
                    where = f"http://{s.host}:{s.port}" if "router" in self.children else "-"
                    print(f"sluice ready: {where} (redis {url}, model {self.model})", flush=True)
                    return True
                if time.monotonic() > deadline:
                    logger.error("not ready after %.0f s: %s live", READY_TIMEOUT_S, live)
                    return False
            return False
        finally:
            client.close()

    def _supervise(self) -> int:
        while not self.stop.wait(0.5):
            if self._exited():
                return 1
        logger.info("stopping")
        return 0

    def _exited(self) -> bool:
        for name, proc in self.children.items():
            if proc.poll() is not None:
                logger.error(
                    "%s (pid %d) exited with %s; stopping", name, proc.pid, proc.returncode
                )
                return True
        return False


def run(settings: ServeSettings, ns: argparse.Namespace) -> int:
    from services.engine_args import ensure_model

    if getattr(ns, "node_rank", 0) > 0:
        raise SystemExit("sluice serve runs node 0 (Redis, the router, the services); on node "
                         f"{ns.node_rank} run `sluice worker --node-rank {ns.node_rank}` with the "
                         "same engine flags")  # fmt: skip
    logging.getLogger().handlers.clear()  # this process logs through setup_logging only
    setup_logging("serve", None, settings.common.log_level)
    model = ensure_model(ns.model_path or settings.model)
    launcher = Launcher(settings, model, engine_flags(ns), router_flags(ns))

    def on_signal(signum: int, frame: object) -> None:
        launcher.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return launcher.run()


def _main(ns: argparse.Namespace) -> None:
    from services.group_consumer import exit_process

    exit_process(run(settings_from_args(ServeSettings, ns), ns))


def add_parser(sub: argparse._SubParsersAction) -> None:
    from services.engine_args import add_engine_args

    # The engine's --model/--model-path replaces the settings' --model (SLUICE_MODEL stays).
    p = sub.add_parser("serve", help="every service on this machine", conflict_handler="resolve")
    add_settings_args(p, ServeSettings)
    add_router_args(p)
    add_engine_args(p)
    p.set_defaults(func=_main)
