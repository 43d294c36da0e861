"""One full stack behind the router for the HTTP end-to-end tests, shared by the session.

Load with `pytest_plugins = ["tests.system.router_stack"]`. Redis, 1 tokenizer, 1 worker,
3 detokenizers and the router, on the tiny llama (its byte-fallback tokenizer makes
CJK and emoji go through byte tokens), with two LoRA adapters (`STACK_LORAS`) that only
requests naming them use. Starting it costs most of a minute on 2 cores, so
every module that needs real HTTP shares it (one stack a pytest-xdist worker that runs such a
module); a test that kills a service must leave at least one of each kind running.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.redis_server import EmbeddedRedis
from tests.factories import tiny_lora, tiny_model
from tests.system.procs import WORKER_TEST_ARGS, Stack, start_stack

# the router splits think blocks off chat outputs (qwen3: only an output that opens one)
STACK_ENV = {
    "SLUICE_CLAIM_IDLE_MS": "1000",
    "SLUICE_HEARTBEAT_TTL_S": "3",
    "SLUICE_REASONING_PARSER": "qwen3",
}

STACK_LORAS = {"sql": 1, "chat": 2}  # adapter name -> tiny_lora seed


def stack_lora(name: str) -> str:
    return tiny_lora(tiny_model("llama"), STACK_LORAS[name])


@pytest.fixture(scope="session")
def http_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = str(tmp_path_factory.mktemp("http-stack-logs"))
    with EmbeddedRedis() as server:
        stack = start_stack(
            server.url,
            tiny_model("llama"),
            logs,
            num_tokenizers=1,
            num_detokenizers=3,
            worker_args=(
                *WORKER_TEST_ARGS,
                "--lora-paths",
                *(f"{name}={stack_lora(name)}" for name in STACK_LORAS),
            ),
            router=True,
            env=STACK_ENV,
        )
        with stack:
            stack.wait_ready()
            yield stack


@pytest.fixture(scope="session")
def served_model(http_stack: Stack) -> str:
    """The name the router serves the model under (the model folder's name)."""
    import os

    return os.path.basename(http_stack.model)
