"""compose/: the compose file is valid Compose, and its commands are real.

Without a Docker engine, each sluice service of `compose/docker-compose.yml` is run as a
local process with its own `command` and `environment` — the Redis URL pointed at the
test's Redis, the model at a tiny model, the device at the CPU (plus a small KV budget),
the router's port at a free one — and must start, show its heartbeat, serve a request
end to end, and exit 0 on SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import uuid

import pytest

from services.serve import port_open
from shared.heartbeat import list_live
from shared.keys import DETOKENIZER_KIND, ROUTER_KIND, TOKENIZER_KIND, WORKER_KIND
from shared.redis_server import free_port
from tests.factories import tiny_model
from tests.system.procs import Service, start_process, wait_until
from tests.system.stream_client import StreamClient

yaml = pytest.importorskip("yaml")

pytest_plugins = ["tests.redis_fixtures"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPOSE_FILE = os.path.join(REPO, "compose", "docker-compose.yml")
ENV_EXAMPLE = os.path.join(REPO, "compose", ".env.example")
SPEC = os.path.join(REPO, "..", "shared", "compose-spec.json")
SLUICE_SERVICES = ("router", "tokenizer", "worker", "detokenizer")
HEARTBEAT_KINDS = {
    "router": ROUTER_KIND,
    "tokenizer": TOKENIZER_KIND,
    "worker": WORKER_KIND,
    "detokenizer": DETOKENIZER_KIND,
}


@pytest.fixture(scope="module")
def compose() -> dict:
    with open(COMPOSE_FILE) as f:
        return yaml.safe_load(f)


def env_example() -> dict[str, str]:
    out = {}
    with open(ENV_EXAMPLE) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                out[key] = value
    return out


def interpolate(value: str, variables: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} (what the file uses)."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        if variables.get(name):
            return variables[name]
        if op == ":?":
            raise AssertionError(f"{name} must be set: {arg}")
        return arg if op == ":-" else ""

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", sub, value)


def test_compose_file_follows_the_compose_spec(compose: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    if not os.path.exists(SPEC):
        where = os.path.normpath(SPEC)
        pytest.skip(f"no Compose JSON schema at {where} (../shared beside the repo)")
    with open(SPEC) as f:
        schema = json.load(f)
    assert "draft-07" in schema["$schema"]
    jsonschema.Draft7Validator(schema).validate(compose)


def test_compose_deploys_every_service(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"redis", *SLUICE_SERVICES}
    assert services["router"]["ports"] == ["${SLUICE_PORT:-8000}:8000"]
    (gpu,) = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["capabilities"] == ["gpu"] and gpu["driver"] == "nvidia"
    for name in ("tokenizer", "detokenizer"):
        assert services[name]["deploy"]["replicas"] >= 1
    for name in SLUICE_SERVICES:
        svc = services[name]
        assert "container_name" not in svc  # it would forbid --scale
        assert svc["command"][:2] == ["sluice", name]
        assert svc["volumes"][0].endswith(":/models/model:ro")
        assert svc["environment"]["SLUICE_MODEL"] == "/models/model"
        assert svc["environment"]["SLUICE_REDIS_URL"] == "redis://redis:6379/0"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"


def test_worker_keeps_compiled_kernels_in_a_volume(compose: dict) -> None:
    """flashinfer JIT-compiles its kernels on first use (minutes): the image points its
    workspace and Triton's cache into one directory, which the worker mounts as a named
    volume, so a restarted worker does not compile them again."""
    with open(os.path.join(REPO, "compose", "Dockerfile")) as f:
        dockerfile = f.read()
    base = re.search(r"FLASHINFER_WORKSPACE_BASE=(\S+)", dockerfile).group(1)
    triton = re.search(r"TRITON_CACHE_DIR=(\S+)", dockerfile).group(1)
    assert triton.startswith(base + "/")
    mounts = dict(v.split(":", 1)[::-1] for v in compose["services"]["worker"]["volumes"][1:])
    assert mounts.get(base) in compose["volumes"]


def local_command(command: list[str], port: int) -> list[str]:
    """The container command as a local one: this interpreter, the CPU, a free port."""
    assert command[0] == "sluice"
    args = list(command[1:])
    rewrites = {"--device": "cpu", "--port": str(port), "--mem-fraction-static": None}
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in rewrites and i + 1 < len(args):
            if rewrites[args[i]] is not None:
                out += [args[i], rewrites[args[i]]]
            i += 2
            continue
        out.append(args[i])
        i += 1
    if args[0] == "worker":
        out += ["--max-total-tokens", "16384"]  # the CPU default would be a huge pool
    return [sys.executable, "-m", "services.cli", *out]


def test_compose_commands_start_serve_and_stop(
    compose: dict, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import redis

    model = tiny_model("llama")
    logs = str(tmp_path_factory.mktemp("compose-logs"))
    prefix = f"compose-{uuid.uuid4().hex[:6]}"
    variables = {**env_example(), "SLUICE_PREFIX": prefix, "SLUICE_LOG_LEVEL": "info"}
    port = free_port()
    procs: dict[str, Service] = {}
    for name in SLUICE_SERVICES:
        svc = compose["services"][name]
        env = dict(os.environ)
        env.update({k: interpolate(str(v), variables) for k, v in svc["environment"].items()})
        assert env["SLUICE_PREFIX"] == prefix
        env.update(SLUICE_REDIS_URL=redis_url, SLUICE_MODEL=model)
        command = local_command(svc["command"], port)
        proc = start_process(name, command, env, logs)
        procs[name] = Service(name, name, None, proc, os.path.join(logs, f"{name}.log"))
    client = redis.Redis.from_url(redis_url)
    try:

        def all_live() -> bool:
            kinds = HEARTBEAT_KINDS.values()
            return all(list_live(client, prefix, kind) for kind in kinds) and port_open(
                "127.0.0.1", port
            )

        wait_until(all_live, procs=procs.values(), what="every compose service")
        command = compose["services"]["worker"]["command"]
        worker_id = command[command.index("--worker-id") + 1]
        assert set(list_live(client, prefix, WORKER_KIND)) == {worker_id}
        # Served end to end through the streams (the router has its own HTTP tests).
        from shared.bus import Bus

        stream_client = StreamClient(Bus(client, prefix), worker_id)
        rid = stream_client.request(text="hello", sampling_params={"max_new_tokens": 4})
        result = stream_client.wait([rid], timeout_s=60)[rid]
        assert result.error is None and result.final.completion_tokens >= 1
        stream_client.vanish()  # (its router heartbeat is the test's)
        codes = {name: svc.stop() for name, svc in procs.items()}
        # uvicorn re-raises the SIGTERM it handled once it has shut down gracefully.
        clean = {name: (0, -signal.SIGTERM) if name == "router" else (0,) for name in codes}
        assert all(codes[name] in clean[name] for name in codes), codes
        assert not client.keys(f"{prefix}:hb:*")
    finally:
        for svc in procs.values():
            svc.kill()
        client.close()
