"""tokenizer → worker → detokenizer as real processes over a real Redis, driven through the
streams as a router would (no HTTP): outputs, errors, aborts, malformed messages, and a
detokenizer killed mid-stream.

One stack for the module (1 tokenizer, 1 worker, 3 detokenizers; the tiny llama, whose
byte-fallback tokenizer is the harder case for detokenization). The kill test runs last.
"""

from __future__ import annotations

import os
import signal
import time

import msgpack
import pytest

from engine.tokenizer import load_tokenizer
from services.detokenize import StepDetokenizer
from shared.keys import MSG_FIELD, detok_stream, tokenize_stream, worker_in_stream
from shared.messages import (
    AbortReqMsg,
    ChatMessage,
    GenerateReqMsg,
    PauseReqMsg,
    StepOutputMsg,
    WorkerLoadMsg,
)
from tests.detok_oracle import assert_matches_decode
from tests.factories import tiny_model
from tests.system.procs import WORKER_TEST_ARGS, Stack, start_stack, wait_until
from tests.system.stream_client import StreamClient

pytest_plugins = ["tests.redis_fixtures"]

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
MAX_NEW_LONG = 2000
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "你好，世界",
    "emoji 😀 and café",
    "a",
]


@pytest.fixture(scope="module")
def model() -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def detok(model: str) -> StepDetokenizer:
    return StepDetokenizer(load_tokenizer(model))


@pytest.fixture(scope="module")
def stack(redis_url: str, model: str, tmp_path_factory: pytest.TempPathFactory):
    logs = str(tmp_path_factory.mktemp("logs"))
    trace = os.path.join(logs, "worker_steps.txt")
    env = {
        "SLUICE_CLAIM_IDLE_MS": "1000",
        "SLUICE_HEARTBEAT_TTL_S": "3",
        "SLUICE_WORKER_STEP_TRACE": trace,
    }
    st = start_stack(
        redis_url, model, logs, num_tokenizers=1, num_detokenizers=3, router=False, env=env
    )
    st.step_trace = trace  # type: ignore[attr-defined]
    with st:
        st.wait_ready()
        yield st


@pytest.fixture
def client(stack: Stack) -> StreamClient:
    return StreamClient(stack.bus, stack.worker_id)


def offline_outputs(model: str, prompts: list[str], params: dict) -> list[list[int]]:
    from engine.engine import Engine

    flags = dict(zip(WORKER_TEST_ARGS[::2], WORKER_TEST_ARGS[1::2], strict=True))
    engine = Engine(
        model_path=model,
        max_total_tokens=int(flags["--max-total-tokens"]),
        max_running_requests=int(flags["--max-running-requests"]),
    )
    try:
        return [
            out["output_ids"] for out in engine.generate(prompt=prompts, sampling_params=params)
        ]
    finally:
        engine.shutdown()


def test_the_worker_traces_its_steps_when_asked(stack: Stack, client: StreamClient) -> None:
    """`--step-trace` (here SLUICE_WORKER_STEP_TRACE): one line per step, written when the
    worker goes idle; a request alone is one prefill step and then decode steps."""
    from engine.scheduler.step_trace import read_trace

    path = stack.step_trace  # type: ignore[attr-defined]
    before = len(read_trace(path)) if os.path.exists(path) else 0
    params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    rid = client.request(text="trace me", sampling_params=params)
    assert client.wait([rid])[rid].final.finish_reason.type == "length"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = read_trace(path, skip=before) if os.path.exists(path) else []
        if len(rows) >= 5:
            break
        time.sleep(0.1)
    # One event per token (the last one carries the finish). The overlap loop (the default)
    # reports a batch's results a step late and launches one decode past the end.
    kinds = [r.kind for r in rows]
    assert kinds[0] == "prefill" and set(kinds[1:]) == {"decode"} and len(kinds) in (5, 6)
    assert sum(r.events for r in rows) == 5
    assert all(r.start <= r.end for r in rows)
    assert all(a.end <= b.start for a, b in zip(rows, rows[1:]))


