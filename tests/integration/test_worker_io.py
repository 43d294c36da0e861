"""The worker's I/O process and the pipes to it (`services.worker_link`, `services.worker_io`),
against a real redis-server, without a model."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import redis

from services.worker_link import IoLink, RecordReader, write_record
from services.worker_load import LoadFigures, WorkerFacts
from services.worker_requests import ReqInfo
from shared.bus import Bus
from shared.heartbeat import list_live
from shared.keys import (
    WORKER_KIND,
    detok_stream,
    heartbeat_key,
    router_out_stream,
    worker_in_stream,
)
from shared.messages import AbortReqMsg, ErrorMsg, GenerateReqMsg, StepOutputMsg, decode_message

pytest_plugins = ["tests.redis_fixtures"]


# -- the record pipe ---------------------------------------------------------------------------
def test_records_arrive_whole_and_in_order_across_partial_reads() -> None:
    r, w = os.pipe()
    reader = RecordReader(r)
    big = list(range(100_000))  # ~300 KB: many pipe reads, the writer blocks meanwhile
    sent = [["a", 1], ["big", big], ["b", b"\x00\xff", None]]

    def write() -> None:
        for rec in sent:
            write_record(w, rec)
        os.close(w)

    assert reader.read(timeout=0.0) == []  # nothing yet: at once
    t0 = time.monotonic()
    assert reader.read(timeout=0.05) == []
    assert time.monotonic() - t0 >= 0.04
    writer = threading.Thread(target=write)
    writer.start()
    got = []
    while len(got) < len(sent):
        got += reader.read(timeout=None)
    writer.join()
    assert got == sent
    with pytest.raises(EOFError):
        reader.read(timeout=None)
    os.close(r)


# -- the I/O process ---------------------------------------------------------------------------
def hello(url: str, prefix: str, worker_id: str = "w0") -> dict:
    return {
        "redis_url": url,
        "prefix": prefix,
        "stream_maxlen": 10_000,
        "worker_id": worker_id,
        "batch_size": 64,
        "block_ms": 5,
        "heartbeat_ttl_s": 2.0,
        "router_check_s": 0.0,  # (the routers of these tests have no heartbeat)
        "log_level": "info",
        "facts": list(WorkerFacts(worker_id, "tiny", 1000, 8, 512, os.getpid())),
    }


def wait_for(fn, timeout_s: float = 10.0):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


@pytest.fixture
def link(redis_url: str, key_prefix: str):  # noqa: ANN201
    lk = IoLink(hello(redis_url, key_prefix))
    yield lk
    lk.close()


def test_requests_reach_the_scheduler_and_step_records_become_step_messages(
    redis_client: redis.Redis, key_prefix: str, link: IoLink
) -> None:  # (redis_client first: it empties the database)
    bus = Bus(redis_client, key_prefix)
    beat = list_live(redis_client, key_prefix, WORKER_KIND)["w0"]
    assert beat.pid == os.getpid() and beat.max_total_num_tokens == 1000  # the worker's facts
    link.load(LoadFigures(num_running=3, generation_tokens=10))
    stream = worker_in_stream(key_prefix, "w0")
    bus.publish(stream, GenerateReqMsg("r1", "router-a", [5, 6, 7], skip_special_tokens=False))
    bus.publish(stream, AbortReqMsg("r9", "gone"))
    bus.publish(stream, ErrorMsg("x", "router-a", "oops", "not for a worker", 500, "t"))
    got = []
    while len(got) < 2:
        got += link.receive(timeout=5.0)
    assert [type(m) for m in got] == [GenerateReqMsg, AbortReqMsg]
    assert got[0].input_ids == [5, 6, 7] and got[0].skip_special_tokens is False
    dead = wait_for(lambda: bus.read_dlq())
    assert "unexpected ErrorMsg" in dead[0].reason

    link.start("r1", ReqInfo.of(got[0]))
    none: list[list] = [[], [], [], []]
    link.step(1, [("r1", 0, [40, 41], [], None, 0, None, None, None)], none)
    link.step(2, [], [["r1"], [2], [42], [2]])  # a plain row: the I/O process's window
    link.step(3, [("r1", 3, [43], [40, 41, 42], ("length", None, None), 2, None, None, None)],
              none)  # fmt: skip
    error = ErrorMsg("r2", "router-a", "invalid_request", "bad", 400, "worker:w0")
    link.publish(router_out_stream(key_prefix, "router-a"), error)
    detok = detok_stream(key_prefix)
    entries = wait_for(lambda: (e := redis_client.xrange(detok)) and len(e) == 3 and e)
    steps = [decode_message(fields[b"m"]) for _, fields in entries]
    assert all(isinstance(m, StepOutputMsg) for m in steps)
    assert [m.step for m in steps] == [1, 2, 3]
    first, plain, last = (m.rows()[0] for m in steps)
    assert (first.rid, first.router_id, first.new_ids) == ("r1", "router-a", [40, 41])
    assert first.prompt_tokens == 3
    assert first.skip_special_tokens is False and first.finish_reason is None
    assert (plain.start, plain.new_ids, plain.window_ids, plain.completion_tokens) == (
        2, [42], [40, 41], 3,
    )  # fmt: skip
    assert (plain.router_id, plain.prompt_tokens, plain.cached_tokens) == ("router-a", 3, 2)
    assert plain.skip_special_tokens is False and plain.finish_reason is None
    assert (last.start, last.window_ids, last.completion_tokens) == (3, [40, 41, 42], 4)
    assert last.cached_tokens == 2
    assert last.finish_reason.type == "length"
    out = wait_for(lambda: redis_client.xrange(router_out_stream(key_prefix, "router-a")))
    assert decode_message(out[0][1][b"m"]) == error

    def beat_running() -> int:
        return list_live(redis_client, key_prefix, WORKER_KIND)["w0"].num_running_reqs

    assert wait_for(lambda: beat_running() == 3)  # the load reached the heartbeat


def test_a_clean_close_deletes_the_heartbeat(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    lk = IoLink(hello(redis_url, key_prefix, "w-close"))
    assert redis_client.exists(heartbeat_key(key_prefix, WORKER_KIND, "w-close"))
    lk.close()
    assert lk.proc.returncode == 0
    assert not redis_client.exists(heartbeat_key(key_prefix, WORKER_KIND, "w-close"))


def test_a_lost_io_process_is_an_error_for_the_scheduler(redis_url: str, key_prefix: str) -> None:
    lk = IoLink(hello(redis_url, key_prefix, "w-lost"))
    lk.proc.kill()
    lk.proc.wait()
    with pytest.raises(RuntimeError, match="I/O process exited"):
        for _ in range(100):
            lk.receive(timeout=0.05)
    with pytest.raises(RuntimeError, match="I/O process exited"):
        rows = [("r", 0, [1], [], None, 0, None, None, None)] * 20_000  # more than a pipe holds
        lk.step(1, rows, [[], [], [], []])
    lk.close()


def test_sigint_is_left_to_the_worker_and_sigterm_stops_cleanly(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Ctrl-C reaches the whole process group: the I/O process must outlive it until the
    worker closes the pipe. SIGTERM (the launcher dying) stops it and deletes the beat."""
    lk = IoLink(hello(redis_url, key_prefix, "w-sig"))
    lk.proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert lk.proc.poll() is None
    lk.proc.send_signal(signal.SIGTERM)
    assert lk.proc.wait(timeout=10) == 0
    assert not redis_client.exists(heartbeat_key(key_prefix, WORKER_KIND, "w-sig"))
    lk.close()


