"""Real service processes for system tests: start `sluice <service>`, wait, stop, kill.

    svc = start_service("tokenizer", redis_url=url, prefix=p, log_dir=tmp)   # one process
    svc.wait_heartbeat(client)            # or wait_until(lambda: ..., procs=[svc])
    svc.stop()                            # SIGTERM, returns the exit code
    svc.kill()                            # SIGKILL

    with start_stack(url, model, log_dir=tmp, num_tokenizers=2, num_detokenizers=3) as st:
        st.wait_ready()
        st.bus.publish(...)               # drive the streams directly
        st.router_url                     # when services/router.py exists and router=True

Every child gets `SLUICE_REDIS_URL`, `SLUICE_PREFIX`, `SLUICE_MODEL` and its service's
flags, writes its log to `log_dir/<name>.log` (shown by `Service.log()`, and appended to
assertion messages by `Stack.logs()`), and dies with the test process (PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import redis

from services.serve import port_open, service_command, spawn, stop_processes
from shared.bus import Bus
from shared.heartbeat import list_live
from shared.keys import DETOKENIZER_KIND, ROUTER_KIND, TOKENIZER_KIND, WORKER_KIND
from shared.redis_server import free_port

READY_TIMEOUT_S = 240.0
# Small engine for CPU tests: a bounded KV pool instead of the CPU default.
WORKER_TEST_ARGS = ("--max-total-tokens", "16384", "--max-running-requests", "64")


@dataclass
class Service:
    """One `sluice <service>` child process."""

    name: str
    kind: str
    service_id: str | None  # the heartbeat id, when known in advance
    proc: subprocess.Popen
    log_path: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self, tail: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-tail:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code (SIGKILL after `timeout_s`)."""
        stop_processes([self.proc], timeout_s)
        return self.proc.returncode

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill_while_holding(
        self,
        pending: Callable[[], int],
        producer: Service | None = None,
        timeout_s: float = 30.0,
    ) -> int:
        """Freeze this consumer until it holds read-but-unacked entries, then SIGKILL it.

        Returns how many it held (0: it never did within `timeout_s`). A frozen consumer that
        sits in a blocking XREADGROUP still gets entries (Redis serves the blocked read), so
        each freeze waits up to 100 ms for that; a freeze that caught it between an ack and
        its next read holds nothing and is let go, for 5 to 20 ms in turn (on a loaded machine
        5 ms may not be enough for it to get back to its blocking read).

        With `producer` (the service writing this consumer's stream), the producer is paused
        whenever this consumer is let go: it runs only while this one is frozen, so the stream
        cannot run dry before a freeze catches an entry (a tiny model on a fast machine
        finishes the whole generation in well under a second), and this consumer, finding
        nothing new, goes back to the blocking read where the next freeze finds it.
        """
        held = 0
        deadline = time.monotonic() + timeout_s
        attempt = 0
        try:
            while not held and time.monotonic() < deadline:
                self.pause()
                if producer is not None:
                    producer.resume()
                frozen_until = time.monotonic() + 0.1
                while not (held := pending()) and time.monotonic() < frozen_until:
                    time.sleep(0.002)
                if not held:
                    if producer is not None:
                        producer.pause()
                    self.resume()
                    attempt += 1
                    time.sleep(0.005 * (1 + attempt % 4))
            self.kill()
        finally:
            if producer is not None:
                producer.resume()
        return held


