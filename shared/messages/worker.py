"""Messages bound for a worker (stream `{p}:worker:{w}:in`, a consumer group of one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.messages.base import Message
from shared.messages.schema import MessageError


@dataclass(frozen=True, slots=True)
class GenerateReqMsg(Message):
    """tokenizer → worker: a tokenized request, ready to schedule.

    `sampling_params` is the SGLang-style dict as the client sent it (the engine resolves
    defaults). `stop` holds the stop strings, which the worker matches to stop early; the
    router trims them from the text. The two detokenizer flags are not used by the worker:
    it copies them into every `StepOutputMsg` row of this request, because detokenizers
    keep no per-request state. `created` is the router's arrival time, kept for latency
    metrics.
    """

    TAG = "generate_req"
    # 4: priority; 5: return_prompt_ids; 6: lora_name; 7: embed; 8: token_type_ids;
    # 9: cache_salt
    VERSION = 9

    rid: str
    router_id: str
    input_ids: list[int]
    sampling_params: dict[str, Any] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # with return_logprob: prompt logprobs from there (-1: none)
    created: float = 0.0
    return_prompt_ranks: bool = False  # the prompt logprobs' ranks too (vLLM's)
    priority: int | None = None  # with the worker's priority scheduling (SGLang's)
    return_prompt_ids: bool = False  # `input_ids` go back in the request's first step row
    lora_name: str | None = None  # the LoRA adapter to run with (None: the base model)
    embed: bool = False  # pool the prompt into an embedding (an embedding worker's requests)
    # a text pair's token types as its tokenizer gives them (BERT's second text: 1), one per
    # input id; None: all 0 (an encoder model reads them, a decoder ignores them)
    token_type_ids: list[int] | None = None
    # shares cached prefixes only with requests of the same salt (vLLM's cache_salt)
    cache_salt: str | None = None

    def _check(self) -> None:
        if not self.input_ids:
            raise MessageError(f"GenerateReqMsg {self.rid}: input_ids is empty")
        if self.cache_salt == "":
            raise MessageError(f"GenerateReqMsg {self.rid}: cache_salt is empty")
        if self.token_type_ids is not None and len(self.token_type_ids) != len(self.input_ids):
            raise MessageError(
                f"GenerateReqMsg {self.rid}: token_type_ids and input_ids differ in length"
            )
        if self.top_logprobs_num < 0:
            raise MessageError(f"GenerateReqMsg {self.rid}: top_logprobs_num must be >= 0")
        if self.logprob_start_len < -1:
            raise MessageError(f"GenerateReqMsg {self.rid}: logprob_start_len must be >= -1")


@dataclass(frozen=True, slots=True)
class AbortReqMsg(Message):
    """router → worker: stop request `rid` (client gone, timeout).

    The worker ends the request with finish reason `abort` in its next step message. An
    abort can overtake its request (the request goes through a tokenizer, the abort comes
    straight from the router), so a worker should remember recently aborted unknown rids
    and drop the request when it arrives.
    """

    TAG = "abort_req"
    VERSION = 1

    rid: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class FlushCacheReqMsg(Message):
    """router → worker: empty the prefix cache (SGLang's `POST /flush_cache`).

    The worker flushes only when it has no running or waiting request, and answers with a
    `FlushCacheRespMsg` carrying `request_id` on the router's stream either way.
    """

    TAG = "flush_cache_req"
    VERSION = 1

    request_id: str
    router_id: str


PROFILE_ACTIVITIES = ("CPU", "GPU", "MEM")  # what a ProfileReqMsg's `activities` may name


@dataclass(frozen=True, slots=True)
class ProfileReqMsg(Message):
    """router → worker: start or stop the torch profiler around the scheduler's steps
    (SGLang's `POST /start_profile` and `/stop_profile`; services/worker_profile.py).

    `action` is "start" or "stop"; the other fields are the start's: the folder the trace goes
    to ("": the worker's `--profile-dir`), the steps after which it stops by itself (0: at the
    stop), the activities ("CPU", "GPU", "MEM"), and a name for the trace file. The worker
    answers with a `ProfileRespMsg` carrying `request_id`.
    """

    TAG = "profile_req"
    VERSION = 1

    request_id: str
    router_id: str
    action: str
    output_dir: str = ""
    num_steps: int = 0
    activities: list[str] = field(default_factory=list)
    with_stack: bool = False
    record_shapes: bool = False
    profile_id: str = ""


LORA_ACTIONS = ("load", "unload")  # what a LoraReqMsg's `action` may be


@dataclass(frozen=True, slots=True)
class LoraReqMsg(Message):
    """router → worker: load a LoRA adapter into the running worker, or unload one (vLLM's
    `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`, SGLang's `/load_lora_adapter`
    and `/unload_lora_adapter`; engine/scheduler/model_updates.py).

    `action` is "load" (the PEFT folder `lora_path` on the worker's machine, served as
    `lora_name`; `replace`: a loaded adapter of that name is replaced, vLLM's `load_inplace`)
    or "unload". The worker answers with a `LoraRespMsg` carrying `request_id`.
    """

    TAG = "lora_req"
    VERSION = 1

    request_id: str
    router_id: str
    action: str
    lora_name: str
    lora_path: str = ""
    replace: bool = False


@dataclass(frozen=True, slots=True)
class UpdateWeightsReqMsg(Message):
    """router → worker: serve the weights of the checkpoint `model_path` (on the worker's
    machine; the same model's) from now on (SGLang's `POST /update_weights_from_disk`;
    engine/weight_update.py). The worker holds new requests back, lets the running ones
    finish (or aborts them first with `abort_all_requests`), updates, empties its prefix
    cache and answers with an `UpdateWeightsRespMsg` carrying `request_id`.
    """

    TAG = "update_weights_req"
    VERSION = 1

    request_id: str
    router_id: str
    model_path: str
    abort_all_requests: bool = False


# How a PauseReqMsg pauses: "abort" (SGLang's and vLLM's default) ends every request now;
# "wait" (vLLM's) lets the running and waiting ones finish first, holding new ones back;
# "keep" (vLLM's; SGLang's "in_place") leaves the running ones where they are, with their
# K/V; "retract" (SGLang's) sends them back to waiting, their K/V into the prefix cache.
PAUSE_MODES = ("abort", "wait", "keep", "retract")


@dataclass(frozen=True, slots=True)
class PauseReqMsg(Message):
    """router → worker: stop stepping, or step again (SGLang's `POST /pause_generation` and
    `/continue_generation`, vLLM's `POST /pause` and `/resume`; services/worker.py).

    `action` is "pause" or "resume"; a pause's `mode` is one of `PAUSE_MODES`, and
    `clear_cache` empties the prefix cache once no request holds K/V (not in mode "keep").
    A paused worker takes new requests into its waiting queue and runs none until resumed;
    it answers with a `PauseRespMsg` carrying `request_id` (for mode "wait", once its
    requests have ended)."""

    TAG = "pause_req"
    VERSION = 1

    request_id: str
    router_id: str
    action: str
    mode: str = "abort"
    clear_cache: bool = False

    def _check(self) -> None:
        if self.action not in ("pause", "resume"):
            raise MessageError(f"PauseReqMsg: unknown action {self.action!r}")
        if self.mode not in PAUSE_MODES:
            raise MessageError(f"PauseReqMsg: unknown mode {self.mode!r}")


# What a MemoryReqMsg releases (engine/memory_occupation.py's MEMORY_TAGS, which the engine
# keeps without importing this package)
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


@dataclass(frozen=True, slots=True)
class MemoryReqMsg(Message):
    """router → worker: give back the device memory of `tags` while idle, or take it again
    (SGLang's `POST /release_memory_occupation` and `/resume_memory_occupation`, vLLM's
    `POST /sleep` and `/wake_up`; engine/memory_occupation.py).

    `action` is "release" or "resume"; `tags` are of `MEMORY_TAGS` (empty: all). A release's
    `backup_weights` copies the weights to host memory first (None: the worker's
    `--enable-weights-cpu-backup`); it is refused while a request holds K/V. A worker with
    weights or K/V released takes new requests into its waiting queue and runs none until
    they are back; it answers with a `MemoryRespMsg` carrying `request_id`."""

    TAG = "memory_req"
    VERSION = 1

    request_id: str
    router_id: str
    action: str
    tags: list[str] = field(default_factory=list)
    backup_weights: bool | None = None

    def _check(self) -> None:
        if self.action not in ("release", "resume"):
            raise MessageError(f"MemoryReqMsg: unknown action {self.action!r}")
        for tag in self.tags:
            if tag not in MEMORY_TAGS:
                raise MessageError(f"MemoryReqMsg: unknown tag {tag!r}")


# dtype names of the weights a trainer broadcasts (engine/weight_groups.py's WEIGHT_DTYPES,
# which the engine keeps without importing this package); "torch." before one is accepted
WEIGHT_DTYPES = (
    "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "int8",
    "uint8", "int16", "int32", "int64", "bool",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class WeightsGroupReqMsg(Message):
    """router → worker: join an RL trainer's process group (`action` "init"; SGLang's `POST
    /init_weights_update_group`: the trainer is rank 0 and serves the rendezvous at
    `master_address:master_port`, this worker is rank `ranks[worker_id]` of `world_size`,
    over `backend`, within `timeout_s`) or leave it ("destroy"; engine/weight_groups.py).
    Answered with an `UpdateWeightsRespMsg` carrying `request_id`."""

    TAG = "weights_group_req"
    VERSION = 1

    request_id: str
    router_id: str
    action: str
    group_name: str
    master_address: str = ""
    master_port: int = 0
    ranks: dict[str, int] = field(default_factory=dict)
    world_size: int = 0
    backend: str = "nccl"
    timeout_s: float = 300.0

    def _check(self) -> None:
        if self.action not in ("init", "destroy"):
            raise MessageError(f"WeightsGroupReqMsg: unknown action {self.action!r}")


@dataclass(frozen=True, slots=True)
class DistributedWeightsReqMsg(Message):
    """router → worker: receive the tensors the trainer broadcasts in group `group_name`
    (one per name, in order, of `dtypes` and `shapes`) into the weights (SGLang's `POST
    /update_weights_from_distributed`). Like an `UpdateWeightsReqMsg`, the worker holds new
    requests back and lets the running ones finish first (or aborts them with
    `abort_all_requests`); a refused bucket is received all the same (the trainer's broadcast
    must end). `load_format` "flattened_bucket" (SGLang's): the bucket comes as one uint8
    tensor of the tensors' bytes end to end. Answered with an `UpdateWeightsRespMsg` carrying
    `request_id`."""

    TAG = "distributed_weights_req"
    VERSION = 1

    request_id: str
    router_id: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    flush_cache: bool = True
    abort_all_requests: bool = False
    load_format: str = ""

    def _check(self) -> None:
        if self.load_format not in ("", "flattened_bucket"):
            raise MessageError(f"DistributedWeightsReqMsg: unknown load_format "
                               f"{self.load_format!r}")  # fmt: skip
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise MessageError(f"DistributedWeightsReqMsg: {len(self.names)} names, "
                               f"{len(self.dtypes)} dtypes, {len(self.shapes)} shapes")  # fmt: skip
        for dtype in self.dtypes:
            if dtype.removeprefix("torch.") not in WEIGHT_DTYPES:
                raise MessageError(f"DistributedWeightsReqMsg: unknown dtype {dtype!r}")
        for shape in self.shapes:
            if any(not isinstance(d, int) or d < 0 for d in shape):
                raise MessageError(f"DistributedWeightsReqMsg: bad shape {shape!r}")


@dataclass(frozen=True, slots=True)
class WeightsReadReqMsg(Message):
    """router → worker: the first `truncate_size` served values of the checkpoint tensor (or
    parameter) `name`, flattened (SGLang's `/get_weights_by_name`; engine/weight_read.py).
    Answered with a `WeightsReadRespMsg` carrying `request_id`."""

    TAG = "weights_read_req"
    VERSION = 1

    request_id: str
    router_id: str
    name: str
    truncate_size: int = 100

    def _check(self) -> None:
        if self.truncate_size < 0:
            raise MessageError(f"WeightsReadReqMsg: truncate_size {self.truncate_size} < 0")
