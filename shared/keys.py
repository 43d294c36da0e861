"""Every Redis key and consumer-group name sluice uses, in one place.

All keys start with the deployment prefix `{p}` (default `sluice`), so several deployments
can share one Redis. Streams:

| key                   | producer → consumer                            | read as              |
|-----------------------|------------------------------------------------|----------------------|
| `{p}:tokenize`        | router → tokenizers                            | group `tokenizers`   |
| `{p}:worker:{w}:in`   | tokenizers, router (aborts) → worker w         | group `worker`       |
| `{p}:detok`           | worker → detokenizers                          | group `detokenizers` |
| `{p}:router:{r}:out`  | detokenizers, routers, any (errors) → router r | plain XREAD          |
| `{p}:dlq`             | anyone → operators                             | XRANGE               |

A router's stream keeps its last entries after they are read (MAXLEN bounds it). It has a
TTL (`ROUTER_OUT_TTL_MS`, 600 s) that its router renews while it runs and that every publish
to it renews too (shared.bus), and its router deletes it when it stops; so a dead router's
stream goes, even when rows still in flight to it recreate it after it expired.

Heartbeats are plain string keys with a TTL: `{p}:hb:{kind}:{id}` (their ids also in the set
`{p}:hb-index:{kind}`: a listing reads it, not the keyspace); so are the Responses API's
stored responses (JSON, services/responses_store.py): `{p}:response:{id}`, and the cancel
marks of background ones, `{p}:response-cancel:{id}`, whose events are the stream
`{p}:response-events:{id}` (also with a TTL; services/responses_background.py), and the
claims of the rids clients name their requests with, `{p}:rid:{rid}` (the holding router and
a token; services/router_named.py).
"""

from __future__ import annotations

DEFAULT_PREFIX = "sluice"
ROUTER_OUT_TTL_MS = 600_000

TOKENIZER_GROUP = "tokenizers"
WORKER_GROUP = "worker"
DETOKENIZER_GROUP = "detokenizers"

# Approximate MAXLEN of every stream. Trimming drops the oldest entries whether or not a
# group has read them, so this must exceed what consumers can fall behind by; a step
# message of 256 requests is about 20 kB, so 10k entries bound a stream near 200 MB.
DEFAULT_STREAM_MAXLEN = 10_000
DEFAULT_DLQ_MAXLEN = 10_000

# The single field of every stream entry, holding the msgpack message.
MSG_FIELD = b"m"

WORKER_KIND = "worker"
TOKENIZER_KIND = "tokenizer"
DETOKENIZER_KIND = "detokenizer"
ROUTER_KIND = "router"


def _check_part(name: str, value: str) -> str:
    if not value or ":" in value or any(c in value for c in "*?[]\\"):
        raise ValueError(f"{name} {value!r} must be non-empty without ':' or glob characters")
    return value


def tokenize_stream(prefix: str) -> str:
    return f"{prefix}:tokenize"


def worker_in_stream(prefix: str, worker_id: str) -> str:
    return f"{prefix}:worker:{_check_part('worker id', worker_id)}:in"


def detok_stream(prefix: str) -> str:
    return f"{prefix}:detok"


def router_out_stream(prefix: str, router_id: str) -> str:
    return f"{prefix}:router:{_check_part('router id', router_id)}:out"


def is_router_out_stream(prefix: str, stream: str) -> bool:
    return stream.startswith(f"{prefix}:router:") and stream.endswith(":out")


def dlq_stream(prefix: str) -> str:
    return f"{prefix}:dlq"


def heartbeat_key(prefix: str, kind: str, service_id: str) -> str:
    return heartbeat_prefix(prefix, kind) + _check_part("service id", service_id)


def heartbeat_prefix(prefix: str, kind: str) -> str:
    """What every heartbeat key of `kind` starts with (its service id follows)."""
    return f"{prefix}:hb:{_check_part('kind', kind)}:"


def heartbeat_index_key(prefix: str, kind: str) -> str:
    """The set of the ids of `kind` that have beaten (shared/heartbeat.py lists it)."""
    return f"{prefix}:hb-index:{_check_part('kind', kind)}"


def heartbeat_parts(key: str) -> tuple[str, str]:
    """A heartbeat key's index key and service id."""
    base, kind, service_id = key.rsplit(":", 2)
    return heartbeat_index_key(base.removesuffix(":hb"), kind), service_id


def named_request_key(prefix: str, rid: str) -> str:
    return f"{prefix}:rid:{rid}"


def response_key(prefix: str, response_id: str) -> str:
    return f"{prefix}:response:{response_id}"


def response_events_key(prefix: str, response_id: str) -> str:
    """A background response's events (a stream, services/responses_background.py)."""
    return f"{prefix}:response-events:{response_id}"


def response_cancel_key(prefix: str, response_id: str) -> str:
    return f"{prefix}:response-cancel:{response_id}"


def weights_key(prefix: str) -> str:
    """The checkpoint the deployment's last weights update moved it to (shared/deployment.py)."""
    return f"{prefix}:weights"


def lora_adapters_key(prefix: str) -> str:
    """Hash: the LoRA adapters loaded ("name" -> folder) or unloaded (-> "") at run time."""
    return f"{prefix}:lora-adapters"


def paused_key(prefix: str) -> str:
    """The pause in force (its mode) while generation is paused (shared/deployment.py)."""
    return f"{prefix}:paused"


def memory_released_key(prefix: str) -> str:
    """The device memory the workers have released while idle (its tags, comma-separated:
    `/release_memory_occupation`, `/sleep`; shared/deployment.py)."""
    return f"{prefix}:memory-released"


def weight_version_key(prefix: str) -> str:
    """The deployment's weight version, a client's label of its weights (SGLang's
    `weight_version`; shared/deployment.py)."""
    return f"{prefix}:weight-version"


def file_key(prefix: str, file_id: str) -> str:
    """Hash: a stored file's object (`meta`) and bytes (`content`) (services/batch_files.py)."""
    return f"{prefix}:file:{file_id}"


def files_index_key(prefix: str) -> str:
    """Sorted set: the stored files' ids by creation time."""
    return f"{prefix}:files"


def batch_key(prefix: str, batch_id: str) -> str:
    """A batch's record: its batch object and the router running it (services/batches.py)."""
    return f"{prefix}:batch:{batch_id}"


def batches_index_key(prefix: str) -> str:
    """Sorted set: the batches' ids by creation time."""
    return f"{prefix}:batches"


def batches_running_key(prefix: str) -> str:
    """Set: the ids of the batches that have not ended."""
    return f"{prefix}:batches-running"


def batch_results_key(prefix: str, batch_id: str) -> str:
    """Hash: a running batch's output lines so far, by input line number."""
    return f"{prefix}:batch-results:{batch_id}"


def batch_lease_key(prefix: str, batch_id: str) -> str:
    """The router running a batch, until the lease expires unless it renews it."""
    return f"{prefix}:batch-lease:{batch_id}"


def batch_cancel_key(prefix: str, batch_id: str) -> str:
    """A running batch's cancel mark: the time it was asked to cancel."""
    return f"{prefix}:batch-cancel:{batch_id}"
