"""The output processor's quick finish test (a decode step's token that cannot end its
request skips `Req.check_finished`) against the full check after every token."""

from __future__ import annotations

import random
from types import SimpleNamespace

from engine.forward_batch import ForwardMode
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.output_processor import OutputProcessor
from engine.scheduler.req import FinishReason, Req

EOS = (2, 5)
ABORT = FinishReason("abort", message="client")


class _Tokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + t % 26) for t in ids)


class _Cache:
    def cache_finished_req(self, req: Req) -> None:
        pass

    def cache_unfinished_req(self, req: Req) -> None:
        raise AssertionError("a decode step caches no prompt")


class _Scheduler:  # (what the processor reads of one; it holds a weak reference)
    def __init__(self, context_len: int) -> None:
        self.tree_cache = _Cache()
        self.context_len = context_len
        self.stats = SimpleNamespace(generation_tokens=0, num_finished=0)


def _random_request(rng: random.Random) -> tuple[list[int], SamplingParams]:
    params = SamplingParams(
        max_new_tokens=rng.choice([0, 1, 4, 9, 13, 40]),
        min_new_tokens=rng.choice([0, 0, 1, 3]),
        ignore_eos=rng.random() < 0.5,
        stop_token_ids=rng.choice([None, [7], [7, 11]]),
        stop=rng.choice([None, None, ["g"], ["jk", "m"]]),
    ).normalize()
    return [3] * rng.randrange(1, 6), params


def _reference(req: Req, tokens: list[int], context_len: int, abort_at: int | None) -> tuple:
    """Each token appended, then the full check (the plain rule): output and finish step."""
    for step, token in enumerate(tokens):
        if step == abort_at:
            req.to_abort = ABORT
        if req.to_abort is None:
            req.output_ids.append(token)
        req.check_finished(context_len, _Tokenizer())
        if req.finished_reason is not None:
            return list(req.output_ids), step, req.finished_reason
    return list(req.output_ids), None, None


def _trial(seed: int) -> list[FinishReason | None]:
    """40 random requests decoding 16 random tokens each, some aborted: the processor's
    outputs, finish steps and reasons equal the full check's; the reasons."""
    rng = random.Random(seed)
    context_len = rng.choice([8, 12, 64])  # short contexts end some requests (no intake here)
    n, steps = 40, 16
    specs = [_random_request(rng) for _ in range(n)]
    tokens = [[rng.randrange(0, 40) for _ in range(steps)] for _ in range(n)]
    aborts = [rng.randrange(4) if rng.random() < 0.25 else None for _ in range(n)]
    expected = [
        _reference(Req(f"r{i}", list(p), params, EOS), tokens[i], context_len, aborts[i])
        for i, (p, params) in enumerate(specs)
    ]
    reqs = [Req(f"r{i}", list(p), params, EOS) for i, (p, params) in enumerate(specs)]
    scheduler = _Scheduler(context_len)
    processor = OutputProcessor(scheduler, _Tokenizer())
    finished_at: dict[int, int] = {}
    for step in range(steps):
        for i, req in enumerate(reqs):
            if aborts[i] == step and req.finished_reason is None:
                req.to_abort = ABORT
        batch = SimpleNamespace(
            reqs=reqs, forward_mode=ForwardMode.DECODE, decoding_reqs=frozenset(),
            chunked_req=None,
        )  # fmt: skip
        result = SimpleNamespace(next_token_ids=[t[step] for t in tokens], logprobs=None)
        processor.process_batch_result(batch, result)
        for event in processor.take_events():
            i = reqs.index(event.req)
            assert event.start == len(event.req.output_ids) - len(event.new_token_ids)
            if event.finished_reason is not None:
                assert i not in finished_at, "finished twice"
                finished_at[i] = step
    for i, req in enumerate(reqs):
        output, step, reason = expected[i]
        assert (req.output_ids, finished_at.get(i), req.finished_reason) == (
            output, step, reason,
        ), f"seed {seed}, request {i}: {specs[i][1]}, abort at {aborts[i]}"  # fmt: skip
    return [reason for _, _, reason in expected]


def test_quick_finish_test_agrees_with_the_full_check() -> None:
    reasons = [r for seed in range(8) for r in _trial(seed)]
    # the trials reach every kind of end, and leave some requests running
    assert {r.type if r else None for r in reasons} == {"length", "stop", "abort", None}
    matched = {type(r.matched) for r in reasons if r and r.matched is not None}
    assert matched == {int, str}, "stop tokens and stop strings both end requests"


def test_a_token_that_cannot_end_the_request_skips_the_full_check(monkeypatch) -> None:
    """The quick test is taken (the optimisation is not dead code), and never for a step that
    ends a request."""
    calls: list[str] = []
    full = Req.check_finished

    def counting(self: Req, context_len: int, tokenizer: object) -> None:
        calls.append(self.rid)
        full(self, context_len, tokenizer)

    monkeypatch.setattr(Req, "check_finished", counting)
    plain = Req("plain", [3, 4], SamplingParams(max_new_tokens=4).normalize(), EOS)
    stops = Req("stops", [3, 4], SamplingParams(max_new_tokens=4, stop=["zz"]).normalize(), EOS)
    scheduler = _Scheduler(64)
    processor = OutputProcessor(scheduler, _Tokenizer())
    for token in [9, 9, 9, 9]:
        batch = SimpleNamespace(
            reqs=[plain, stops], forward_mode=ForwardMode.DECODE, decoding_reqs=frozenset(),
            chunked_req=None,
        )  # fmt: skip
        processor.process_batch_result(batch, SimpleNamespace(next_token_ids=[token, token],
                                                              logprobs=None))
    # plain: only its fourth token (max_new_tokens) goes through the full check; the request
    # with a stop string is checked after every token
    assert calls.count("plain") == 1 and calls.count("stops") == 4
    assert plain.finished_reason.to_dict() == {"type": "length", "length": 4}