def test_a_cache_flush_empties_the_prefix_cache_and_is_refused_while_busy(
    client: StreamClient,
) -> None:
    prompt = "a prompt long enough for the prefix cache to keep some of it " * 3
    params = {"max_new_tokens": 2, "temperature": 0.0}

    def cached_tokens() -> int:
        rid = client.request(text=prompt, sampling_params=params)
        return client.wait([rid])[rid].final.cached_tokens

    cached_tokens()
    assert cached_tokens() > 0
    deadline = time.monotonic() + 10  # (the last request may still be leaving the worker)
    while not (reply := client.flush()).success and time.monotonic() < deadline:
        time.sleep(0.1)
    assert reply.success and reply.worker_id == client.worker_id
    assert cached_tokens() == 0
    # A request straight to the worker, the flush behind it on the same stream: refused.
    long = {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True}
    client.to_worker(GenerateReqMsg("busy-flush", client.router_id, [7] * 16, long))
    reply = client.flush()
    assert not reply.success and "running" in reply.message
    assert client.wait(["busy-flush"])["busy-flush"].final.completion_tokens == 64


def test_heartbeats_carry_load(stack: Stack) -> None:
    live = stack.live("worker")
    assert live == {stack.worker_id}
    load = stack.bus.redis.get(f"{stack.prefix}:hb:worker:{stack.worker_id}")
    msg = WorkerLoadMsg.from_msg(load)
    assert msg.context_len == 2048 and msg.max_total_num_tokens == 16384
    assert msg.pid == stack.worker.pid and msg.model == stack.model
    assert stack.live("tokenizer") == {"tok0"}
    assert stack.live("detokenizer") == {"detok0", "detok1", "detok2"}


def test_greedy_outputs_match_the_offline_engine(
    stack: Stack, client: StreamClient, model: str, detok: StepDetokenizer
) -> None:
    rids = [client.request(text=p, sampling_params=GREEDY) for p in PROMPTS]
    results = client.wait(rids)
    want = offline_outputs(model, PROMPTS, GREEDY)
    for rid, ids in zip(rids, want, strict=True):
        r = results[rid]
        assert r.error is None, r.error
        assert r.output_ids == ids
        final = r.final
        assert final.finish_reason.type == "length" and final.completion_tokens == 24
        assert final.prompt_tokens == len(detok.tokenizer.encode(PROMPTS[rids.index(rid)]))
        assert_matches_decode(detok, r.output_ids, r.text)


def test_chat_messages_and_input_ids(
    client: StreamClient, detok: StepDetokenizer, model: str
) -> None:
    from engine.tokenizer import apply_chat_template

    chat = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi! 你好")]
    chat_ids = apply_chat_template(
        detok.tokenizer, [{"role": m.role, "content": m.content} for m in chat]
    )
    a = client.request(messages=chat, sampling_params=GREEDY)
    b = client.request(input_ids=chat_ids, sampling_params=GREEDY)
    results = client.wait([a, b])
    assert results[a].final.prompt_tokens == len(chat_ids)
    assert results[a].output_ids == results[b].output_ids
    assert results[a].text == results[b].text
    assert_matches_decode(detok, results[a].output_ids, results[a].text)


def test_sampled_requests_with_logprobs_and_stop_settings(
    client: StreamClient, detok: StepDetokenizer
) -> None:
    params = {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9, "sampling_seed": 7}
    rid = client.request(
        text="Once upon a time",
        sampling_params={**params, "skip_special_tokens": False},
        return_logprob=True,
        top_logprobs_num=2,
    )
    r = client.wait([rid])[rid]
    assert r.error is None
    rows = [r.rows[s] for s in sorted(r.rows)]
    assert all(len(row.token_logprobs) == len(row.output_ids) for row in rows)
    assert all(len(ids) == 2 for row in rows for ids in row.top_logprobs_ids)
    assert_matches_decode(detok, r.output_ids, r.text, skip=False)


