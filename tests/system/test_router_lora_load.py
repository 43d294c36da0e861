"""LoRA adapters loaded into and unloaded from the running worker of the shared stack over
HTTP, with vLLM's endpoints (plain-text answers) and SGLang's (JSON): a loaded adapter is
listed and served at once with PEFT's greedy tokens, replaced in place (vLLM's
`load_inplace`) it serves the new weights, unloaded it is refused; one unloaded while a
request streams on it lets that request finish; what cannot be loaded is a 4xx with the
reason. Every test leaves the stack's adapters as they were (`STACK_LORAS`)."""

from __future__ import annotations

import json
import threading

import httpx2 as httpx
import pytest

from tests.factories import lora_greedy, tiny_lora, tiny_model
from tests.system.procs import Stack
from tests.system.router_stack import STACK_LORAS

pytest_plugins = ["tests.system.router_stack"]

NEW = 12
PROMPT = [40, 91, 7, 300, 52, 18, 77, 64, 9, 120]
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


def late(seed: int, rank: int = 8) -> str:
    return tiny_lora(tiny_model("llama"), seed, rank)


def post(stack: Stack, path: str, **body: object) -> httpx.Response:
    return httpx.post(f"{stack.router_url}{path}", json=body, timeout=120)


def served(stack: Stack) -> list[str]:
    data = httpx.get(f"{stack.router_url}/v1/models", timeout=10).json()["data"]
    return [m["id"] for m in data[1:]]


def tokens(stack: Stack, lora: str, **params: object) -> httpx.Response:
    return post(stack, "/generate", input_ids=PROMPT, sampling_params=GREEDY | params,
                lora_path=lora)  # fmt: skip


@pytest.fixture
def stack(http_stack: Stack):
    yield http_stack
    for name in set(served(http_stack)) - set(STACK_LORAS):  # (a test that failed midway)
        post(http_stack, "/v1/unload_lora_adapter", lora_name=name)


def test_vllm_load_replace_unload(stack: Stack) -> None:
    first, second = late(5), late(6)
    r = post(stack, "/v1/load_lora_adapter", lora_name="late", lora_path=first)
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'late' added successfully."
    assert served(stack) == sorted([*STACK_LORAS, "late"])  # listed before the answer came
    r = tokens(stack, "late")
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == lora_greedy(stack.model, first, PROMPT, NEW)
    body = {"prompt": PROMPT, "max_tokens": 4, "model": "late"}
    assert httpx.post(f"{stack.router_url}/v1/completions", json=body, timeout=60).is_success

    r = post(stack, "/v1/load_lora_adapter", lora_name="late", lora_path=second)
    assert r.status_code == 400 and "'late' is already loaded" in r.text, r.text
    r = post(stack, "/v1/load_lora_adapter", lora_name="late", lora_path=second,
             load_inplace=True)  # fmt: skip
    assert r.status_code == 200, r.text
    assert tokens(stack, "late").json()["output_ids"] == lora_greedy(
        stack.model, second, PROMPT, NEW
    )

    r = post(stack, "/v1/unload_lora_adapter", lora_name="late")
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'late' removed successfully."
    assert served(stack) == sorted(STACK_LORAS)
    r = tokens(stack, "late")
    assert r.status_code == 400 and "no LoRA adapter 'late'" in r.text, r.text
    r = post(stack, "/v1/unload_lora_adapter", lora_name="late")
    assert r.status_code == 404 and "'late' is not loaded" in r.text, r.text
    assert tokens(stack, "sql").status_code == 200  # the adapters of the start are untouched


def test_sglang_load_and_unload(stack: Stack) -> None:
    r = post(stack, "/load_lora_adapter", lora_name="late2", lora_path=late(7, rank=4))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True and body["error_message"] == ""
    assert sorted(body["loaded_adapters"]) == sorted([*STACK_LORAS, "late2"])
    assert body["loaded_adapters"]["late2"] == late(7, rank=4)
    r = tokens(stack, "late2")
    assert r.json()["output_ids"] == lora_greedy(stack.model, late(7, rank=4), PROMPT, NEW)
    r = post(stack, "/unload_lora_adapter", lora_name="late2")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert sorted(r.json()["loaded_adapters"]) == sorted(STACK_LORAS)


@pytest.mark.parametrize(
    ("path", "body", "status", "why"),
    [
        ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}, 400,
         "no adapter_config.json in /nonexistent"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}, 400,
         "no adapter_config.json in /nonexistent"),
        ("/load_lora_adapter", {"lora_name": "x", "lora_path": "@BIG"}, 400,
         "rank 16 > max_lora_rank 8"),
        ("/load_lora_adapter", {"lora_name": "x", "lora_path": "@OK", "pinned": True}, 400,
         "pinned adapters are not supported"),
        ("/v1/load_lora_adapter", {"lora_name": " ", "lora_path": "@OK"}, 400, "must not be empty"),
        ("/v1/load_lora_adapter", {"lora_name": "@BASE", "lora_path": "@OK"}, 400,
         "is the base model's name"),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "@OK"}, 400,
         "already loaded"),
        ("/unload_lora_adapter", {"lora_name": "nope"}, 404, "'nope' is not loaded"),
    ],
)  # fmt: skip
def test_refusals(stack: Stack, served_model: str, path: str, body: dict, status: int,
                  why: str) -> None:  # fmt: skip
    swap = {"@BIG": late(8, rank=16), "@OK": late(5), "@BASE": served_model}
    body = {k: swap.get(v, v) for k, v in body.items()}
    r = post(stack, path, **body)
    assert r.status_code == status, r.text
    assert why in r.text
    if path.startswith("/v1/"):
        assert r.json()["error"]["message"]
    else:
        assert r.json()["success"] is False and why in r.json()["error_message"]
    assert served(stack) == sorted(STACK_LORAS)


def test_unloaded_while_streaming_finishes(stack: Stack) -> None:
    folder = late(9)
    assert post(stack, "/v1/load_lora_adapter", lora_name="brief", lora_path=folder).is_success
    long = {"max_new_tokens": 200}
    want = tokens(stack, "brief", **long).json()["output_ids"]
    started, got = threading.Event(), []
    body = {"input_ids": PROMPT, "sampling_params": GREEDY | long, "lora_path": "brief",
            "stream": True}  # fmt: skip

    def stream() -> None:
        with httpx.stream("POST", f"{stack.router_url}/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    got.append(line)

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    r = post(stack, "/v1/unload_lora_adapter", lora_name="brief")
    assert r.status_code == 200, r.text
    at_unload = len(got)
    reader.join(120)
    print(f"{at_unload} of {len(got)} events before the unload's answer")
    assert at_unload < len(got)  # the request was still running
    last = json.loads(got[-1][len("data: "):])
    assert last["output_ids"][-1] == want[-1] and len(got) > 1
    assert last["meta_info"]["completion_tokens"] == 200
    assert tokens(stack, "brief").status_code == 400
