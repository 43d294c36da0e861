"""Worker choice from heartbeats, and the Prometheus text the router exports."""

from __future__ import annotations

import re

from services.router_metrics import RouterMetrics
from services.router_workers import WorkerTable
from services.worker_load import LoadReporter, WorkerFacts, load_figures
from shared.messages import WorkerLoadMsg


def load(worker_id: str, running: int = 0, waiting: int = 0, usage: float = 0.0, pid: int = 1,
         context_len: int = 2048, embedding: bool = False) -> WorkerLoadMsg:  # fmt: skip
    return WorkerLoadMsg(
        worker_id=worker_id, model="/models/tiny", num_running_reqs=running,
        num_waiting_reqs=waiting, num_used_tokens=0, num_cached_tokens=0,
        max_total_num_tokens=1000, max_running_requests=8, context_len=context_len,
        token_usage=usage, gen_throughput=12.5, host="h", pid=pid, updated_at=0.0,
        is_embedding=embedding,
        reqs_by_router={"another-router": running + waiting} if running + waiting else {},
    )  # fmt: skip


def test_least_loaded_worker_wins_counting_this_routers_own_requests() -> None:
    table = WorkerTable(router_id="me")
    table.update({"a": load("a", running=2), "b": load("b", running=1, waiting=2)})
    assert table.choose().worker_id == "a"  # 2 < 3 (another router's)
    for _ in range(4):  # ours count as they are sent, before any heartbeat says so
        table.started("a")
    assert table.load("a") == 6
    assert table.choose().worker_id == "b"
    # what a heartbeat says of our own requests is stale: our live count replaces it
    table.update({"a": load("a"), "b": load("b")})
    table.live["a"].reqs_by_router.update({"me": 9, "them": 1})  # (ours, a second ago)
    assert table.load("a") == 4 + 1 and table.load("b") == 0
    assert table.choose(exclude=["b"]).worker_id == "a"
    assert table.choose(exclude=["a", "b"]) is None
    for _ in range(4):
        table.ended("a")
    assert table.inflight == {}


def test_requests_go_to_workers_of_their_kind() -> None:
    table = WorkerTable()
    assert table.none_for(embedding=True).status == 503  # no worker at all
    table.update({"gen": load("gen", running=5), "emb": load("emb", embedding=True)})
    assert table.choose().worker_id == "gen"  # (the idle embedding worker does not generate)
    assert table.choose(embedding=True).worker_id == "emb"
    assert table.choose(exclude=["emb"], embedding=True) is None
    assert table.none_for(embedding=True).status == 503  # (one exists: tried and gone)
    table.update({"emb": load("emb", embedding=True)})
    err = table.none_for(embedding=False)
    assert err.status == 400 and "use /v1/embeddings" in err.message
    table.update({"gen": load("gen")})
    err = table.none_for(embedding=True)
    assert err.status == 400 and "--is-embedding" in err.message


def test_ties_go_to_lower_token_usage() -> None:
    table = WorkerTable()
    table.update({"a": load("a", usage=0.5), "b": load("b", usage=0.1)})
    assert table.choose().worker_id == "b"


def test_a_worker_restarted_under_the_same_id_is_not_the_one_we_sent_to() -> None:
    table = WorkerTable()
    table.update({"a": load("a", pid=10, context_len=4096), "b": load("b", context_len=2048)})
    assert table.is_alive("a", 10) and not table.is_alive("a", 11)
    assert table.context_len == 2048
    assert table.model_names() == {"/models/tiny", "tiny"}
    table.update({})
    assert not table.is_alive("a", 10) and table.context_len is None


SAMPLE = re.compile(r"^([a-z0-9_:]+)(\{[^}]*\})? (-?[0-9.e+-]+|\+Inf|NaN)$")


