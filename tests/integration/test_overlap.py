"""The overlap scheduler against the plain loop on a real (tiny) model, step by step.

A randomized stress run (arrivals while others run, aborts at random steps, a KV pool small
enough to force retraction, mixed sampling parameters), and one test per trap of the one-step
lag: a request finishing while its next step is in flight, an abort with a placeholder in
flight, retraction of a request in flight, chunked prefill, the prefix cache only ever
holding real tokens, penalties and seeded sampling seeing the right history and step.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import torch

from engine.config import EngineArgs
from engine.engine import Engine, build_scheduler
from engine.mem_cache.base import TreeNode
from engine.overlap.scheduler import OverlapScheduler
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.scheduler import Scheduler
from tests.factories import python_output, tiny_model

VOCAB_LO = 8  # ids below are special tokens


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """The scheduler thread and the forward thread share a 2-core box: a second intra-op
    thread only oversubscribes it (and slows the plain loop many times over under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class Run:
    """What one scheduler run did: streamed tokens and the one finish of each request."""

    tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    finish: dict[str, str] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)  # prompt tokens served by the cache
    stats: dict = field(default_factory=dict)
    scheduler: Scheduler | None = None


def _params(**kw: object) -> SamplingParams:
    p = SamplingParams(**kw)  # type: ignore[arg-type]
    p.verify()
    return p.normalize()


def _walk_keys(node: TreeNode) -> list[int]:
    keys = []
    for child in node.children.values():
        keys.extend(child.key)
        keys.extend(_walk_keys(child))
    return keys


def drive(
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
    aborts: dict[int, list[str]],
    overlap: bool,
    hook=None,  # called with (scheduler, step) before each step
    **engine_kwargs: object,
) -> Run:
    """Feed requests and aborts at given step indices (between steps, as the worker does) and
    step until everything has ended; check the invariants every step and at the end."""
    args = EngineArgs.from_kwargs(
        model_path=tiny_model("llama"), disable_overlap_schedule=not overlap, **engine_kwargs
    )
    scheduler = build_scheduler(args)
    assert isinstance(scheduler, OverlapScheduler) == overlap
    run = Run(scheduler=scheduler)
    last_arrival = max(arrivals)
    mixed_steps = 0
    try:
        step = 0
        while step <= last_arrival or scheduler.has_work():
            for rid, ids, params, *priority in arrivals.get(step, []):
                scheduler.add_request(rid, ids, params, *priority)
            for rid in aborts.get(step, []):
                scheduler.abort_request(rid)
            if hook is not None:
                hook(scheduler, step)
            for ev in scheduler.step():
                assert ev.rid not in run.finish, f"{ev.rid}: an event after its finish"
                assert ev.start == len(run.tokens[ev.rid]), f"{ev.rid}: tokens out of order"
                assert all(t >= 0 for t in ev.new_token_ids), "a placeholder reached the output"
                run.tokens[ev.rid].extend(ev.new_token_ids)
                if ev.finished_reason is not None:
                    run.finish[ev.rid] = ev.finished_reason.type
                    run.cached[ev.rid] = ev.req.cached_tokens
                    assert ev.req.output_ids == run.tokens[ev.rid]
            mixed_steps += bool(getattr(scheduler.last_batch, "decoding_reqs", None))
            step += 1
            assert step < 5000, "the scheduler does not make progress"
        _check_memory(scheduler)
        run.stats = {"retractions": scheduler.stats.num_retractions, "mixed_steps": mixed_steps}
        if overlap:
            run.stats["wraps"] = scheduler.future_map.num_wraps
    finally:
        getattr(scheduler, "close", lambda: None)()
    return run