def test_an_unreachable_redis_fails_the_start(key_prefix: str) -> None:
    from shared.redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RuntimeError, match="exited at start"):
        IoLink(hello(url, key_prefix, "w-nope"))


def test_close_is_prompt_while_the_io_process_waits_on_a_full_pipe(
    redis_client: redis.Redis, key_prefix: str, link: IoLink
) -> None:
    """Requests the scheduler never drains (it was stopping) fill the pipe; the receiver,
    blocked writing into it, must not hold up the stop."""
    bus = Bus(redis_client, key_prefix)
    stream = worker_in_stream(key_prefix, "w0")
    big = [GenerateReqMsg(f"big{i}", "router-a", list(range(20_000))) for i in range(40)]
    bus.publish_many([(stream, msg) for msg in big])  # ~40 × 60 KB: more than the pipe's 1 MiB
    # The receiver writes one record per read and acks it once written; nothing reads the
    # pipe, so the write that takes it past its capacity blocks, with that read's entries
    # pending (how many depends on how the publish was split between reads: under load the
    # first reads may take a few entries each). Pending entries that stay pending: blocked.

    def blocked() -> bool:
        pending = redis_client.xinfo_groups(stream)[0]["pending"]
        time.sleep(0.3)
        return pending > 0 and redis_client.xinfo_groups(stream)[0]["pending"] == pending

    wait_for(blocked)
    t0 = time.monotonic()
    link.close()
    assert time.monotonic() - t0 < 3.0
    assert link.proc.returncode == 0
    assert not redis_client.exists(heartbeat_key(key_prefix, WORKER_KIND, "w0"))