def test_metrics_export_sglang_and_sluice_names_in_valid_text_format() -> None:
    m = RouterMetrics("tiny")
    m.observe_first_token(0.003)
    m.observe_finish(0.5, 0.003, prompt=10, completion=5, cached=4)
    m.observe_finish(2.0, None, prompt=10, completion=1, cached=0, reason="length")
    text = m.render({"w0": load("w0", running=3, waiting=1, usage=0.25)})
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-z0-9_:]+ ", line), line
            continue
        match = SAMPLE.match(line)
        assert match, line
        samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    for prefix in ("sluice", "sglang"):
        worker = '{model_name="tiny",worker_id="w0"}'
        assert samples[f"{prefix}:num_running_reqs{worker}"] == 3
        assert samples[f"{prefix}:num_queue_reqs{worker}"] == 1
        assert samples[f"{prefix}:token_usage{worker}"] == 0.25
        assert samples[f"{prefix}:gen_throughput{worker}"] == 12.5
        base = '{model_name="tiny"}'
        assert samples[f"{prefix}:prompt_tokens_total{base}"] == 20
        assert samples[f"{prefix}:generation_tokens_total{base}"] == 6
        assert samples[f"{prefix}:cache_hit_rate{base}"] == 0.2
        assert samples[f"{prefix}:time_to_first_token_seconds_count{base}"] == 1
        ttft = f"{prefix}:time_to_first_token_seconds_bucket"
        assert samples[ttft + '{model_name="tiny",le="0.0025"}'] == 0
        assert samples[ttft + '{model_name="tiny",le="0.005"}'] == 1
        assert samples[f"{prefix}:e2e_request_latency_seconds_count{base}"] == 2
        assert samples[f"{prefix}:e2e_request_latency_seconds_sum{base}"] == 2.5
        # one request had a first token and more than one token: (0.5 - 0.003) / 4
        assert samples[f"{prefix}:time_per_output_token_seconds_count{base}"] == 1
        assert abs(samples[f"{prefix}:time_per_output_token_seconds_sum{base}"] - 0.12425) < 1e-9
        e2e = f"{prefix}:e2e_request_latency_seconds_bucket"
        assert samples[e2e + '{model_name="tiny",le="+Inf"}'] == 2
    # vLLM's names, for its dashboards
    worker, base = '{model_name="tiny",worker_id="w0"}', '{model_name="tiny"}'
    assert samples[f"vllm:num_requests_running{worker}"] == 3
    assert samples[f"vllm:num_requests_waiting{worker}"] == 1
    assert samples[f"vllm:kv_cache_usage_perc{worker}"] == 0.25
    assert samples[f"vllm:num_preemptions_total{worker}"] == 0
    assert samples[f"vllm:prompt_tokens_total{base}"] == 20
    assert samples[f"vllm:generation_tokens_total{base}"] == 6
    assert samples[f"vllm:prefix_cache_queries_total{base}"] == 20
    assert samples[f"vllm:prefix_cache_hits_total{base}"] == 4
    assert samples[f"vllm:time_to_first_token_seconds_count{base}"] == 1
    assert samples[f"vllm:e2e_request_latency_seconds_sum{base}"] == 2.5
    assert samples[f"vllm:request_time_per_output_token_seconds_count{base}"] == 1
    assert samples['vllm:request_success_total{model_name="tiny",finished_reason="stop"}'] == 1
    assert samples['vllm:request_success_total{model_name="tiny",finished_reason="length"}'] == 1
    assert text.count("# TYPE vllm:request_success counter") == 1


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            match = SAMPLE.match(line)
            assert match, line
            out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return out


def test_retractions_of_a_worker_reach_metrics_through_its_heartbeat() -> None:
    """A scheduler forced to retract (a tiny KV pool): the worker's load payload carries its
    count and the router exports it as `num_retracted_reqs` (it was a constant 0 once)."""
    import random

    from tests.fake_runner import create_scheduler
    from tests.unit.test_scheduler import params, rand_prompt, run_all

    rng = random.Random(1)
    s = create_scheduler(max_total_tokens=256, chunked_prefill_size=64, max_prefill_tokens=128)
    for i in range(12):
        s.add_request(f"r{i}", rand_prompt(rng, rng.randint(5, 30)), params(max_new_tokens=40))
    run_all(s)
    assert s.stats.num_retractions > 0
    reporter = LoadReporter(WorkerFacts.of(s, "w0", "tiny"))
    reporter.figures = load_figures(s)
    beat = reporter.payload()
    assert beat.num_retracted_reqs == s.stats.num_retractions
    samples = _samples(RouterMetrics("tiny").render({"w0": beat}))
    worker = '{model_name="tiny",worker_id="w0"}'
    for prefix in ("sluice", "sglang"):
        assert samples[f"{prefix}:num_retracted_reqs{worker}"] == s.stats.num_retractions


def test_server_info_leaves_redis_credentials_out() -> None:
    from services.router_api import without_credentials

    assert without_credentials("redis://h:6379/0") == "redis://h:6379/0"
    assert without_credentials("redis://:s3cret@h:6379/0") == "redis://h:6379/0"
    assert without_credentials("rediss://user:p@ss@h/1") == "rediss://h/1"
    assert without_credentials(None) is None