def _check_memory(scheduler: Scheduler) -> None:
    cache = scheduler.tree_cache
    cache.check_integrity()
    assert all(t >= 0 for t in _walk_keys(cache.root_node)), "the cache holds a placeholder"
    cache.reset()
    allocator = scheduler.model_runner.allocator
    assert allocator.available_size() == allocator.size, "KV slots leaked"
    pool = scheduler.model_runner.req_to_token_pool
    assert pool.available_size() == pool.size, "request rows leaked"


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    kind = rng.choice(["greedy", "long", "long", "penalty", "seeded", "stop"])
    kw: dict = {"max_new_tokens": rng.choice([1, 2, 3, rng.randint(4, 40)])}
    if kind == "greedy":
        kw |= {"temperature": 0.0, "ignore_eos": rng.random() < 0.5}
    elif kind == "long":  # these fill the KV pool: retraction
        kw |= {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": rng.randint(40, 80)}
    elif kind == "penalty":
        kw |= {"temperature": 0.0, "frequency_penalty": 1.5, "presence_penalty": 0.5,
               "repetition_penalty": 1.3}
    elif kind == "seeded":
        kw |= {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "sampling_seed": rng.randrange(99)}
    else:
        kw |= {"temperature": 0.0, "stop_token_ids": rng.sample(range(VOCAB_LO, vocab), 30)}
    return _params(**kw)


def _workload(seed: int, n: int = 40) -> tuple[dict, dict]:
    rng = random.Random(seed)
    vocab = 1536
    shared = [rng.randrange(VOCAB_LO, vocab) for _ in range(40)]
    arrivals: dict[int, list] = defaultdict(list)
    aborts: dict[int, list[str]] = defaultdict(list)
    for i in range(n):
        ids = [rng.randrange(VOCAB_LO, vocab) for _ in range(rng.randint(1, 60))]
        if rng.random() < 0.4:
            ids = shared[: rng.randint(8, 40)] + ids
        step = rng.choice([0, 0, 0, rng.randint(1, 60)])
        arrivals[step].append((f"r{i}", ids, _random_params(rng, vocab)))
        if rng.random() < 0.25:
            aborts[step + rng.randint(0, 12)].append(f"r{i}")
    return arrivals, aborts


STRESS = {
    # an optimistic reservation ratio over a tiny pool: admission overcommits, decode retracts
    "tiny_pool": {"max_total_tokens": 200, "max_running_requests": 16, "init_new_token_ratio": 0.1},
    "paged_chunked": {
        "page_size": 4, "chunked_prefill_size": 32, "max_total_tokens": 512,
        "max_running_requests": 24,
    },
    "radix_off": {"disable_radix_cache": True, "max_total_tokens": 384, "max_running_requests": 24},
}


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("config", list(STRESS))
def test_stress_overlap_matches_plain(config: str, seed: int) -> None:
    """The default CPU executor: a device process (shared request rows, pickled batches)."""
    _stress(config, seed)


@pytest.mark.parametrize("config", list(STRESS))
def test_stress_thread_executor_matches_plain(config: str) -> None:
    """The forward thread (private copies of the request rows) under the same stress."""
    _stress(config, 0, cpu_overlap_executor="thread")


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(STRESS))
def test_stress_cuda_streams_match_plain(config: str) -> None:
    """The CUDA executor (forward and copy streams) under the same stress."""
    _stress(config, 0, device="cuda", attention_backend="torch_native")


def _stress(config: str, seed: int, **extra: object) -> None:
    arrivals, aborts = _workload(seed)
    rids = {rid for reqs in arrivals.values() for rid, _, _ in reqs}
    aborted = {rid for rs in aborts.values() for rid in rs}
    runs = {ov: drive(arrivals, aborts, ov, **STRESS[config], **extra) for ov in (True, False)}
    for run in runs.values():
        assert set(run.finish) == rids, "every request ends exactly once"
    on, off = runs[True], runs[False]
    for rid in sorted(rids):
        a, b = on.tokens[rid], off.tokens[rid]
        if rid not in aborted:
            assert on.finish[rid] == off.finish[rid] != "abort"
            assert a == b, f"{rid}: overlap {a} != plain {b}"
        else:  # cut at different points: one output is a prefix of the other
            short, long = sorted((a, b), key=len)
            assert long[: len(short)] == short, f"{rid}: {a} vs {b}"
    assert on.stats["wraps"] > 0, "the FutureMap ring should have wrapped"
    if config == "tiny_pool":
        assert on.stats["retractions"] > 0 and off.stats["retractions"] > 0
    if extra.get("enable_mixed_chunk"):
        assert on.stats["mixed_steps"] > 0 and off.stats["mixed_steps"] > 0


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LO, 1536) for _ in range(n)]


