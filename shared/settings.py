"""Service settings: frozen dataclasses filled from CLI flags, then `SLUICE_*` variables.

Each field declares its flag, environment variable and help through `setting()`:

    @dataclass(frozen=True)
    class MySettings:
        common: CommonSettings = field(default_factory=CommonSettings)
        batch_size: int = setting(32, "entries read per call")     # --batch-size, SLUICE_BATCH_SIZE

    parser = argparse.ArgumentParser()
    add_settings_args(parser, MySettings)
    settings = settings_from_args(MySettings, parser.parse_args())

A flag given on the command line wins over the environment, which wins over the default.
A field whose type is itself a settings dataclass contributes its flags flat (flag names
must be unique across the whole tree). Supported field types: str, int, float, bool and
those `| None` (an empty environment variable means None). Children of `sluice serve`
inherit its environment, so a field that differs between services names its own
variable (`SLUICE_WORKER_BATCH_SIZE`, not `SLUICE_BATCH_SIZE`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.keys import DEFAULT_PREFIX, DEFAULT_STREAM_MAXLEN

ENV_PREFIX = "SLUICE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(ValueError):
    """A required setting is missing or a value does not parse."""


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    choices: tuple[Any, ...] | None = None,
    flag: str | None = None,
    env: str | None = None,
) -> Any:
    """A settings field; flag and env default to `--field-name` and `SLUICE_FIELD_NAME`."""
    meta = {"help": help, "choices": choices, "flag": flag, "env": env}
    return field(default=default, metadata=meta)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _env(f: dataclasses.Field) -> str:
    return f.metadata.get("env") or ENV_PREFIX + f.name.upper()


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, whether None is allowed) of a field's type hint."""
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _fields(cls: type) -> Iterator[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield f, hints[f.name]


def _parse(raw: str, tp: type, optional: bool, where: str) -> Any:
    if optional and raw == "":
        return None
    if tp is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise SettingsError(f"{where}: expected a boolean (1/0, true/false), got {raw!r}")
    try:
        return tp(raw)
    except ValueError:
        raise SettingsError(f"{where}: expected {tp.__name__}, got {raw!r}") from None


def add_settings_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of settings dataclass `cls` (recursively) to `parser`.

    Flags default to "not given" (argparse.SUPPRESS), so `settings_from_args` can tell a
    flag from an environment variable.
    """
    for f, tp in _fields(cls):
        if dataclasses.is_dataclass(tp):
            add_settings_args(parser, tp)
            continue
        base, optional = _base_type(tp)
        default = "required" if f.default is dataclasses.MISSING else repr(f.default)
        help_text = f"{f.metadata.get('help', '')} (env {_env(f)}; default {default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if base is bool:
            parser.add_argument(_flag(f), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        choices = f.metadata.get("choices")
        parser.add_argument(
            _flag(f), type=lambda raw, b=base, o=optional: _parse(raw, b, o, "flag"),
            choices=choices, metavar=base.__name__.upper(), **kwargs,
        )  # fmt: skip


def settings_from_args(
    cls: type, args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> Any:
    """Build `cls` from parsed flags (`args`), then `environ` (default os.environ)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f, tp in _fields(cls):
        if dataclasses.is_dataclass(tp):
            values[f.name] = settings_from_args(tp, args, environ)
        elif args is not None and hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
        elif _env(f) in environ:
            base, optional = _base_type(tp)
            values[f.name] = _parse(environ[_env(f)], base, optional, _env(f))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SettingsError(f"{f.name} is required: pass {_flag(f)} or set {_env(f)}")
        choices = f.metadata.get("choices")
        if choices and values.get(f.name) is not None and values[f.name] not in choices:
            raise SettingsError(f"{_env(f)}: {values[f.name]!r} is not one of {list(choices)}")
    return cls(**values)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The flags every service takes (`CommonSettings`)."""
    add_settings_args(parser, CommonSettings)


def default_service_id() -> str:
    """`host-pid`: unique per process, readable in `XINFO CONSUMERS` and heartbeat keys."""
    return f"{os.uname().nodename.split('.')[0].replace(':', '-')}-{os.getpid()}"


@dataclass(frozen=True)
class CommonSettings:
    """What every service needs to join a deployment."""

    redis_url: str | None = setting(None, "Redis URL, e.g. redis://127.0.0.1:6379/0")
    prefix: str = setting(DEFAULT_PREFIX, "key prefix of this deployment")
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))
    stream_maxlen: int = setting(DEFAULT_STREAM_MAXLEN, "approximate MAXLEN of every stream")
    heartbeat_ttl_s: float = setting(5.0, "a service missing for this long counts as dead")
    claim_idle_ms: int = setting(30_000, "take over entries a dead consumer left this long")

    def require_redis_url(self) -> str:
        if not self.redis_url:
            raise SettingsError(
                f"a Redis URL is required: pass --redis-url or set {ENV_PREFIX}REDIS_URL"
            )
        return self.redis_url


# the names services/tool_parsers.py knows (aliases included)
TOOL_CALL_PARSERS = ("hermes", "qwen25", "qwen", "qwen3", "llama3", "llama3_json", "mistral")
REASONING_PARSERS = ("qwen3", "deepseek-r1", "qwen3-thinking")  # services/reasoning_parsers.py
# services/router_policy.py
ROUTING_POLICIES = ("cache_aware", "shortest_queue", "round_robin", "random", "power_of_two")


@dataclass(frozen=True)
class RouterSettings:
    common: CommonSettings = field(default_factory=CommonSettings)
    router_id: str | None = setting(None, "id of this router (default host-pid)")
    host: str = setting("127.0.0.1", "HTTP bind address")
    port: int = setting(30000, "HTTP port")
    model: str | None = setting(None, "model folder (for its name and tokenizer config)")
    served_model_name: str | None = setting(None, "model name in the API (default: folder name)")
    request_timeout_s: float = setting(600.0, "abort a request after this long")
    responses_store_ttl_s: float = setting(
        3600.0,
        "keep Responses API responses (store: true) in Redis this long, for "
        "previous_response_id and GET /v1/responses/{id}; 0 stores none",
    )
    files_ttl_s: float = setting(
        2_592_000.0,
        "keep files (/v1/files: batch inputs and outputs) this long unless a file says "
        "expires_after (default 30 days, OpenAI's for batch files); 0 keeps them until deleted",
    )
    files_max_bytes: int = setting(
        200_000_000, "largest file /v1/files takes (OpenAI's batch input limit)"
    )
    batch_concurrency: int = setting(
        256, "requests of batches (/v1/batches) this router has in flight at once, at most"
    )
    batch_max_requests: int = setting(50_000, "most requests one batch's input file may hold")
    batch_priority: int | None = setting(
        None,
        "the priority of a batch's generation requests that name none, with the workers' "
        "--enable-priority-scheduling (larger first: -1 puts batches behind interactive "
        "requests, whose priority is 0)",
    )
    incremental_streaming_output: bool = setting(
        False, "streamed /generate chunks carry only the new text and ids (SGLang's flag)"
    )
    tool_call_parser: str | None = setting(
        None,
        "how the model writes tool calls: hermes (qwen25), llama3, mistral "
        "(default: the format its chat template teaches)",
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = setting(
        None,
        "split <think>...</think> off chat outputs as reasoning_content: qwen3 (an optional "
        "block at the start), deepseek-r1 / qwen3-thinking (the prompt opened the block)",
        choices=REASONING_PARSERS,
    )
    policy: str = setting(
        "cache_aware",
        "how a request's worker is chosen: cache_aware (the worker that was sent the longest "
        "prefix of its prompt, while loads stay balanced), shortest_queue, round_robin, "
        "random, power_of_two",
        choices=ROUTING_POLICIES,
        env="SLUICE_ROUTING_POLICY",
    )
    cache_threshold: float = setting(
        0.3,
        "cache_aware: go to the worker holding the prompt's longest prefix when that prefix "
        "is more than this fraction of the prompt, else to the one holding the least",
    )
    balance_abs_threshold: int = setting(
        64,
        "cache_aware: the least loaded worker takes requests while the most loaded has more "
        "than this many requests more than it (and --balance-rel-threshold times as many)",
    )
    balance_rel_threshold: float = setting(1.5, "cache_aware: see --balance-abs-threshold")
    max_tree_size: int = setting(
        1 << 24,
        "cache_aware: characters of prompts remembered per worker (least recently routed "
        "forgotten first)",
    )


@dataclass(frozen=True)
class TokenizerSettings:
    common: CommonSettings = field(default_factory=CommonSettings)
    model: str | None = setting(None, "model folder holding the tokenizer")
    consumer: str | None = setting(
        None, "consumer name in the group (default host-pid)", env="SLUICE_TOKENIZER_CONSUMER"
    )
    batch_size: int = setting(32, "entries read per call", env="SLUICE_TOKENIZER_BATCH_SIZE")
    block_ms: int = setting(
        100, "longest wait for new entries per read", env="SLUICE_TOKENIZER_BLOCK_MS"
    )


@dataclass(frozen=True)
class WorkerSettings:
    common: CommonSettings = field(default_factory=CommonSettings)
    worker_id: str = setting("0", "id of this worker; keep it across restarts")
    model: str | None = setting(None, "model folder")
    batch_size: int = setting(256, "entries read per call", env="SLUICE_WORKER_BATCH_SIZE")
    block_ms: int = setting(
        5, "longest wait for new entries when idle", env="SLUICE_WORKER_BLOCK_MS"
    )
    step_trace: str | None = setting(
        None,
        "append each scheduler step's start, end, kind and event count to this file (profiling)",
        env="SLUICE_WORKER_STEP_TRACE",
    )
    profile_dir: str = setting(
        "/tmp/sluice-profile",
        "where POST /start_profile writes torch profiler traces unless it names output_dir",
        env="SLUICE_TORCH_PROFILER_DIR",
    )


@dataclass(frozen=True)
class DetokenizerSettings:
    common: CommonSettings = field(default_factory=CommonSettings)
    model: str | None = setting(None, "model folder holding the tokenizer")
    consumer: str | None = setting(
        None, "consumer name in the group (default host-pid)", env="SLUICE_DETOKENIZER_CONSUMER"
    )
    batch_size: int = setting(
        16, "step messages read per call", env="SLUICE_DETOKENIZER_BATCH_SIZE"
    )
    block_ms: int = setting(
        100, "longest wait for new entries per read", env="SLUICE_DETOKENIZER_BLOCK_MS"
    )


@dataclass(frozen=True)
class ServeSettings:
    """`sluice serve`: every service on one machine."""

    common: CommonSettings = field(default_factory=CommonSettings)
    model: str | None = setting(None, "model folder (default: a small generated model)")
    dp_size: int = setting(
        1,
        "workers, each a replica of the model (data parallelism, as SGLang's --dp-size; with "
        "--device cuda each gets its own GPU: the i-th of CUDA_VISIBLE_DEVICES, else GPU i)",
    )
    tokenizers: int = setting(1, "tokenizer processes")
    detokenizers: int = setting(1, "detokenizer processes")
    host: str = setting("127.0.0.1", "HTTP bind address")
    port: int = setting(30000, "HTTP port")
