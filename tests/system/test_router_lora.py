"""LoRA adapters through every service: the worker of the shared stack serves two adapters
(`STACK_LORAS`); requests pick one by `model` (vLLM: the adapter's name; SGLang:
`base:adapter`) or `lora_path` (SGLang's /generate), and get PEFT's greedy tokens for it;
/v1/models lists the adapters; a name no worker serves is a 4xx with the reason."""

from __future__ import annotations

import httpx2 as httpx
import pytest

from tests.factories import lora_greedy
from tests.system.procs import Stack
from tests.system.router_stack import STACK_LORAS, stack_lora

pytest_plugins = ["tests.system.router_stack"]

NEW = 12
PROMPT = [40, 91, 7, 300, 52, 18, 77, 64, 9, 120]
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


def http_stack_model(stack: Stack) -> str:
    import os

    return os.path.basename(stack.model)


def generate(url: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=60)


def test_models_lists_the_adapters(http_stack: Stack, served_model: str) -> None:
    data = httpx.get(f"{http_stack.router_url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in data] == [served_model, *sorted(STACK_LORAS)]
    assert all(m["parent"] == served_model for m in data[1:])
    card = httpx.get(f"{http_stack.router_url}/v1/models/sql", timeout=10)
    assert card.status_code == 200 and card.json()["id"] == "sql"


def test_generate_lora_path_matches_peft(http_stack: Stack) -> None:
    url = http_stack.router_url
    outs = {}
    for name in (None, *STACK_LORAS):
        r = generate(url, input_ids=PROMPT, sampling_params=GREEDY, lora_path=name)
        assert r.status_code == 200, r.text
        outs[name] = r.json()["output_ids"]
        want = lora_greedy(http_stack.model, stack_lora(name) if name else None, PROMPT, NEW)
        assert outs[name] == want, name
    assert len({tuple(v) for v in outs.values()}) == 3  # the adapters change the output
    # a batch: one adapter per prompt
    r = generate(
        url, input_ids=[PROMPT] * 3, sampling_params=GREEDY, lora_path=["chat", None, "sql"]
    )
    assert [o["output_ids"] for o in r.json()] == [outs["chat"], outs[None], outs["sql"]]


def test_openai_model_names_the_adapter(http_stack: Stack, served_model: str) -> None:
    url = http_stack.router_url
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    texts = {}
    for model in ("sql", f"{served_model}:sql", served_model):
        r = httpx.post(f"{url}/v1/completions", json=body | {"model": model}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        texts[model] = r.json()["choices"][0]["text"]
    assert texts["sql"] == texts[f"{served_model}:sql"] != texts[served_model]
    sglang_style = body | {"model": served_model, "lora_path": "sql"}
    r = httpx.post(f"{url}/v1/completions", json=sglang_style, timeout=60)
    assert r.json()["choices"][0]["text"] == texts["sql"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "model": "chat"}
    r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "body", "status", "why"),
    [
        ("/generate", {"lora_path": "nope"}, 400, "no LoRA adapter 'nope' is served"),
        ("/generate", {"lora_path": ["sql"]}, 400, "1 lora_path for 2 prompts"),
        ("/v1/completions", {"model": "nope"}, 404, "'nope' does not exist"),
        ("/v1/completions", {"model": "other:sql"}, 404, "'other:sql' does not exist"),
        ("/v1/completions", {"model": "chat", "lora_path": "sql"}, 400, "disagree"),
        ("/v1/completions", {"lora_path": "nope"}, 400, "no LoRA adapter 'nope' is served"),
    ],
)
def test_unknown_adapters_are_refused(
    http_stack: Stack, path: str, body: dict, status: int, why: str
) -> None:
    if path == "/generate":
        body = {"input_ids": [PROMPT, PROMPT], "sampling_params": GREEDY} | body
    else:
        body = {"prompt": "hi", "max_tokens": 2, "model": http_stack_model(http_stack)} | body
    r = httpx.post(f"{http_stack.router_url}{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert why in r.text
