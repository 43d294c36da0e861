"""The Redis stream bus and heartbeats against a real redis-server (no mocks)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import redis

from shared.async_bus import AsyncBus
from shared.bus import Bus
from shared.heartbeat import Heartbeat, list_live, list_live_async
from shared.keys import (
    DETOKENIZER_GROUP,
    MSG_FIELD,
    ROUTER_OUT_TTL_MS,
    TOKENIZER_GROUP,
    detok_stream,
    heartbeat_index_key,
    heartbeat_key,
    router_out_stream,
    tokenize_stream,
)
from shared.messages import AbortReqMsg, ErrorMsg, ServiceStatusMsg, TokenizeReqMsg

pytest_plugins = ["tests.redis_fixtures"]

GROUP = TOKENIZER_GROUP


def req(i: int) -> TokenizeReqMsg:
    return TokenizeReqMsg(f"r{i}", "router-a", "w0", text=f"prompt {i}", created=float(i))


@pytest.fixture
def bus(redis_client: redis.Redis, key_prefix: str) -> Bus:
    return Bus(redis_client, key_prefix)


def other_bus(redis_url: str, bus: Bus, **kwargs: int) -> Bus:
    """A second bus on its own connection, as another process would have."""
    return Bus(redis.Redis.from_url(redis_url), bus.prefix, **kwargs)


def run_child(redis_url: str, prefix: str, body: str) -> subprocess.Popen:
    """Start a Python child that prints 'ready' (and maybe more) once `body` has run."""
    code = f"import redis, sys, time\nr = redis.Redis.from_url({redis_url!r})\n"
    code += f"prefix = {prefix!r}\n" + textwrap.dedent(body)
    code += "print('ready', flush=True)\ntime.sleep(60)\n"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_publish_and_read_through_a_group(bus: Bus) -> None:
    stream = tokenize_stream(bus.prefix)
    assert bus.ensure_group(stream, GROUP) is True
    assert bus.ensure_group(stream, GROUP) is False  # BUSYGROUP is not an error
    first = bus.publish(stream, req(0))
    ids = bus.publish_many([(stream, req(1)), (stream, req(2).to_msg())])
    entries = bus.read_group(stream, GROUP, "c1", count=10)
    assert [eid for eid, _ in entries] == [first, *ids]
    assert [msg for _, msg in entries] == [req(0), req(1), req(2)]
    assert bus.read_group(stream, GROUP, "c1", count=10) == []
    assert bus.ack(stream, GROUP, *ids, first) == 3
    assert bus.redis.xpending(stream, GROUP)["pending"] == 0


def test_publishing_to_a_router_stream_renews_its_ttl_and_no_other(
    bus: Bus, redis_url: str
) -> None:
    """Rows still in flight to a router that died (its stream deleted or expired) recreate
    the stream: it must come back with a TTL, not stay for good."""
    gone, other = router_out_stream(bus.prefix, "gone"), tokenize_stream(bus.prefix)
    ids = bus.publish_many([(gone, req(0)), (other, req(1)), (gone, req(2))])
    assert len(ids) == 3 and bus.redis.xlen(gone) == 2  # the ids are the XADDs' only
    assert 0 < bus.redis.pttl(gone) <= ROUTER_OUT_TTL_MS
    assert bus.redis.pttl(other) == -1
    bus.redis.persist(gone)
    bus.publish(gone, req(3))
    assert 0 < bus.redis.pttl(gone) <= ROUTER_OUT_TTL_MS

    async def run() -> None:
        abus = AsyncBus.from_url(redis_url, bus.prefix)
        again = router_out_stream(bus.prefix, "again")
        await abus.publish(again, req(4))
        assert 0 < await abus.redis.pttl(again) <= ROUTER_OUT_TTL_MS
        await abus.redis.persist(again)
        (eid,) = await abus.publish_many([(again, req(5))])
        assert 0 < await abus.redis.pttl(again) <= ROUTER_OUT_TTL_MS
        assert (await abus.redis.xrange(again))[-1][0].decode() == eid
        await abus.redis.aclose()

    asyncio.run(run())


def test_group_created_after_publish_sees_earlier_entries(bus: Bus) -> None:
    stream = detok_stream(bus.prefix)
    bus.publish(stream, req(0))
    bus.ensure_group(stream, DETOKENIZER_GROUP)
    assert [m for _, m in bus.read_group(stream, DETOKENIZER_GROUP, "d1")] == [req(0)]


def test_consumers_of_a_group_share_the_work(bus: Bus, redis_url: str) -> None:
    stream = tokenize_stream(bus.prefix)
    bus.ensure_group(stream, GROUP)
    sent = bus.publish_many([(stream, req(i)) for i in range(40)])
    second = other_bus(redis_url, bus)
    got: dict[str, list[str]] = {"c1": [], "c2": []}

    def consume(b: Bus, name: str) -> None:
        while entries := b.read_group(stream, GROUP, name, count=3, block_ms=50):
            got[name].extend(eid for eid, _ in entries)
            b.ack(stream, GROUP, *(eid for eid, _ in entries))
            time.sleep(0.02)  # the other consumer gets its turn

    threads = [threading.Thread(target=consume, args=a) for a in ((bus, "c1"), (second, "c2"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert got["c1"] and got["c2"], "both consumers should have received work"
    assert not set(got["c1"]) & set(got["c2"]), "an entry was delivered to both consumers"
    assert sorted(got["c1"] + got["c2"]) == sorted(sent)


def test_entries_of_a_killed_consumer_are_autoclaimed(bus: Bus, redis_url: str) -> None:
    stream = tokenize_stream(bus.prefix)
    bus.ensure_group(stream, GROUP)
    sent = bus.publish_many([(stream, req(i)) for i in range(3)])
    child = run_child(
        redis_url,
        bus.prefix,
        f"""
        from shared.bus import Bus
        entries = Bus(r, prefix).read_group({stream!r}, {GROUP!r}, "doomed", count=2)
        print(*[eid for eid, _ in entries], flush=True)
        """,
    )
    taken = child.stdout.readline().split()
    assert child.stdout.readline().strip() == "ready"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert taken == sent[:2]
    assert bus.autoclaim(stream, GROUP, "heir", min_idle_ms=500) == []  # not idle long enough
    time.sleep(0.55)
    claimed = bus.autoclaim(stream, GROUP, "heir", min_idle_ms=500)
    assert claimed == [(sent[0], req(0)), (sent[1], req(1))]
    # The untouched third entry still goes to the next reader, and nothing is lost.
    assert bus.read_group(stream, GROUP, "heir") == [(sent[2], req(2))]
    assert bus.ack(stream, GROUP, *sent) == 3
    assert bus.redis.xpending(stream, GROUP)["pending"] == 0


def test_autoclaim_drops_trimmed_entries_and_dead_letters_poison(bus: Bus, redis_url: str) -> None:
    stream = detok_stream(bus.prefix)
    bus.ensure_group(stream, DETOKENIZER_GROUP)
    sent = bus.publish_many([(stream, req(i)) for i in range(3)])
    bus.read_group(stream, DETOKENIZER_GROUP, "d1", count=3)
    bus.redis.xdel(stream, sent[1])  # trimmed while pending
    strict = other_bus(redis_url, bus, max_deliveries=2)
    time.sleep(0.02)
    claimed = strict.autoclaim(stream, DETOKENIZER_GROUP, "d2", min_idle_ms=10)
    assert [eid for eid, _ in claimed] == [sent[0], sent[2]]  # second delivery of each
    assert bus.redis.xpending(stream, DETOKENIZER_GROUP)["pending"] == 2
    strict.ack(stream, DETOKENIZER_GROUP, sent[0])
    time.sleep(0.02)
    assert strict.autoclaim(stream, DETOKENIZER_GROUP, "d3", min_idle_ms=10) == []
    (letter,) = strict.read_dlq()
    assert (letter.source_id, letter.stream) == (sent[2], stream)
    assert "delivered 3 times" in letter.reason and letter.raw == req(2).to_msg()
    assert bus.redis.xpending(stream, DETOKENIZER_GROUP)["pending"] == 0


def test_malformed_entries_go_to_the_dlq_and_reading_continues(bus: Bus) -> None:
    stream = tokenize_stream(bus.prefix)
    bus.ensure_group(stream, GROUP)
    bad_tag = req(0).to_msg().replace(b"tokenize_req", b"tokenize_xyz")
    bus.publish(stream, b"\xc1garbage")
    good = bus.publish(stream, req(1))
    bus.redis.xadd(stream, {b"other": b"1"})
    bus.publish(stream, bad_tag)
    bus.publish(stream, req(2).to_msg()[:-3])  # truncated
    assert bus.read_group(stream, GROUP, "c1", count=10) == [(good, req(1))]
    letters = bus.read_dlq()
    reasons = [d.reason for d in letters]
    assert "not valid msgpack" in reasons[0] and "not valid msgpack" in reasons[3]
    assert reasons[1] == "entry has no field b'm'"
    assert reasons[2] == "unknown message tag 'tokenize_xyz'"
    assert letters[0].raw == b"\xc1garbage" and letters[2].raw == bad_tag
    assert {(d.stream, d.group, d.consumer) for d in letters} == {(stream, GROUP, "c1")}
    # Bad entries were acked; only the good one is pending; reading goes on.
    assert bus.redis.xpending(stream, GROUP)["pending"] == 1
    later = bus.publish(stream, req(3))
    assert bus.read_group(stream, GROUP, "c1") == [(later, req(3))]


def test_read_plain_skips_bad_entries_and_blocks_for_new_ones(bus: Bus) -> None:
    stream = router_out_stream(bus.prefix, "router-a")
    error = ErrorMsg("r1", "router-a", "prompt_too_long", "too long")
    bus.publish(stream, b"junk")
    bad_id = bus.publish(stream, b"\x80")
    last, entries = bus.read_plain(stream, "0")
    assert (last, entries) == (bad_id, [])  # the cursor moved past the dead letters
    assert len(bus.read_dlq()) == 2
    threading.Timer(0.1, lambda: bus.publish(stream, error)).start()
    start = time.monotonic()
    last, entries = bus.read_plain(stream, last, block_ms=5000)
    assert 0.05 < time.monotonic() - start < 3
    assert entries == [(last, error)]
    assert bus.read_plain(stream, last) == (last, [])


def test_maxlen_bounds_every_stream(bus: Bus) -> None:
    stream = detok_stream(bus.prefix)
    for i in range(1500):
        bus.publish(stream, AbortReqMsg(f"r{i}"), maxlen=100)
    assert 100 <= bus.redis.xlen(stream) < 300  # `~`: trimmed a whole node at a time
    small = Bus(bus.redis, bus.prefix, maxlen=50)
    for start in range(0, 1500, 100):
        small.publish_many([(stream, AbortReqMsg(f"r{start + i}")) for i in range(100)])
    assert 50 <= small.redis.xlen(stream) < 250
    last = small.redis.xrevrange(stream, count=1)[0][1][MSG_FIELD]
    assert AbortReqMsg.from_msg(last) == AbortReqMsg("r1499")


def test_lost_group_is_recreated(bus: Bus) -> None:
    stream = tokenize_stream(bus.prefix)
    bus.ensure_group(stream, GROUP)
    bus.redis.delete(stream)  # as after a restart of a Redis without persistence
    assert bus.read_group(stream, GROUP, "c1") == []
    eid = bus.publish(stream, req(5))
    assert bus.read_group(stream, GROUP, "c1") == [(eid, req(5))]


def test_bus_refuses_decoding_clients(redis_url: str) -> None:
    with pytest.raises(ValueError, match="decode_responses=False"):
        Bus(redis.Redis.from_url(redis_url, decode_responses=True))


def test_async_bus(redis_url: str, key_prefix: str) -> None:
    async def scenario() -> None:
        abus = AsyncBus.from_url(redis_url, key_prefix)
        stream = tokenize_stream(key_prefix)
        await abus.ensure_group(stream, GROUP)
        eid = await abus.publish(stream, req(1))
        await abus.publish_many([(stream, b"bad")])
        assert await abus.read_group(stream, GROUP, "a1", count=5) == [(eid, req(1))]
        await asyncio.sleep(0.03)
        assert await abus.autoclaim(stream, GROUP, "a2", min_idle_ms=20) == [(eid, req(1))]
        assert await abus.ack(stream, GROUP, eid) == 1
        out = router_out_stream(key_prefix, "r9")
        oid = await abus.publish(out, AbortReqMsg("x"))
        assert await abus.read_plain(out, "0", block_ms=100) == (oid, [(oid, AbortReqMsg("x"))])
        (letter,) = await abus.read_dlq()
        assert letter.raw == b"bad" and "not valid msgpack" in letter.reason
        await abus.aclose()

    asyncio.run(scenario())


def status(i: int) -> ServiceStatusMsg:
    return ServiceStatusMsg("detokenizer", f"d{i}", "host", i, 0.0, time.time(), i)


def test_heartbeat_expires_when_refreshing_stops(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    beats = [Heartbeat(redis_client, heartbeat_key(key_prefix, "detokenizer", f"d{i}"), 0.4,
                       lambda i=i: status(i)) for i in range(2)]  # fmt: skip
    for hb in beats:
        hb.start()
    time.sleep(0.6)  # longer than the TTL: alive only because the thread refreshes
    live = list_live(redis_client, key_prefix, "detokenizer")
    assert {k: v.service_id for k, v in live.items()} == {"d0": "d0", "d1": "d1"}
    beats[0].stop(delete=False)  # stops refreshing, as a hung process would
    assert "d0" in list_live(redis_client, key_prefix, "detokenizer")
    time.sleep(0.5)
    assert set(list_live(redis_client, key_prefix, "detokenizer")) == {"d1"}
    beats[1].stop()  # a clean stop deletes the key at once
    assert list_live(redis_client, key_prefix, "detokenizer") == {}


def test_list_live_async_skips_undecodable_payloads(redis_url: str, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    alive = status(1)
    for prefix, name, payload in ((key_prefix, "d1", alive), (key_prefix, "d2", b"not a message"),
                                  ("elsewhere", "d3", status(3))):
        Heartbeat(client, heartbeat_key(prefix, "detokenizer", name), 5, lambda p=payload: p).beat()
    client.set(heartbeat_key(key_prefix, "detokenizer", "d4"), alive.to_msg(), px=5000)  # no index

    async def read() -> dict:
        aclient = redis.asyncio.Redis.from_url(redis_url)
        try:
            return await list_live_async(aclient, key_prefix, "detokenizer")
        finally:
            await aclient.aclose()

    assert asyncio.run(read()) == {"d1": alive}
    client.close()


def test_listing_reads_the_index_and_drops_ids_whose_key_expired(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """One script over `{p}:hb-index:{kind}`, not a SCAN: keys of other kinds or prefixes
    and unrelated keys are not read; an id whose key expired leaves the index."""
    beats = {i: Heartbeat(redis_client, heartbeat_key(key_prefix, "worker", f"w{i}"), 0.3,
                          lambda i=i: status(i)) for i in range(3)}  # fmt: skip
    for hb in beats.values():
        hb.beat()
    tokenizer = heartbeat_key(key_prefix, "tokenizer", "t0")
    Heartbeat(redis_client, tokenizer, 5, lambda: status(9)).beat()
    index = heartbeat_index_key(key_prefix, "worker")
    assert redis_client.smembers(index) == {b"w0", b"w1", b"w2"}
    assert set(list_live(redis_client, key_prefix, "worker")) == {"w0", "w1", "w2"}
    time.sleep(0.4)  # every worker key expires; w1 beats again
    beats[1].beat()
    assert set(list_live(redis_client, key_prefix, "worker")) == {"w1"}
    assert redis_client.smembers(index) == {b"w1"}
    beats[1].stop()  # a clean stop leaves no id behind
    assert list_live(redis_client, key_prefix, "worker") == {}
    assert not redis_client.exists(index)
    assert set(list_live(redis_client, key_prefix, "tokenizer")) == {"t0"}


def test_heartbeat_of_a_killed_process_expires(redis_url: str, key_prefix: str) -> None:
    key = heartbeat_key(key_prefix, "worker", "w1")
    child = run_child(
        redis_url,
        key_prefix,
        f"""
        from shared.heartbeat import Heartbeat
        from shared.messages import ServiceStatusMsg
        msg = ServiceStatusMsg("worker", "w1", "host", 1, 0.0, 0.0)
        Heartbeat(r, {key!r}, 0.5, lambda: msg, interval_s=0.1).start()
        """,
    )
    client = redis.Redis.from_url(redis_url)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.6)
        assert set(list_live(client, key_prefix, "worker")) == {"w1"}
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert set(list_live(client, key_prefix, "worker")) == {"w1"}  # until the TTL runs out
        deadline = time.monotonic() + 2.0
        while list_live(client, key_prefix, "worker") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list_live(client, key_prefix, "worker") == {}
    finally:
        child.kill()
        client.close()
