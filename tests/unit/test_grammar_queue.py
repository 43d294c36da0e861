"""The grammar queue: grammars compile beside the scheduler, which keeps stepping meanwhile."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.grammar_queue import GrammarQueue
from tests.fake_runner import create_scheduler, expected_output


class FakeGrammar:
    def accept(self, token_id: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False


class FakeBackend:
    """Compiles any regex but "(" after `gate` opens, counting compilations."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.compiled: list[tuple[str, str]] = []

    def compile(self, spec: tuple[str, str]) -> tuple[str, str]:
        assert self.gate.wait(10), "the test never opened the gate"
        self.compiled.append(spec)
        if spec[1] == "(":
            raise ValueError("regex: unbalanced parenthesis")
        if spec[1] == "boom":
            raise RuntimeError("internal failure")
        return spec

    def matcher(self, compiled: tuple[str, str]) -> FakeGrammar:
        return FakeGrammar()

    def vocab_mask(self, grammars: list) -> None:
        return None


def _req(rid: str, regex: str) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, sampling_params=SamplingParams(regex=regex), grammar=None)


def _drain(queue: GrammarQueue, timeout_s: float = 10.0) -> tuple[list, list]:
    ready, rejected = [], []
    deadline = time.monotonic() + timeout_s
    while len(queue) and time.monotonic() < deadline:
        queue.wait(0.05)
        r, j = queue.take_ready()
        ready += r
        rejected += j
    return ready, rejected


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


def test_compiles_once_in_the_background_then_from_the_cache(backend: FakeBackend) -> None:
    queue = GrammarQueue(lambda: backend, threads=2)
    a, b = _req("a", "x+"), _req("b", "x+")
    assert not queue.submit(a) and not queue.submit(b)  # compiling: both wait, sharing it
    assert queue.take_ready() == ([], []) and len(queue) == 2
    backend.gate.set()
    ready, rejected = _drain(queue)
    assert [r.rid for r in ready] == ["a", "b"] and rejected == []
    assert all(isinstance(r.grammar, FakeGrammar) for r in ready)
    assert backend.compiled == [("regex", "x+")]
    c = _req("c", "x+")
    assert queue.submit(c) and isinstance(c.grammar, FakeGrammar)  # cached: ready at once
    assert backend.compiled == [("regex", "x+")] and len(queue) == 0
    queue.close()


def test_a_grammar_that_fails_rejects_its_requests_with_the_reason(backend: FakeBackend) -> None:
    backend.gate.set()
    queue = GrammarQueue(lambda: backend, threads=1)
    bad, good = _req("bad", "("), _req("good", "y")
    assert not queue.submit(bad) and not queue.submit(good)
    ready, rejected = _drain(queue)
    assert [r.rid for r in ready] == ["good"]
    assert [(r.rid, why) for r, why in rejected] == [("bad", "regex: unbalanced parenthesis")]
    with pytest.raises(ValueError, match="unbalanced"):  # known now: refused at once
        queue.submit(_req("again", "("))
    boom = _req("boom", "boom")  # a failure of the backend itself is the request's error
    queue.submit(boom)
    _, rejected = _drain(queue)
    assert [(r.rid, why) for r, why in rejected] == [
        ("boom", "regex: the grammar could not be compiled (internal failure)")
    ]
    queue.close()


def test_a_slow_grammar_times_out_and_a_queued_request_can_be_removed(
    backend: FakeBackend,
) -> None:
    queue = GrammarQueue(lambda: backend, threads=1, timeout_s=0.2)
    slow, gone = _req("slow", "z"), _req("gone", "w")
    queue.submit(slow)
    queue.submit(gone)
    assert queue.remove("gone") is gone and queue.remove("gone") is None
    time.sleep(0.25)
    ready, rejected = queue.take_ready()
    assert ready == [] and [(r.rid, why) for r, why in rejected] == [
        ("slow", "the grammar did not compile in 0.2 s")
    ]
    backend.gate.set()
    queue.close()


