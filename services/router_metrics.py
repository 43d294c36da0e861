"""The router's `/metrics`: Prometheus text exposition (format 0.0.4), written by hand.

Every series is exported twice, under `sluice:` and under `sglang:`, so dashboards built
for SGLang work unchanged; those with a vLLM counterpart are exported a third time under
vLLM's names (`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`, ...; see
`_VLLM_GAUGES` and `RouterMetrics._vllm_lines`). Gauges come from the workers' heartbeats
(`WorkerLoadMsg`, one series per worker); latency histograms and token counters from the
router's own observations of the requests it served.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping

from shared.messages import WorkerLoadMsg

PREFIXES = ("sluice", "sglang")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# (metric name, help, WorkerLoadMsg attribute) of the per-worker gauges.
_WORKER_GAUGES = (
    ("num_running_reqs", "Requests running on the worker.", "num_running_reqs"),
    ("num_queue_reqs", "Requests waiting in the worker's queue.", "num_waiting_reqs"),
    ("token_usage", "Fraction of KV-cache slots held by running requests.", "token_usage"),
    ("gen_throughput", "Generation throughput of the worker (token/s).", "gen_throughput"),
    ("num_used_tokens", "KV-cache slots held by running requests.", "num_used_tokens"),
    ("max_total_num_tokens", "KV-cache slots of the worker.", "max_total_num_tokens"),
    (
        "num_retracted_reqs",
        "Requests the worker retracted to its queue for lack of KV memory (since it started).",
        "num_retracted_reqs",
    ),
    (
        "hicache_host_total_tokens",
        "KV slots of the worker's host-memory pool (hierarchical cache; 0 without it).",
        "host_cache_tokens",
    ),
    (
        "hicache_host_used_tokens",
        "Host-memory KV slots holding cached prefixes (hierarchical cache).",
        "host_cache_used_tokens",
    ),
    (
        "hicache_host_hit_tokens",
        "Prompt tokens loaded back from host memory instead of computed (since it started).",
        "host_cache_hit_tokens",
    ),
    (
        "spec_accept_length",
        "Speculative decoding: tokens per request and verify step, 1 + accepted drafts (since "
        "it started; 0 without speculation).",
        "spec_accept_length",
    ),
    (
        "spec_accept_rate",
        "Speculative decoding: drafts accepted per draft proposed (since it started).",
        "spec_accept_rate",
    ),
)

# vLLM's names of the per-worker series (name, type, help, WorkerLoadMsg attribute)
_VLLM_GAUGES = (
    ("num_requests_running", "gauge", "Requests in model execution batches.", "num_running_reqs"),
    ("num_requests_waiting", "gauge", "Requests waiting to be processed.", "num_waiting_reqs"),
    ("kv_cache_usage_perc", "gauge", "KV-cache usage (1 means 100 percent).", "token_usage"),
    ("num_preemptions", "counter", "Cumulative number of preemptions.", "num_retracted_reqs"),
    ("spec_decode_num_drafts", "counter", "Requests of verify steps that had drafts.",
     "spec_num_drafts"),
    ("spec_decode_num_draft_tokens", "counter", "Draft tokens proposed.", "spec_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.",
     "spec_accepted_tokens"),
)  # fmt: skip


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    esc = {
        k: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        for k, v in labels.items()
    }
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


class Histogram:
    """Cumulative-bucket histogram of observations in seconds."""

    def __init__(
        self, name: str, help: str, buckets: Iterable[float], vllm_name: str | None = None
    ) -> None:
        self.name, self.help = name, help
        self.vllm_name = vllm_name or name  # its name under vllm:
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, prefix: str, labels: Mapping[str, str]) -> list[str]:
        name = f"{prefix}:{self.vllm_name if prefix == 'vllm' else self.name}"
        out = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append(f"{name}_bucket{_labels({**labels, 'le': bound})} {running}")
        out.append(f"{name}_sum{_labels(labels)} {_num(self.sum)}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


class RouterMetrics:
    """What the router observed, plus the workers' load at scrape time (`render`)."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.ttft = Histogram(
            "time_to_first_token_seconds", "Time to first token in seconds.", _LATENCY_BUCKETS
        )
        self.tpot = Histogram(
            "time_per_output_token_seconds",
            "Time per output token in seconds.",
            _LATENCY_BUCKETS,
            vllm_name="request_time_per_output_token_seconds",  # per request, as this one is
        )
        self.e2e = Histogram(
            "e2e_request_latency_seconds", "End-to-end request latency in seconds.", _E2E_BUCKETS
        )
        self.finished_by_reason: dict[str, int] = {}  # vLLM's request_success_total
        self.counters = {
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "cached_tokens": 0,
            "num_requests": 0,
            "num_aborted_requests": 0,
        }

    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def observe_finish(
        self,
        e2e_s: float,
        ttft_s: float | None,
        prompt: int,
        completion: int,
        cached: int,
        reason: str = "stop",
    ) -> None:
        self.e2e.observe(e2e_s)
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        if ttft_s is not None and completion > 1:
            self.tpot.observe((e2e_s - ttft_s) / (completion - 1))
        c = self.counters
        c["num_requests"] += 1
        c["prompt_tokens"] += prompt
        c["generation_tokens"] += completion
        c["cached_tokens"] += cached

    def observe_abort(self) -> None:
        self.counters["num_aborted_requests"] += 1

    @property
    def cache_hit_rate(self) -> float:
        prompt = self.counters["prompt_tokens"]
        return self.counters["cached_tokens"] / prompt if prompt else 0.0

    def render(
        self,
        workers: Mapping[str, WorkerLoadMsg],
        routed: Mapping[tuple[str, str], int] | None = None,
    ) -> str:
        """The text of /metrics; `routed`: the requests this router sent to each worker,
        by the routing policy's reason (`router_policy.Policy.pick`)."""
        base = {"model_name": self.model_name}
        lines: list[str] = []
        by_worker = [
            ({**base, "worker_id": w, "reason": why}, n)
            for (w, why), n in sorted((routed or {}).items())
        ]
        lines += _family("sluice:router_routed_requests", "counter",
                         "Requests sent to each worker, by why the routing policy chose it.",
                         by_worker, suffix="_total")  # fmt: skip
        for prefix in PREFIXES:
            for name, help, attr in _WORKER_GAUGES:
                samples = _per_worker(base, workers, attr)
                lines += _family(f"{prefix}:{name}", "gauge", help, samples)
            lines += _family(
                f"{prefix}:cache_hit_rate",
                "gauge",
                "Prefix-cache hit rate of prompt tokens.",
                [(base, self.cache_hit_rate)],
            )
            for hist in (self.ttft, self.tpot, self.e2e):
                lines += hist.lines(prefix, base)
            for name, value in self.counters.items():
                lines += _family(
                    f"{prefix}:{name}",
                    "counter",
                    f"Total {name.replace('_', ' ')}.",
                    [(base, value)],
                    suffix="_total",
                )
        return "\n".join(lines + self._vllm_lines(workers)) + "\n"

    def _vllm_lines(self, workers: Mapping[str, WorkerLoadMsg]) -> list[str]:
        """The series that have a vLLM counterpart, under vLLM's names."""
        base = {"model_name": self.model_name}
        lines: list[str] = []
        for name, kind, help, attr in _VLLM_GAUGES:
            suffix = "_total" if kind == "counter" else ""
            lines += _family(f"vllm:{name}", kind, help, _per_worker(base, workers, attr), suffix)
        for hist in (self.ttft, self.tpot, self.e2e):
            lines += hist.lines("vllm", base)
        c = self.counters
        for name, value, help in (
            ("prompt_tokens", c["prompt_tokens"], "Prefill tokens processed."),
            ("generation_tokens", c["generation_tokens"], "Generation tokens processed."),
            ("prefix_cache_queries", c["prompt_tokens"], "Prompt tokens looked up in the cache."),
            ("prefix_cache_hits", c["cached_tokens"], "Prompt tokens found in the cache."),
        ):
            lines += _family(f"vllm:{name}", "counter", help, [(base, value)], suffix="_total")
        by_reason = [
            ({**base, "finished_reason": reason}, n)
            for reason, n in sorted(self.finished_by_reason.items())
        ]
        lines += _family("vllm:request_success", "counter", "Finished requests.", by_reason,
                         suffix="_total")  # fmt: skip
        per_pos = [
            ({**base, "worker_id": w, "position": str(j)}, n)
            for w, load in sorted(workers.items())
            for j, n in enumerate(load.spec_accepted_per_pos)
        ]
        lines += _family("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
                         "Draft tokens accepted at each position of a step's drafts.", per_pos,
                         suffix="_total")  # fmt: skip
        return lines


def _per_worker(
    base: Mapping[str, str], workers: Mapping[str, WorkerLoadMsg], attr: str
) -> list[tuple[Mapping[str, str], float]]:
    """One sample of heartbeat figure `attr` per worker."""
    return [({**base, "worker_id": w}, getattr(load, attr)) for w, load in sorted(workers.items())]


def _family(
    name: str, kind: str, help: str, samples: list[tuple[Mapping[str, str], float]], suffix=""
) -> list[str]:
    head = [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
    return head + [f"{name}{suffix}{_labels(labels)} {_num(v)}" for labels, v in samples]