def test_finish_while_next_step_in_flight() -> None:
    """A request that ends at step N is already in step N+1: the extra token is dropped, its
    KV slot freed once (a double free raises), and nothing is left in flight at the end."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    arrivals = {0: [("short", _prompt(1, 9), _params(max_new_tokens=2, **greedy)),
                    ("long", _prompt(2, 7), _params(max_new_tokens=6, **greedy))]}
    seen_in_flight = []

    def hook(s: OverlapScheduler, step: int) -> None:
        short = [r for rec in s._in_flight for r in rec.reqs if r.rid == "short"]
        if short and short[0].finished:
            seen_in_flight.append(step)

    on = drive(arrivals, {}, True, hook=hook)
    off = drive(arrivals, {}, False)
    assert seen_in_flight, "the finished request should still have been in a launched batch"
    assert len(on.tokens["short"]) == 2 and len(on.tokens["long"]) == 6
    assert on.tokens == off.tokens


def test_abort_with_placeholder_in_flight() -> None:
    greedy = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 30}
    arrivals = {0: [(f"r{i}", _prompt(i, 5 + i), _params(**greedy)) for i in range(3)]}
    had_placeholder = []

    def hook(s: OverlapScheduler, step: int) -> None:
        if step == 4:
            had_placeholder.extend(r.rid for r in s.placeholders_in_flight())

    on = drive(arrivals, {4: ["r1"]}, True, hook=hook)
    assert "r1" in had_placeholder
    assert on.finish == {"r0": "length", "r1": "abort", "r2": "length"}
    assert 0 < len(on.tokens["r1"]) < 30
    off = drive(arrivals, {}, False)
    assert on.tokens["r1"] == off.tokens["r1"][: len(on.tokens["r1"])]
    assert on.tokens["r0"] == off.tokens["r0"] and on.tokens["r2"] == off.tokens["r2"]


def test_retraction_while_in_flight() -> None:
    """Requests retracted while their decode step is in flight drop that step's token and
    recompute it after their re-prefill: same outputs as the plain loop."""
    greedy = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 48}
    arrivals = {0: [(f"r{i}", _prompt(10 + i, 30), _params(**greedy)) for i in range(8)]}
    retracted_in_flight = []
    before: list[tuple] = []  # (request, its retraction count) of the batch in flight

    def hook(s: OverlapScheduler, step: int) -> None:
        retracted_in_flight.extend(r.rid for r, n in before if r.num_retractions > n)
        before[:] = [(r, r.num_retractions) for rec in s._in_flight for r in rec.reqs]

    kw = {"max_total_tokens": 256, "init_new_token_ratio": 0.1}
    on = drive(arrivals, {}, True, hook=hook, **kw)
    off = drive(arrivals, {}, False, **kw)
    assert on.stats["retractions"] > 0 and retracted_in_flight
    assert on.tokens == off.tokens


def test_retracted_with_its_last_token_in_flight() -> None:
    """Retract a request whose final token is in flight: that token must be dropped (the
    request is back in the waiting queue, without a row) and recomputed after the re-prefill;
    appending it would finish a request that holds no memory."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    arrivals = {0: [("r", _prompt(30, 11), _params(max_new_tokens=3, **greedy)),
                    ("s", _prompt(31, 6), _params(max_new_tokens=9, **greedy))]}
    retracted = []

    def hook(s: OverlapScheduler, step: int) -> None:
        batch = s.running_batch
        req = next((r for r in batch.reqs if r.rid == "r"), None)
        if retracted or req is None or len(req.output_ids) != 2:
            return
        if req not in s.placeholders_in_flight():
            return

        def retract_r() -> list:  # what retract_decode does, for this one request
            del batch.check_decode_mem, batch.retract_decode
            batch.reqs.remove(req)
            s.pools.release_req(req)
            req.reset_for_retract()
            retracted.append(step)
            return [req]

        batch.check_decode_mem = lambda: False
        batch.retract_decode = retract_r

    on = drive(arrivals, {}, True, hook=hook)
    off = drive(arrivals, {}, False)
    assert retracted
    assert on.tokens == off.tokens and on.finish == off.finish == {"r": "length", "s": "length"}