@pytest.mark.parametrize(
    ("fields", "code", "words"),
    [
        ({"input_ids": [5] * 2048}, "prompt_too_long", "context length"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": 4000}}, "prompt_too_long", "4000"),
        ({"text": "hi", "sampling_params": {"temperature": -1.0}}, "invalid_request", "temper"),
        ({"text": "hi", "sampling_params": {"nucleus": 0.5}}, "invalid_request", "nucleus"),
        ({"text": "hi", "sampling_params": {"n": 2}}, "invalid_request", "n must be 1"),
        ({"input_ids": [1, 999_999]}, "invalid_request", "input_ids"),
        ({"input_ids": []}, "invalid_request", "empty"),
    ],
)
def test_invalid_requests_are_answered_with_errors(
    client: StreamClient, fields: dict, code: str, words: str
) -> None:
    rid = client.request(**fields)
    r = client.wait([rid])[rid]
    assert r.error is not None and not r.rows
    assert (r.error.code, r.error.status) == (code, 400)
    assert words in r.error.message and r.error.source.startswith("tokenizer:")


def test_the_worker_checks_what_reaches_it_directly(client: StreamClient) -> None:
    bad = GenerateReqMsg("direct-bad", client.router_id, [1, 2, 3], {"top_k": 0})
    client.to_worker(bad)
    r = client.wait(["direct-bad"])["direct-bad"]
    assert r.error.code == "invalid_request" and "top_k" in r.error.message
    assert r.error.source == "worker:w0"


def test_abort_running_and_abort_that_overtakes_its_request(client: StreamClient) -> None:
    long = {"max_new_tokens": 1500, "ignore_eos": True}
    running = client.request(text="tell me a long story", sampling_params=long)

    def started() -> bool:
        client.poll(50)
        return bool(client.results[running].rows)

    wait_until(started, 60, what="output")
    client.to_worker(AbortReqMsg(running, "client gone"))
    # This abort reaches the worker before its request, which goes through a tokenizer.
    client.to_worker(AbortReqMsg("early", "client gone"))
    client.request(rid="early", text="never runs", sampling_params=long)
    results = client.wait([running, "early"], timeout_s=60)
    final = results[running].final
    assert final.finish_reason.type == "abort" and final.completion_tokens < 1500
    assert results[running].complete
    early = results["early"].final
    assert early.finish_reason.type == "abort" and early.completion_tokens == 0


def test_the_requests_of_a_router_that_died_are_aborted(stack: Stack) -> None:
    """A router without a heartbeat (3 s TTL here) at two looks 1.5 s apart: the worker
    aborts its requests (services/worker_routers.py); another router's run on. Once they
    have started, the worker is paused (mode "keep": they stay, and a paused worker ends
    its aborts at once), so that however fast it generates they are still running when the
    router is found gone: on a quiet machine four requests of 2000 tokens (all the tiny
    model's context allows) finished before the second look. (Aborts of running requests
    take the same path: test_abort_running_and_abort_that_overtakes_its_request above.)"""
    gone, stays = StreamClient(stack.bus, stack.worker_id), StreamClient(stack.bus, stack.worker_id)
    long = {"max_new_tokens": MAX_NEW_LONG, "ignore_eos": True}
    rids = [gone.request(text="tell me a long story", sampling_params=long) for _ in range(2)]

    def started() -> bool:
        gone.poll(50)
        return all(gone.results[r].rows for r in rids)

    wait_until(started, 60, what="output")
    stays.to_worker(PauseReqMsg("hold", stays.router_id, "pause", "keep"))
    gone.vanish()
    vanished = time.monotonic()
    results = gone.wait(rids, timeout_s=30)
    assert time.monotonic() - vanished < 10
    for rid in rids:
        final = results[rid].final
        assert final.finish_reason.type == "abort" and final.completion_tokens < MAX_NEW_LONG
        assert final.finish_reason.message == f"router {gone.router_id} is gone"
    other = stays.request(text="and another one", sampling_params={"max_new_tokens": 64})
    stays.to_worker(PauseReqMsg("go", stays.router_id, "resume"))
    final = stays.wait([other], timeout_s=60)[other].final
    assert final.finish_reason.type == "length" and final.completion_tokens == 64


def test_abort_right_behind_its_request(stack: Stack, client: StreamClient) -> None:
    """Request and abort in one read: the request is queued and aborted before any step,
    leaving the worker without work; its final row must still go out at once."""
    req = GenerateReqMsg("queued", client.router_id, [5, 6, 7], {"max_new_tokens": 500})
    stream = worker_in_stream(stack.prefix, stack.worker_id)
    stack.worker.proc.send_signal(signal.SIGSTOP)
    try:
        # A blocked read returns the first new entry alone: let it take a harmless one,
        # so that the next read finds the request and its abort together.
        msgs = [AbortReqMsg("nobody"), req, AbortReqMsg("queued", "client gone")]
        stack.bus.publish_many([(stream, m) for m in msgs])
    finally:
        stack.worker.proc.send_signal(signal.SIGCONT)
    final = client.wait(["queued"], timeout_s=10)["queued"].final
    assert final.finish_reason.type == "abort" and final.completion_tokens == 0


def test_a_redelivered_request_runs_once(client: StreamClient) -> None:
    msg = GenerateReqMsg("twice", client.router_id, [5, 6, 7], {"max_new_tokens": 8})
    client.to_worker(msg)
    client.to_worker(msg)
    r = client.wait(["twice"])["twice"]
    time.sleep(0.5)
    client.poll(100)
    assert r.final.completion_tokens == 8 and len(r.output_ids) == 8
    assert r.num_repeats == 0


def test_malformed_entries_go_to_the_dlq_and_services_keep_serving(
    stack: Stack, client: StreamClient, detok: StepDetokenizer
) -> None:
    streams = [
        tokenize_stream(stack.prefix),
        worker_in_stream(stack.prefix, stack.worker_id),
        detok_stream(stack.prefix),
    ]
    wrong_type = AbortReqMsg("nobody").to_msg()
    bad_step = msgpack.packb({"t": StepOutputMsg.TAG, "v": 1, "worker_id": 3})
    for stream in streams:
        for raw in (b"\xc1 not msgpack", bad_step, wrong_type):
            stack.client.xadd(stream, {MSG_FIELD: raw})
    stack.client.xadd(streams[0], {b"other": b"no m field"})

    def dead() -> dict[str, int]:
        counts: dict[str, int] = {}
        for letter in stack.bus.read_dlq(1000):
            counts[letter.stream] = counts.get(letter.stream, 0) + 1
        return counts

    # (An abort is a valid message on a worker's stream: 2 dead letters there, not 3.)
    want = {streams[0]: 4, streams[1]: 2, streams[2]: 3}
    wait_until(lambda: dead() == want, 30, stack.services, "dead letters")
    rid = client.request(text="still serving?", sampling_params=GREEDY)
    r = client.wait([rid])[rid]
    assert r.final.completion_tokens == 24
    assert_matches_decode(detok, r.output_ids, r.text)
    assert all(s.alive() for s in stack.services)


def test_kill_9_of_a_detokenizer_mid_stream_loses_nothing(
    stack: Stack, client: StreamClient
) -> None:
    params = {"max_new_tokens": 160, "ignore_eos": True, "temperature": 0.0}
    prompts = [f"request number {i}: " + "x" * (i % 7) for i in range(24)]

    def run_all(during=None) -> dict[str, str]:
        c = StreamClient(stack.bus, stack.worker_id)
        rids = [c.request(text=p, sampling_params=params) for p in prompts]
        if during is not None:

            def streaming() -> bool:
                c.poll(20)
                return sum(len(r.rows) for r in c.results.values()) > 40

            wait_until(streaming, 60, stack.services, "output")
            during()
        results = c.wait(rids, timeout_s=120)
        for r in results.values():
            assert r.error is None and r.complete and r.final.completion_tokens == 160
        return {p: results[rid].text for p, rid in zip(prompts, rids, strict=True)}

    fault_free = run_all()
    victim = stack.detokenizers[0]
    pending: list[int] = []

    def victim_pending() -> int:
        consumers = stack.client.xinfo_consumers(detok_stream(stack.prefix), "detokenizers")
        return next((c["pending"] for c in consumers if c["name"] == b"detok0"), 0)

    def kill_holding_entries() -> None:
        # Kill the victim while it holds entries it has read but not acked: those entries
        # must be taken over by the others.
        pending.append(victim.kill_while_holding(victim_pending, producer=stack.worker))

    with_fault = run_all(kill_holding_entries)
    assert with_fault == fault_free
    assert pending[0] > 0, "the victim never held an entry (the test proved nothing)"
    # Its entries (whose output may or may not have gone out before it froze) are taken
    # over by the survivors once idle for SLUICE_CLAIM_IDLE_MS. (The claim moves them out
    # of the victim's pending list just before the claimer logs it: wait for both.)
    def taken_over() -> bool:
        logs = stack.detokenizers[1].log(100_000) + stack.detokenizers[2].log(100_000)
        return victim_pending() == 0 and "took over" in logs

    wait_until(taken_over, 30, stack.detokenizers[1:], "the takeover")


def test_sigterm_stops_every_service_cleanly(stack: Stack) -> None:
    def services_beating() -> list[bytes]:  # (the stream clients' router heartbeats are not)
        keys = stack.client.keys(f"{stack.prefix}:hb:*")
        return [k for k in keys if k.decode().split(":")[-2] != "router"]

    running = [s for s in stack.services if s.alive()]
    codes = stack.stop()
    assert set(codes) == {s.name for s in running}
    assert all(code == 0 for code in codes.values()), (codes, stack.logs())
    # A clean stop deletes the heartbeat at once; the killed detokenizer's expires (TTL 3 s).
    assert {key.decode().rsplit(":", 1)[1] for key in services_beating()} <= {"detok0"}
    wait_until(lambda: not services_beating(), 10, what="heartbeat TTL")