def test_inline_compiles_in_submit_and_raises_there(backend: FakeBackend) -> None:
    backend.gate.set()
    queue = GrammarQueue(lambda: backend, threads=0)
    req = _req("a", "x")
    assert queue.submit(req) and isinstance(req.grammar, FakeGrammar)
    with pytest.raises(ValueError, match="unbalanced"):
        queue.submit(_req("b", "("))
    assert len(queue) == 0


def test_the_cache_keeps_the_most_recent(backend: FakeBackend) -> None:
    backend.gate.set()
    queue = GrammarQueue(lambda: backend, threads=0, cache_size=2)
    for regex in ("a", "b", "a", "c"):  # "b" is the least recently used when "c" comes
        queue.submit(_req(regex, regex))
    queue.submit(_req("a2", "a"))
    queue.submit(_req("b2", "b"))
    assert [s[1] for s in backend.compiled] == ["a", "b", "c", "b"]


@pytest.mark.parametrize("overlap", [False, True])
def test_running_requests_keep_decoding_while_a_grammar_compiles(
    backend: FakeBackend, overlap: bool
) -> None:
    sched = create_scheduler(disable_overlap_schedule=not overlap, cpu_overlap_executor="thread")
    sched.grammar_queue._make_backend = lambda: backend
    try:
        free = [5, 6, 7]
        sched.add_request("free", free, SamplingParams(max_new_tokens=12, ignore_eos=True))
        params = SamplingParams(max_new_tokens=4, ignore_eos=True, regex="q+")
        sched.add_request("constrained", [8, 9], params)
        tokens: dict[str, list[int]] = {"free": [], "constrained": []}
        finished: set[str] = set()

        def run(steps: int) -> None:
            for _ in range(steps):
                for event in sched.step():
                    tokens[event.rid] += event.new_token_ids
                    if event.finished_reason is not None:
                        finished.add(event.rid)

        run(6)  # the compilation is blocked: the free request decodes alone
        assert len(tokens["free"]) >= 4 and tokens["constrained"] == []
        assert sched.has_work() and len(sched.grammar_queue) == 1
        assert sched.stats.num_waiting == 1  # the compiling request counts as waiting
        backend.gate.set()
        deadline = time.monotonic() + 10
        while finished != {"free", "constrained"} and time.monotonic() < deadline:
            run(1)
        assert tokens["free"] == expected_output(free, 12)
        assert tokens["constrained"] == expected_output([8, 9], 4)
        assert sched.take_rejected() == []
    finally:
        sched.close()


def test_a_rejected_or_aborted_request_leaves_the_scheduler(backend: FakeBackend) -> None:
    sched = create_scheduler()
    sched.grammar_queue._make_backend = lambda: backend
    try:
        sched.add_request("bad", [4, 5], SamplingParams(max_new_tokens=4, regex="("))
        sched.add_request("aborted", [4, 6], SamplingParams(max_new_tokens=4, regex="r"))
        sched.abort_request("aborted")
        events = sched.step()
        assert [(e.rid, e.finished_reason.message) for e in events] == [
            ("aborted", "aborted by request")
        ]
        backend.gate.set()
        deadline = time.monotonic() + 10
        while sched.has_work() and time.monotonic() < deadline:
            assert sched.step() == []
        assert not sched.has_work()
        assert sched.take_rejected() == [("bad", "regex: unbalanced parenthesis")]
        assert sched.take_rejected() == []
    finally:
        sched.close()


def test_warm_up_builds_the_backend_once_in_the_background(backend: FakeBackend) -> None:
    built = []

    def make() -> FakeBackend:
        built.append(threading.current_thread().name)
        return backend

    queue = GrammarQueue(make, threads=1)
    future = queue.warm_up()
    assert future is not None and future.result(timeout=5) is backend
    assert queue.backend() is backend and len(built) == 1 and built[0].startswith("grammar")
    assert GrammarQueue(make, threads=0).warm_up() is None  # inline: built on first use