def test_priority_preemption_while_in_flight() -> None:
    """Requests preempted for a better one while their decode step is in flight (the overlap
    loop drops that step's rows) end with the plain loop's outputs, after the better ones."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    arrivals = {
        0: [(f"low{i}", _prompt(40 + i, 24), _params(max_new_tokens=40, **greedy), 0)
            for i in range(4)],
        6: [(f"high{i}", _prompt(50 + i, 16), _params(max_new_tokens=6, **greedy), 5)
            for i in range(2)],
    }  # fmt: skip
    kw = {"max_running_requests": 4, "enable_priority_scheduling": True,
          "priority_scheduling_preemption_threshold": 0}  # fmt: skip
    on = drive(arrivals, {}, True, **kw)
    off = drive(arrivals, {}, False, **kw)
    assert on.stats["retractions"] == off.stats["retractions"] == 2
    assert on.tokens == off.tokens
    for run in (on, off):
        assert list(run.finish)[:2] == ["high0", "high1"]


@pytest.mark.parametrize("page_size", [1, 4])
def test_prompts_in_flight_are_shared_with_the_cache(page_size: int) -> None:
    """Requests sharing a new 64-token prefix arrive together; the in-batch prefix check
    admits one and holds the others back a step so that they hit its prefix. With overlap
    that prefill is still in flight when they are admitted: its prompt must be in the cache
    already, or the shared prefix is computed again for each of them."""
    prefix = _prompt(40, 64)
    params = _params(temperature=0.0, ignore_eos=True, max_new_tokens=4)
    arrivals = {0: [(f"r{i}", prefix + _prompt(41 + i, 5), params) for i in range(4)]}
    kw = {"schedule_policy": "lpm", "page_size": page_size}
    on = drive(arrivals, {}, True, **kw)
    off = drive(arrivals, {}, False, **kw)
    assert on.tokens == off.tokens
    assert on.cached == off.cached and sum(on.cached.values()) >= 3 * 64


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_across_steps(page_size: int) -> None:
    greedy = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 8}
    long = _prompt(3, 150)
    arrivals = {
        0: [("a", long, _params(**greedy)), ("b", _prompt(4, 20), _params(**greedy))],
        2: [("c", long[:120] + _prompt(5, 9), _params(**greedy))],
    }
    kw = {"chunked_prefill_size": 32, "page_size": page_size}
    on = drive(arrivals, {}, True, **kw)
    off = drive(arrivals, {}, False, **kw)
    assert on.tokens == off.tokens and all(len(t) == 8 for t in on.tokens.values())


def test_penalties_and_seeds_see_history_and_step() -> None:
    """Strong penalties and seeded sampling depend on every earlier token and on the step
    index: an off-by-one in the lagged history would change the tokens."""
    prompts = [_prompt(20 + i, 12) for i in range(6)]
    plain_greedy = _params(temperature=0.0, ignore_eos=True, max_new_tokens=20)
    mixed = [
        _params(temperature=0.0, ignore_eos=True, max_new_tokens=20, frequency_penalty=2.0),
        _params(temperature=0.0, ignore_eos=True, max_new_tokens=20, repetition_penalty=2.0),
        _params(temperature=0.0, ignore_eos=True, max_new_tokens=20, presence_penalty=2.0),
        _params(temperature=1.5, ignore_eos=True, max_new_tokens=20, sampling_seed=7),
        _params(temperature=1.0, top_k=20, ignore_eos=True, max_new_tokens=20, sampling_seed=8),
        plain_greedy,
    ]
    arrivals = {0: [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, mixed))]}
    on = drive(arrivals, {}, True)
    off = drive(arrivals, {}, False)
    assert on.tokens == off.tokens
    baseline = drive({0: [(f"r{i}", p, plain_greedy) for i, p in enumerate(prompts)]}, {}, True)
    assert on.tokens["r0"] != baseline.tokens["r0"], "the penalty should change the output"


PENALTIES = [
    {"frequency_penalty": 1.5},
    {"presence_penalty": 1.0},
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 0.8, "presence_penalty": 0.5, "repetition_penalty": 1.3},
]


@pytest.mark.parametrize("config,device", [
    ("tiny_pool", "cpu"), ("paged_chunked", "cpu"),
    pytest.param("tiny_pool", "cuda", marks=pytest.mark.gpu),
])  # fmt: skip
def test_device_history_matches_the_host(config: str, device: str) -> None:
    """Every request penalized, or with a bad word of several tokens, or both: the overlap
    loop's history on the device (penalty counts and last tokens in rows handed out as
    requests come and go, reset on re-prefill after a retraction) against the plain loop's,
    counted and matched on the host, under retraction, chunked prefill and aborts. Each bad
    word is taken from the request's output without it, so that it bites."""
    rng = random.Random(5)
    arrivals, aborts = _workload(5, n=36)
    kinds = {}
    for reqs in arrivals.values():
        for i, (rid, ids, _) in enumerate(reqs):
            kw = {"max_new_tokens": rng.randint(6, 60), "ignore_eos": rng.random() < 0.7}
            kinds[rid] = (kw, rng.choice(PENALTIES), rng.choice(["penalty", "words", "both"]))
            reqs[i] = (rid, ids, _params(temperature=0.0, **kw, **kinds[rid][1]))
    aborted = {rid for rs in aborts.values() for rid in rs}
    extra = {"device": "cuda", "attention_backend": "torch_native"} if device == "cuda" else {}
    base = drive(arrivals, aborts, False, **STRESS[config], **extra)
    for reqs in arrivals.values():
        for i, (rid, ids, _) in enumerate(reqs):
            kw, penalty, kind = kinds[rid]
            out, n = base.tokens[rid], rng.choice([2, 3, 4])
            if kind == "penalty" or len(out) < n:
                continue
            k = rng.randrange(len(out) - n + 1)
            reqs[i] = (rid, ids, _params(temperature=0.0, **kw, bad_words_ids=[out[k : k + n]],
                                         **(penalty if kind == "both" else {})))  # fmt: skip
    on = drive(arrivals, aborts, True, **STRESS[config], **extra)
    off = drive(arrivals, aborts, False, **STRESS[config], **extra)
    for rid, tokens in off.tokens.items():
        if rid not in aborted:
            assert on.tokens[rid] == tokens, rid
    changed = [rid for rid, (_, _, kind) in kinds.items()
               if kind != "penalty" and rid not in aborted and off.tokens[rid] != base.tokens[rid]]
    assert len(changed) >= 10, "the bad words changed what was generated"
    slots = on.scheduler._penalty_slots
    assert slots.capacity - 1 < len(on.finish), "rows of finished requests are reused"
    assert slots.width >= 3, "the last tokens kept grew with the longest word"
    assert on.scheduler._sampling_cache.hits > 0, "steady batches reuse their info"
    if config == "tiny_pool":
        assert on.stats["retractions"] > 0


