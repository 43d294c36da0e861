"""Weights an RL trainer broadcasts over the shared stack (SGLang's `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`;
services/router_weight_sync.py), the trainer a separate process making the HTTP calls and its
side of the collectives as slime and verl do (tests/rl_trainer.py, gloo): another checkpoint
sent in three buckets (one flattened) gives transformers' tokens for it, with the weight
version it named, and `/get_weights_by_name` reads back what it sent; a misnamed bucket is a
400 with the reason, received all the same, so the trainer goes on and the next buckets land;
an update refused because a paused request holds K/V is received too; with a second worker,
each joins as its own rank and both serve the new weights, and a worker starting after such an
update refuses to (its weights would differ). Bad bodies are 400s. The stack's weights are
restored after each test."""

from __future__ import annotations

import time

import httpx2 as httpx
import pytest
import torch
from safetensors.torch import load_file

from shared.deployment import BROADCAST_WEIGHTS, read_state
from shared.keys import WORKER_KIND
from shared.redis_server import free_port
from tests.factories import hf_greedy
from tests.rl_trainer import Trainer
from tests.system.procs import Stack, wait_until
from tests.system.stream_client import StreamClient
from tests.system.test_late_worker import start_late_worker
from tests.system.test_router_pause import Streamed
from tests.system.test_router_weights import GREEDY, NEW, OTHER, PROMPT, post, tokens

pytest_plugins = ["tests.system.router_stack"]

def trainer(stack: Stack, *args: str, world_size: int = 2) -> Trainer:
    return Trainer("--port", str(free_port()), "--world-size", str(world_size), "--checkpoint",
                   OTHER, "--buckets", "3", "--router", stack.router_url, *args)  # fmt: skip


@pytest.fixture
def stack(http_stack: Stack):
    yield http_stack
    post(http_stack, "/destroy_weights_update_group")  # (left over by a failed test)
    r = post(http_stack, "/update_weights_from_disk", model_path=http_stack.model,
             weight_version="default")  # fmt: skip
    assert r.status_code == 200, r.text
    assert read_state(http_stack.client, http_stack.prefix).weights == http_stack.model


def test_a_trainer_broadcasts_another_checkpoint(stack: Stack) -> None:
    assert tokens(stack) == hf_greedy(stack.model, PROMPT, NEW)
    answers = trainer(stack, "--order", "0,1f,2", "--weight-version", "step-7").answers()
    init, *updates, destroy, done = answers
    assert init == {"call": "init", "status": 200, "success": True, "message":
                    "Succeeded to initialize custom process group.",
                    "ranks": {stack.worker_id: 1}}  # fmt: skip
    assert [u["status"] for u in updates] == [200, 200, 200], updates
    assert updates[0]["message"] == "Succeeded to update parameter online from distributed."
    assert destroy["status"] == 200 and done == {"call": "done"}
    assert tokens(stack) == hf_greedy(OTHER, PROMPT, NEW)
    version = httpx.get(f"{stack.router_url}/get_weight_version", timeout=10).json()
    assert version == {"weight_version": "step-7"}
    assert read_state(stack.client, stack.prefix).weights == BROADCAST_WEIGHTS


def read(stack: Stack, name: str, n: int = 10**6) -> torch.Tensor:
    r = post(stack, "/get_weights_by_name", name=name, truncate_size=n)
    assert r.status_code == 200, r.text
    return torch.tensor(r.json())


def test_get_weights_by_name_reads_what_the_trainer_sent(stack: Stack) -> None:
    q = "model.layers.0.self_attn.q_proj.weight"
    old = load_file(f"{stack.model}/model.safetensors")
    new = load_file(f"{OTHER}/model.safetensors")
    assert torch.equal(read(stack, q), old[q].flatten().float())
    got = httpx.get(f"{stack.router_url}/get_weights_by_name",
                    params={"name": q, "truncate_size": "5"}, timeout=60)  # fmt: skip
    assert got.status_code == 200 and got.json() == old[q].flatten()[:5].tolist()
    trainer(stack, "--order", "0,1,2").answers()
    for name in (q, "model.layers.1.mlp.up_proj.weight", "model.norm.weight"):
        assert torch.equal(read(stack, name), new[name].flatten().float()), name
    bad = post(stack, "/get_weights_by_name", name="model.nothing")
    assert bad.status_code == 400 and "no weight named 'model.nothing'" in bad.text


