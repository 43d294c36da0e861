"""benchmarks/gpu_bench.py on a CPU in quick mode: every subcommand's code path runs (models
built from the presets at tiny sizes, sluice and transformers driven, profiler tables written,
summary keys merged) before any GPU time is spent on it; and the kernel-timeline arithmetic
that turns a profiler trace into GPU idle time (benchmarks/gpu_timeline.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import common, gpu_bench, gpu_timeline

SLOW = pytest.mark.slow  # they share one quick run of every benchmark: ~25 s on 2 busy cores


@pytest.fixture(scope="module")
def quick_all(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, Path]:
    out = tmp_path_factory.mktemp("results")
    models = tmp_path_factory.mktemp("models")
    saved = common.RESULTS_DIR
    try:
        summary = gpu_bench.main(["all", "--device", "cpu", "--quick", "--profile",
                                  "--results-dir", str(out), "--model-dir", str(models)])
    finally:
        common.RESULTS_DIR = saved
    return summary, out, models


def _load(out: Path, name: str) -> dict:
    with open(f"{out}/{name}.json") as f:
        return json.load(f)


@SLOW
def test_seed_shape_runs_both_systems_to_completion(quick_all) -> None:
    summary, out, _ = quick_all
    doc = _load(out, "gpu_seed_shape_quick")
    for system in ("sluice", "transformers_cb"):
        run = doc["results"][system]
        assert run["complete"], f"{system} generated {run['output_tokens']} tokens"
        assert run["output_tokens"] == doc["results"]["num_prompts"] * doc["results"]["output_len"]
    ratio = doc["results"]["sluice"]["output_tok_s"] / doc["results"]["transformers_cb"][
        "output_tok_s"]
    assert summary["vs_transformers_cb_gpu"] == pytest.approx(ratio)
    assert doc["device"]["type"] == "cpu" and doc["machine"]["cpu_count"]
    assert doc["results"]["anchors"]["sglang_output_tok_s"] == 15538


@SLOW
def test_decode_bs1_counts_tied_weights_once(quick_all) -> None:
    from transformers import AutoModelForCausalLM

    _, out, models = quick_all
    res = _load(out, "gpu_decode_bs1_quick")["results"]
    hf = AutoModelForCausalLM.from_pretrained(models / "llama-3.2-1b-float32-quick")
    assert hf.config.tie_word_embeddings
    assert res["weight_bytes"] == 4 * hf.num_parameters()  # float32, lm_head = embedding
    # (flashinfer's decode configurations and the Triton GEMV's run on CUDA only)
    for config in ("flashinfer_decode", "cuda_core_decode", "triton_gemv"):
        assert f"cuda_graph_{config}" not in res
    for config in ("cuda_graph", "no_cuda_graph"):
        row = res[config]
        assert row["ms_per_token"] > 0
        assert row["bytes_per_token"] > res["weight_bytes"]  # plus the KV cache read
        assert row["roofline_fraction_measured_bw"] > 0
    assert res["copy_bandwidth_measured_Bps"] > 0


@SLOW
def test_overlap_cases_generate_every_token(quick_all) -> None:
    summary, out, _ = quick_all
    doc = _load(out, "gpu_overlap_quick")
    cases = doc["results"]["cases"]
    assert {(c["batch"], c["overlap"]) for c in cases} == {(4, True), (8, True), (4, False),
                                                            (8, False)}
    for case in cases:
        assert case["tokens"] == case["batch"] * doc["results"]["new_tokens"]
        assert case["host_step_ms"] > 0
        # the host split (no graphs on a CPU; only the overlap loop has an executor)
        assert case["host_split_steps"] > 0 and case["host_graph_launch_ms"] == 0
        launched = case["host_launch_forward_ms"] > 0 and case["host_wait_ms"] > 0
        assert launched == case["overlap"], case
        step = case["host_split_step_ms"]
        assert 0 < case["host_other_ms"] <= step and case["host_wait_ms"] <= step, case
        # the period from launch marks, every launch of the window's 12 steps (host times on
        # a CPU; no kernels there, so no busy time and no idle fraction)
        events = case["step_events"]
        assert events["steps"] == 11 and case["gpu_step_ms"] == events["period_ms"] > 0, case
        assert 0 <= events["gap_ms_per_step"] <= events["period_ms"], case
        assert case["idle_fraction"] is None, case
    assert set(summary["overlap_on_vs_off_throughput"]) == {"bs4", "bs8"}


@SLOW
def test_summary_merges_every_benchmark_and_profiles_are_written(quick_all) -> None:
    _, out, _ = quick_all
    doc = _load(out, "gpu_summary_quick")
    for key in ("gpt2_seed_shape_output_tok_s", "vs_transformers_cb_gpu",
                "decode_bs1_roofline_fraction", "gpu_idle_fraction_overlap"):
        assert key in doc["summary"], key
    assert doc["results"]["sources"]["vs_transformers_cb_gpu"] == "gpu_seed_shape_quick.json"
    tables = sorted(p.name for p in out.iterdir() if p.name.endswith("_profile_quick.txt"))
    assert "gpu_seed_shape_profile_quick.txt" in tables
    assert "gpu_overlap_bs8_on_profile_quick.txt" in tables
    assert "Self CPU" in (out / "gpu_seed_shape_profile_quick.txt").read_text()


def _kernel(ts: float, dur: float, name: str = "k") -> dict:
    return {"cat": "kernel", "ts": ts, "dur": dur, "name": name}


def test_timeline_idle_is_the_gaps_between_merged_kernels() -> None:
    # two streams: [0, 10) and [5, 12) overlap; then a 3 us gap; then a 30 us bubble
    events = [_kernel(0, 10, "a"), _kernel(5, 7, "b"), _kernel(15, 5, "a"), _kernel(50, 10, "c"),
              {"cat": "gpu_memcpy", "ts": 20, "dur": 4, "name": "Memcpy HtoD"},
              {"cat": "cpu_op", "ts": 0, "dur": 100, "name": "aten::mm"}]
    t = gpu_timeline.timeline_summary(events, num_steps=2)
    assert t["window_ms"] == pytest.approx(0.060)
    assert t["busy_ms"] == pytest.approx(0.027)  # 12 + 5 + 10
    assert t["idle_fraction"] == pytest.approx(33 / 60)
    assert t["idle_ms_per_step"] == pytest.approx(0.0165)
    assert t["busy_ms_per_step"] == pytest.approx(0.0135)
    assert t["bubble_count"] == 1 and t["bubble_fraction"] == pytest.approx(30 / 60)
    assert t["max_gap_us"] == 30
    assert t["memcpy_memset_ms"] == pytest.approx(0.004)
    assert next(iter(t["top_kernels_ms"])) == "a"  # 10 + 5 us


def test_timeline_without_kernels_reports_no_idle() -> None:
    cpu_only = [{"cat": "cpu_op", "ph": "X", "ts": 0, "dur": 5, "name": "aten::mm"}]
    assert gpu_timeline.timeline_summary(cpu_only, 5) == {
        "kernel_count": 0, "idle_fraction": None, "categories": ["cpu_op"]}


def test_engine_arg_values_are_python_literals() -> None:
    assert gpu_bench._engine_args(["cuda_graph_max_bs=160", "schedule_policy=lpm",
                                   "disable_radix_cache=True"]) == {
        "cuda_graph_max_bs": 160, "schedule_policy": "lpm", "disable_radix_cache": True}


def test_step_periods_are_launch_to_launch_and_gaps_end_at_the_last_mark() -> None:
    # launches at 0, 10, 25 (host order); the first batch's work ends at 6, the second's
    # forward at 18 and its deferred sampling at 22: gaps 4 and 3, period (25 - 0) / 2
    marks = [("launch", 0.0), ("done", 6.0), ("launch", 10.0), ("done", 18.0), ("done", 22.0),
             ("launch", 25.0), ("done", 31.0)]
    out = gpu_timeline.step_periods(marks, lambda a, b: b - a)
    assert out == {"steps": 2, "period_ms": 12.5, "gap_ms_per_step": 3.5, "max_gap_ms": 4.0}
    # a stream still busy at the next launch (its mark after the launch's): no gap
    busy = [("launch", 0.0), ("done", 12.0), ("launch", 10.0)]
    assert gpu_timeline.step_periods(busy, lambda a, b: b - a)["gap_ms_per_step"] == 0.0
    assert gpu_timeline.step_periods([("launch", 0.0)], lambda a, b: b - a)["period_ms"] is None


def test_event_idle_fraction_is_busy_over_the_unprofiled_period() -> None:
    assert gpu_timeline.event_idle_fraction(0.668, 0.741) == pytest.approx(0.0985, abs=1e-4)
    assert gpu_timeline.event_idle_fraction(0.8, 0.7) == 0.0  # a GPU-bound loop
    assert gpu_timeline.event_idle_fraction(None, 0.7) is None