def test_forward_error_is_raised_not_hung(monkeypatch: pytest.MonkeyPatch) -> None:
    args = EngineArgs.from_kwargs(model_path=tiny_model("llama"), cpu_overlap_executor="thread")
    scheduler = build_scheduler(args)
    assert isinstance(scheduler, OverlapScheduler)

    def broken(fb):
        raise ValueError("boom")

    monkeypatch.setattr(scheduler.model_runner, "forward", broken)
    scheduler.add_request("x", _prompt(0, 5), _params(max_new_tokens=3))
    try:
        with pytest.raises(RuntimeError, match="failed on the device"):
            for _ in range(3):
                scheduler.step()
    finally:
        scheduler.close()


def test_device_process_error_is_raised_with_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch that fails in the device process (here: KV slots past the pool) comes back as
    an error answer; the scheduler raises it and the device process keeps serving."""
    import numpy as np

    from engine.overlap import process_executor
    from engine.overlap.process_executor import DeviceError, ProcessExecutor

    scheduler = build_scheduler(EngineArgs.from_kwargs(model_path=tiny_model("llama")))
    assert isinstance(scheduler.executor, ProcessExecutor)
    good = process_executor.device_batch

    def corrupt(mwb):
        out = good(mwb)
        out.out_cache_loc = np.full_like(out.out_cache_loc, 1 << 40)
        return out

    monkeypatch.setattr(process_executor, "device_batch", corrupt)
    scheduler.add_request("x", _prompt(0, 5), _params(max_new_tokens=3))
    try:
        with pytest.raises(RuntimeError, match="failed on the device") as info:
            for _ in range(3):
                scheduler.step()
        assert isinstance(info.value.__cause__, DeviceError)
        assert "Error" in str(info.value.__cause__)  # the device's traceback
        assert scheduler.executor._proc.is_alive()
    finally:
        scheduler.close()
    assert not scheduler.executor._proc.is_alive()


def test_device_process_death_is_an_error_not_a_hang() -> None:
    scheduler = build_scheduler(EngineArgs.from_kwargs(model_path=tiny_model("llama")))
    scheduler.add_request("x", _prompt(0, 5), _params(max_new_tokens=50, ignore_eos=True))
    try:
        scheduler.step()
        scheduler.executor._proc.kill()
        with pytest.raises(RuntimeError, match="device process"):
            for _ in range(5):
                scheduler.step()
    finally:
        scheduler.close()


@pytest.mark.parametrize("executor", ["process", "thread"])
def test_engine_uses_overlap_by_default_and_close_stops_the_device(executor: str) -> None:
    with Engine(
        model_path=tiny_model("llama"), skip_tokenizer_init=True, cpu_overlap_executor=executor
    ) as engine:
        assert isinstance(engine.scheduler, OverlapScheduler)
        out = engine.generate(input_ids=_prompt(0, 6), sampling_params={"max_new_tokens": 4})
        assert len(out["output_ids"]) <= 4
        assert not engine.scheduler.has_work()
        device = engine.scheduler.executor
        device = device._proc if executor == "process" else device._thread
        assert device.is_alive()
    assert not device.is_alive()
    with Engine(model_path=tiny_model("llama"), disable_overlap_schedule=True) as engine:
        assert type(engine.scheduler) is Scheduler


def test_engine_in_a_script_without_main_guard(tmp_path) -> None:
    """The device process must not re-run the user's main script (multiprocessing's
    spawn/forkserver would, and a script without `if __name__ == "__main__"` would start
    engines recursively)."""
    script = tmp_path / "gen.py"
    script.write_text(
        "from engine.engine import Engine\n"
        f"engine = Engine(model_path={tiny_model('llama')!r}, skip_tokenizer_init=True)\n"
        "out = engine.generate(input_ids=[11, 12, 13], sampling_params={'max_new_tokens': 3})\n"
        "print('TOKENS', len(out['output_ids']))\n"
        "engine.shutdown()\n"
    )
    assert python_output(str(script)).count("TOKENS") == 1


def test_device_processes_find_transformers_config_modules_preloaded() -> None:
    """Reading a model's config in a device process imports nothing of transformers' own
    beyond the model's config package: the forkserver preloaded the rest (CONFIG_PRELOAD).
    Without it every device process spent 3-4 s (2.7 s of a tiny model's 2.8 s engine
    start) importing transformers again."""
    import json

    paths = [tiny_model(arch) for arch in ("llama", "gpt2", "qwen3_moe", "gemma2")]
    code = (
        "import importlib, json, sys\n"
        "import torch, engine.overlap.device_process\n"
        "from engine.overlap.process_executor import CONFIG_PRELOAD\n"
        "for name in CONFIG_PRELOAD:\n"
        "    importlib.import_module(name)\n"
        "before = set(sys.modules)\n"
        "from engine.config import ModelConfig\n"
        f"for path in {paths!r}:\n"
        "    ModelConfig.from_pretrained(path)\n"
        "print(json.dumps(sorted(m for m in set(sys.modules) - before\n"
        "                        if m.startswith('transformers'))))\n"
    )
    new = json.loads(python_output("-c", code).strip().splitlines()[-1])
    assert new, "the models' own config modules are imported on demand"
    assert all(m.startswith("transformers.models.") for m in new), new