def test_a_refused_bucket_is_a_400_and_the_trainer_goes_on(stack: Stack) -> None:
    want = tokens(stack)
    run = trainer(stack, "--order", "0,0,1,2", "--rename-first", "model.extra.weight")
    init, refused, *updates, destroy, done = run.answers()
    assert init["status"] == 200 and done == {"call": "done"}
    assert refused["status"] == 400 and not refused["success"]
    assert "unexpected weight 'model.extra.weight'" in refused["message"], refused
    assert [u["status"] for u in updates] == [200, 200, 200], updates
    assert tokens(stack) == hf_greedy(OTHER, PROMPT, NEW) != want


def test_an_update_refused_while_a_paused_request_holds_kv_is_received(stack: Stack) -> None:
    running = Streamed(stack, 1500)
    assert post(stack, "/pause_generation", mode="in_place").status_code == 200
    try:
        init, refused, destroy, done = trainer(stack, "--order", "0").answers()
        assert init["status"] == 200 and done == {"call": "done"}
        assert refused["status"] == 400
        assert "generation is paused in place" in refused["message"], refused
    finally:
        assert post(stack, "/continue_generation").status_code == 200
    running.join()
    assert running.finish() is not None
    assert tokens(stack) == hf_greedy(stack.model, PROMPT, NEW)  # (unchanged)


def test_two_workers_take_their_ranks_and_a_late_one_refuses(stack: Stack, tmp_path) -> None:
    second = start_late_worker(stack, "second", tmp_path)
    doomed = None
    try:
        wait_until(lambda: "second" in stack.live(WORKER_KIND), 180, [second], "worker 2")
        small = post(stack, "/init_weights_update_group", master_address="127.0.0.1",
                     master_port=free_port(), rank_offset=1, world_size=2, backend="gloo")
        assert small.status_code == 400
        assert "2 worker(s) of 2 rank(s) need ranks 1..2: world_size 2 is too small" in small.text
        init, *updates, destroy, done = trainer(stack, "--order", "0,1,2",
                                                world_size=3).answers()  # fmt: skip
        assert init["ranks"] == dict(zip(sorted([stack.worker_id, "second"]), [1, 2]))
        assert [u["status"] for u in updates] == [200, 200, 200], updates
        want = hf_greedy(OTHER, PROMPT, NEW)
        for worker in (stack.worker_id, "second"):  # (each worker, not the router's pick)
            client = StreamClient(stack.bus, worker)
            rid = client.request(input_ids=PROMPT, sampling_params=GREEDY)
            assert client.wait([rid], timeout_s=120)[rid].output_ids == want, worker

        doomed = start_late_worker(stack, "doomed", tmp_path)
        deadline = time.monotonic() + 180
        while doomed.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not doomed.alive() and doomed.proc.returncode != 0
        assert "weights an RL trainer broadcast" in doomed.log(), doomed.log()[-2000:]
    finally:
        second.stop()
        if doomed is not None:
            doomed.stop()
        wait_until(lambda: "second" not in stack.live(WORKER_KIND), 30, [], "worker 2 gone")


@pytest.mark.parametrize(("path", "body", "reason"), [
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                    "rank_offset": 1, "world_size": 2, "backend": "mpi"},
     "backend 'mpi'"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                    "rank_offset": 0, "world_size": 2},
     "rank 0 is the trainer's"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 70000,
                                    "rank_offset": 1, "world_size": 2}, "not a TCP port"),
    ("/init_weights_update_group", {"master_port": 1, "rank_offset": 1, "world_size": 2},
     "master_address: Field required"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["complex64"],
                                          "shapes": [[2]]}, "not a weight dtype"),
    ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"],
                                          "shapes": [[2]]}, "2 names, 1 dtypes"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"],
                                          "shapes": [[-2]]}, "negative size"),
    ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []},
     "names must not be empty"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"],
                                          "shapes": [[2]], "load_format": "jit"},
     "load_format 'jit'"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["bfloat16"],
                                          "shapes": [[2]]},
     "no weights update group named 'weight_update_group'"),  # (the worker's refusal)
    ("/destroy_weights_update_group", {}, "no weights update group named"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["gASV"]},
     "does not unpickle"),
])  # fmt: skip
def test_bad_calls_are_400s(stack: Stack, path: str, body: dict, reason: str) -> None:
    r = post(stack, path, **body)
    assert r.status_code == 400, r.text
    assert r.json()["success"] is False and reason in r.json()["message"], r.text
    assert tokens(stack) == hf_greedy(stack.model, PROMPT, NEW)
