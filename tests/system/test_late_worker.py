"""A worker that starts after the deployment was changed at run time (a weights update, LoRA
adapters loaded and unloaded through the router, generation paused, the memory released)
serves what the others serve: the router records each change in Redis (shared/deployment.py)
and the worker applies them before it announces itself (a paused one runs nothing until the
resume, one with its memory released nothing until the wake-up, then on the recorded
weights, read again). A recorded checkpoint it cannot load stops it with the reason."""

from __future__ import annotations

import time

import httpx2 as httpx
import pytest

from shared.deployment import read_state
from shared.heartbeat import list_live
from shared.keys import WORKER_KIND, weights_key
from tests.factories import hf_greedy, tiny_lora, tiny_model
from tests.system.procs import WORKER_TEST_ARGS, Stack, start_service, wait_until
from tests.system.router_stack import STACK_ENV, stack_lora
from tests.system.stream_client import StreamClient

pytest_plugins = ["tests.system.router_stack"]

NEW = 10
PROMPT = [40, 91, 7, 300, 52, 18, 77, 64, 9, 120]
OTHER = tiny_model("llama", seed=1)  # the stack's model's shape, other weights


def post(stack: Stack, path: str, **body: object) -> httpx.Response:
    r = httpx.post(f"{stack.router_url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def start_late_worker(stack: Stack, worker_id: str, tmp_path):
    return start_service(
        "worker", *WORKER_TEST_ARGS, "--lora-paths",
        *(f"{name}={stack_lora(name)}" for name in ("sql", "chat")),
        redis_url=stack.redis_url, prefix=stack.prefix, log_dir=str(tmp_path),
        model=stack.model, service_id=worker_id, env=STACK_ENV,
    )  # fmt: skip


def test_a_late_worker_catches_up_with_the_deployment(http_stack: Stack, tmp_path) -> None:
    stack = http_stack
    extra = tiny_lora(stack.model, 3)
    post(stack, "/update_weights_from_disk", model_path=OTHER)
    post(stack, "/v1/load_lora_adapter", lora_name="extra", lora_path=extra)
    post(stack, "/v1/unload_lora_adapter", lora_name="chat")
    post(stack, "/pause_generation", mode="keep")
    assert httpx.post(f"{stack.router_url}/sleep?level=2", timeout=120).status_code == 200
    late = None
    try:
        state = read_state(stack.client, stack.prefix)
        assert state.weights == OTHER and state.paused == "keep"
        assert state.released == ("kv_cache", "weights")
        assert state.lora_adapters["extra"] == extra and state.lora_adapters["chat"] == ""

        late = start_late_worker(stack, "late", tmp_path)
        wait_until(lambda: "late" in stack.live(WORKER_KIND), 180, [late], "the late worker")
        beat = list_live(stack.client, stack.prefix, WORKER_KIND)["late"]
        assert beat.weights_path == OTHER
        assert sorted(beat.lora_adapters) == ["extra", "sql"]  # chat was unloaded
        assert "the deployment's weights were updated" in late.log()
        assert "starting paused" in late.log()
        assert "the deployment's memory is released (kv_cache, weights)" in late.log()

        client = StreamClient(stack.bus, "late")
        greedy = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
        rid = client.request(input_ids=PROMPT, sampling_params=greedy)
        with pytest.raises(AssertionError, match="1 requests unfinished"):
            client.wait([rid], timeout_s=2)  # (paused: it waits)
        post(stack, "/continue_generation")
        with pytest.raises(AssertionError, match="1 requests unfinished"):
            client.wait([rid], timeout_s=2)  # (its memory released: it waits)
        post(stack, "/wake_up")
        result = client.wait([rid], timeout_s=120)[rid]
        assert result.output_ids == hf_greedy(OTHER, PROMPT, NEW)
    finally:
        post(stack, "/continue_generation")
        post(stack, "/wake_up")
        if late is not None:
            late.stop()
        post(stack, "/update_weights_from_disk", model_path=stack.model)
        post(stack, "/v1/unload_lora_adapter", lora_name="extra")
        post(stack, "/v1/load_lora_adapter", lora_name="chat", lora_path=stack_lora("chat"))
        wait_until(lambda: "late" not in stack.live(WORKER_KIND), 30, [], "the late worker gone")
    state = read_state(stack.client, stack.prefix)
    assert state.weights == stack.model and state.lora_adapters["extra"] == ""


def test_a_recorded_checkpoint_the_worker_cannot_load_stops_it(
    http_stack: Stack, tmp_path
) -> None:
    stack = http_stack
    key = weights_key(stack.prefix)
    before = stack.client.get(key)
    stack.client.set(key, str(tmp_path / "gone"))  # e.g. a checkpoint deleted since
    try:
        late = start_late_worker(stack, "doomed", tmp_path)
        deadline = time.monotonic() + 180
        while late.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not late.alive() and late.proc.returncode != 0
        log = late.log()
        assert "cannot load" in log and f"DEL {key}" in log, log[-2000:]
        assert "doomed" not in stack.live(WORKER_KIND)
    finally:
        if before is None:
            stack.client.delete(key)
        else:
            stack.client.set(key, before)