def service_env(redis_url: str, prefix: str, model: str | None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(SLUICE_REDIS_URL=redis_url, SLUICE_PREFIX=prefix, SLUICE_LOG_LEVEL="info")
    if model is not None:
        env["SLUICE_MODEL"] = model
    env.update(extra)
    return env


def start_process(
    name: str, command: Sequence[str], env: Mapping[str, str], log_dir: str
) -> subprocess.Popen:
    log_path = os.path.join(log_dir, f"{name}.log")
    with open(log_path, "ab") as log:
        return spawn(command, env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def start_service(
    service: str,
    *args: str,
    redis_url: str,
    prefix: str,
    log_dir: str,
    model: str | None = None,
    name: str | None = None,
    service_id: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Service:
    """Start `sluice <service> *args`; `service_id` names its consumer / worker id."""
    name = name or f"{service}-{uuid.uuid4().hex[:6]}"
    extra = dict(env or {})
    id_flag = {"worker": "--worker-id", "router": "--router-id"}.get(service, "--consumer")
    if service_id is not None:
        args = (*args, id_flag, service_id)
    full_env = service_env(redis_url, prefix, model, **extra)
    proc = start_process(name, service_command(service, *args), full_env, log_dir)
    return Service(name, service, service_id, proc, os.path.join(log_dir, f"{name}.log"))


def wait_until(
    predicate: Callable[[], bool],
    timeout_s: float = READY_TIMEOUT_S,
    procs: Iterable[Service] = (),
    what: str = "condition",
    every_s: float = 0.1,
) -> None:
    """Poll `predicate`; fail early (with its log) if one of `procs` exits."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for svc in procs:
            if not svc.alive():
                raise AssertionError(
                    f"{svc.name} exited with {svc.proc.returncode} while waiting for {what}:\n"
                    f"{svc.log()}"
                )
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {s.name}\n{s.log(1500)}" for s in procs)
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{logs}")
        time.sleep(every_s)


def router_available() -> bool:
    return importlib.util.find_spec("services.router") is not None


@dataclass
class Stack:
    """redis (given) + tokenizers + one worker + detokenizers (+ router) as processes."""

    redis_url: str
    prefix: str
    model: str
    worker_id: str
    tokenizers: list[Service] = field(default_factory=list)
    worker: Service | None = None
    detokenizers: list[Service] = field(default_factory=list)
    router: Service | None = None
    router_port: int | None = None

    def __post_init__(self) -> None:
        self.client = redis.Redis.from_url(self.redis_url)
        self.bus = Bus(self.client, self.prefix)

    @property
    def services(self) -> list[Service]:
        out = [*self.tokenizers, *self.detokenizers, *([self.worker] if self.worker else [])]
        return out + ([self.router] if self.router else [])

    @property
    def router_url(self) -> str:
        assert self.router_port is not None, "the stack has no router"
        return f"http://127.0.0.1:{self.router_port}"

    def live(self, kind: str) -> set[str]:
        return set(list_live(self.client, self.prefix, kind))

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        want = {
            WORKER_KIND: 1 if self.worker else 0,
            TOKENIZER_KIND: sum(s.alive() for s in self.tokenizers),
            DETOKENIZER_KIND: sum(s.alive() for s in self.detokenizers),
        }
        if self.router is not None:
            want[ROUTER_KIND] = 1

        def ready() -> bool:
            if any(len(self.live(kind)) < n for kind, n in want.items()):
                return False
            return self.router_port is None or port_open("127.0.0.1", self.router_port)

        wait_until(ready, timeout_s, [s for s in self.services if s.alive()], "the stack")

    def logs(self, tail: int = 1500) -> str:
        return "\n".join(f"--- {s.name} (pid {s.pid})\n{s.log(tail)}" for s in self.services)

    def stop(self) -> dict[str, int]:
        """SIGTERM everything still running; the exit codes by service name."""
        procs = [s for s in self.services if s.alive()]
        stop_processes([s.proc for s in procs], 60.0)
        self.client.close()
        return {s.name: s.proc.returncode for s in procs}

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_stack(
    redis_url: str,
    model: str,
    log_dir: str,
    *,
    prefix: str | None = None,
    num_tokenizers: int = 1,
    num_detokenizers: int = 1,
    worker_args: Sequence[str] = WORKER_TEST_ARGS,
    router: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> Stack:
    """Start the services (not Redis: pass its URL); `router` None = if the module exists.

    Call `wait_ready()` before using the stack. `env` goes to every child (e.g.
    `{"SLUICE_CLAIM_IDLE_MS": "1000"}`).
    """
    prefix = prefix or f"sys-{uuid.uuid4().hex[:8]}"
    stack = Stack(redis_url, prefix, model, worker_id="w0")
    common = {"redis_url": redis_url, "prefix": prefix, "log_dir": log_dir, "model": model}
    common["env"] = dict(env or {})  # type: ignore[assignment]
    stack.worker = start_service(
        "worker", *worker_args, name="worker", service_id=stack.worker_id, **common
    )
    for i in range(num_tokenizers):
        stack.tokenizers.append(
            start_service("tokenizer", name=f"tokenizer-{i}", service_id=f"tok{i}", **common)
        )
    for i in range(num_detokenizers):
        stack.detokenizers.append(
            start_service("detokenizer", name=f"detokenizer-{i}", service_id=f"detok{i}", **common)
        )
    if router is None:
        router = router_available()
    if router:
        stack.router_port = free_port()
        stack.router = start_service(
            "router", "--port", str(stack.router_port), name="router", service_id="r0", **common
        )
    return stack


def read_lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)


@contextlib.contextmanager
def sluice_serve(log_path: str, *args: str, ready_s: float = 300) -> Iterator[tuple[str, str]]:
    """`sluice serve ARGS` (on a free port, no SLUICE_* settings from the environment) until
    the block ends: yields (router URL, its embedded Redis's URL); stderr goes to
    `log_path`, quoted if it never gets ready."""
    port = free_port()
    command = service_command("serve", "--port", str(port), *args)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    with open(log_path, "wb") as log:
        proc = spawn(command, env, stdout=subprocess.PIPE, stderr=log, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        ready = lines.get(timeout=ready_s)
        with open(log_path) as f:
            assert ready.startswith("sluice ready"), f.read()[-3000:]
        yield f"http://127.0.0.1:{port}", ready.split("(redis ")[1].split(",")[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