def test_a_killed_scheduler_takes_its_heartbeat_with_it_at_once(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """kill -9 of the worker: the I/O process sees the pipe close, deletes the heartbeat
    (long before its TTL: routers fail over at once) and exits."""
    import subprocess
    import sys
    import textwrap

    config = hello(redis_url, key_prefix, "w-killed")
    config["heartbeat_ttl_s"] = 60.0
    script = textwrap.dedent(f"""
        import sys, time
        from services.worker_link import IoLink
        link = IoLink({config!r})
        print(link.proc.pid, flush=True)
        time.sleep(60)
    """)
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        io_pid = int(worker.stdout.readline())
        key = heartbeat_key(key_prefix, WORKER_KIND, "w-killed")
        assert redis_client.exists(key)
        worker.kill()
        worker.wait()
        wait_for(lambda: not redis_client.exists(key), timeout_s=10)
        wait_for(lambda: _gone(io_pid), timeout_s=10)
    finally:
        worker.kill()


def _gone(pid: int) -> bool:
    """Exited: reaped, or a zombie (its new parent may not reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_requests_of_a_router_that_is_gone_are_aborted_once(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """services/worker_routers.py: a router whose heartbeat is missing at two looks in a row
    (0.2 s apart here) gets an abort for each of its running requests, once; a router whose
    heartbeat lives keeps its requests."""
    config = hello(redis_url, key_prefix, "w-routers")
    config["router_check_s"] = 0.2
    alive = heartbeat_key(key_prefix, "router", "router-a")
    redis_client.set(alive, b"x", px=60_000)
    lk = IoLink(config)
    try:
        for rid, router_id in (("a1", "router-a"), ("b1", "router-b"), ("b2", "router-b")):
            lk.start(rid, ReqInfo(router_id, True, True, 3))
        got: list = []
        deadline = time.monotonic() + 1.5  # ~7 looks: the aborts come once
        while time.monotonic() < deadline:
            got += lk.receive(timeout=0.1)
        assert sorted((m.rid, m.reason) for m in got) == [
            ("b1", "router router-b is gone"), ("b2", "router router-b is gone")
        ]
        assert all(isinstance(m, AbortReqMsg) for m in got)
        lk.forget("b1")
        lk.forget("b2")
        redis_client.delete(alive)  # router-a dies too
        got = []
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            got += lk.receive(timeout=0.1)
        assert [(m.rid, m.reason) for m in got] == [("a1", "router router-a is gone")]
    finally:
        lk.close()
