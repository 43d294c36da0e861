"""Message round trips and validation: every type, every kind of malformed input."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest

from shared.messages import (
    AbortNamedMsg,
    AbortNamedRespMsg,
    AbortReqMsg,
    ChatMessage,
    DetokOutputMsg,
    DetokRow,
    DistributedWeightsReqMsg,
    ErrorMsg,
    FinishReason,
    FlushCacheReqMsg,
    FlushCacheRespMsg,
    GenerateReqMsg,
    LoraReqMsg,
    LoraRespMsg,
    MemoryReqMsg,
    MemoryRespMsg,
    Message,
    MessageError,
    PauseReqMsg,
    PauseRespMsg,
    ProfileReqMsg,
    ProfileRespMsg,
    PromptLogprobs,
    ServiceStatusMsg,
    StepOutputMsg,
    StepRow,
    TokenizeReqMsg,
    TokenizeRespMsg,
    UpdateWeightsReqMsg,
    UpdateWeightsRespMsg,
    WeightsGroupReqMsg,
    WeightsReadReqMsg,
    WeightsReadRespMsg,
    WorkerLoadMsg,
    decode_message,
    message_types,
)


def step_rows() -> list[StepRow]:
    return [
        StepRow("r0", "router-a", 0, [11], [], None, 7, 1, 0),
        StepRow("r1", "router-b", 9, [12, 13], [1, 2, 3], None, 5, 11, 4, False, False),
        StepRow(
            "r2", "router-a", 3, [2], [4, 5, 6], FinishReason("stop", 2), 8, 4, 8,
            token_logprobs=[-0.5], top_logprobs_ids=[[2, 9]], top_logprobs_vals=[[-0.5, -1.0]],
        ),
        StepRow("r3", "router-a", 1, [], [7], FinishReason("abort", message="gone"), 3, 1, 0),
        StepRow(
            "r4", "router-b", 0, [], [], FinishReason("length"), 3, 0, 0,
            prompt_logprobs=PromptLogprobs(0, [1, 2, 3], [-1.5, -2.0], [[5], [6]], [[-0.5], [-1]]),
            prompt_ids=[1, 2, 3],
        ),
        StepRow("r5", "router-a", 0, [], [], FinishReason("length"), 4, 0, 0,
                embedding=b"\x00\x00\x80\x3f" * 3),
    ]  # fmt: skip


def detok_rows() -> list[DetokRow]:
    return [
        DetokRow("r0", 0, 1, "Hi", [11], None, 7, 1, 0),
        DetokRow("r2", 3, 4, "", [2], FinishReason("length"), 8, 4, 8, [-0.25], [[2]], [[-0.25]]),
        DetokRow(
            "r3", 0, 1, "a", [4], None, 9, 1, 0,
            prompt_logprobs=PromptLogprobs(7, [8, 9], [-0.5, -0.75]),
            prompt_ids=[1, 8, 9],
        ),
        DetokRow("r5", 0, 0, "", [], FinishReason("length"), 4, 0, 0, embedding=b"\x01\x02"),
    ]  # fmt: skip


SAMPLES: list[Message] = [
    TokenizeReqMsg("r0", "router-a", "w0", text="Hello", created=1.5),
    TokenizeReqMsg(
        "r1", "router-a", "w1",
        messages=[ChatMessage("system", "be brief"), ChatMessage("user", "hi ✓")],
        sampling_params={"max_new_tokens": 8, "temperature": 0.7, "stop": ["\n"],
                         "logit_bias": {"5": -1.0}, "seed": None},
        stream=True, return_logprob=True, top_logprobs_num=3, created=2.0,
    ),
    TokenizeReqMsg("r2", "router-b", "w0", input_ids=[1, 2, 3]),
    GenerateReqMsg("r0", "router-a", [1, 2, 3], {"max_new_tokens": 4}, ["stop"], False, True),
    GenerateReqMsg("r1", "router-a", [5], stream=True, return_logprob=True, top_logprobs_num=2),
    AbortReqMsg("r0"),
    AbortReqMsg("r1", reason="client disconnected"),
    StepOutputMsg.from_rows(step_rows(), worker_id="w0", step=41),
    StepOutputMsg.from_rows([], worker_id="w0", step=0),
    DetokOutputMsg.from_rows(detok_rows(), router_id="router-a", worker_id="w0", step=41),
    ErrorMsg("r0", "router-a", "prompt_too_long", "prompt has 9000 tokens; limit 8192", 400,
             "tokenizer:host-1"),
    WorkerLoadMsg("w0", "tiny", 3, 1, 100, 20, 4096, 64, 2048, 0.02, 55.5, "host", 123, 9.0),
    FlushCacheReqMsg("flush-1", "router-a"),
    FlushCacheRespMsg("flush-1", "router-a", "w0", False, "2 requests running"),
    ProfileReqMsg("prof-1", "router-a", "start", "/tmp/p", 5, ["CPU", "GPU"], True, False, "p1"),
    ProfileReqMsg("prof-2", "router-a", "stop"),
    ProfileRespMsg("prof-2", "router-a", "w0", True, "written", ["/tmp/p/p1-worker-w0.json.gz"]),
    LoraReqMsg("lora-1", "router-a", "load", "sql", "/adapters/sql", True),
    LoraReqMsg("lora-2", "router-a", "unload", "sql"),
    LoraRespMsg("lora-1", "router-a", "w0", True, "", True, {"sql": "/adapters/sql"}),
    UpdateWeightsReqMsg("upd-1", "router-a", "/ckpt/step-200", True),
    UpdateWeightsRespMsg("upd-1", "router-a", "w0", True, "", 3, "/ckpt/step-200"),
    ServiceStatusMsg("detokenizer", "host-7", "host", 7, 1.0, 2.0, 5),
    TokenizeReqMsg(
        "r3", "router-b", "w0",
        messages=[
            ChatMessage("user", "weather?"),
            ChatMessage("assistant", "", tool_calls=[{"id": "c1", "type": "function",
                        "function": {"name": "f", "arguments": '{"a": 1}'}}]),
            ChatMessage("tool", "sunny", name="f", tool_call_id="c1"),
        ],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        chat_template_kwargs={"enable_thinking": False},
        add_generation_prompt=False,
        continue_final_message=True,
    ),
    TokenizeReqMsg("r4", "router-b", "", text="x", reply="tokenize", add_special_tokens=False,
                   return_token_strs=True),
    TokenizeRespMsg("r4", "router-b", [5, 6], token_strs=["▁a", "b"]),
    TokenizeRespMsg("r5", "router-b", [5, 6], text="ab"),
    AbortNamedMsg("ask-1", "router-a", "job-1", "aborted by /abort_request"),
    AbortNamedMsg("ask-2", "router-a", None, "aborted by /abort_request"),
    AbortNamedRespMsg("ask-1", "router-b", 2),
    TokenizeReqMsg("r6", "router-a", "w0", text="x", lora_name="sql", cache_salt="tenant-7"),
    GenerateReqMsg("r6", "router-a", [1, 2], lora_name="sql", cache_salt="tenant-7 ✓"),
    PauseReqMsg("pause-1", "router-a", "pause", "retract"),
    PauseReqMsg("pause-2", "router-a", "resume"),
    PauseRespMsg("pause-1", "router-a", "w0", True, "", 3),
    MemoryReqMsg("mem-1", "router-a", "release", ["weights", "kv_cache"], True),
    MemoryReqMsg("mem-2", "router-a", "resume"),
    MemoryRespMsg("mem-1", "router-a", "w0", True, "", ["kv_cache", "weights"], 1 << 20),
    WeightsGroupReqMsg("grp-1", "router-a", "init", "weight_update_group", "10.0.0.2", 29500,
                       {"w0": 1, "w1": 2}, 3, "nccl", 60.0),
    WeightsGroupReqMsg("grp-2", "router-a", "destroy", "weight_update_group"),
    DistributedWeightsReqMsg("upd-1", "router-a", ["model.norm.weight", "lm_head.weight"],
                             ["bfloat16", "torch.float32"], [[64], [512, 64]], "g", False, True,
                             "flattened_bucket"),
    WeightsReadReqMsg("read-1", "router-a", "model.norm.weight", 8),
    WeightsReadRespMsg("read-1", "router-a", "w0", True, "", [0.5, -1.25]),
    WeightsReadRespMsg("read-2", "router-a", "w0", False, "no weight named 'x'"),
]  # fmt: skip


def wire(msg: Message) -> dict:
    return msgpack.unpackb(msg.to_msg())


def pack(body: object) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def reason_of(data: bytes) -> str:
    with pytest.raises(MessageError) as info:
        decode_message(data)
    return info.value.reason


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    data = msg.to_msg()
    assert isinstance(data, bytes)
    decoded = decode_message(data)
    assert type(decoded) is type(msg)
    assert decoded == msg
    assert type(msg).from_msg(data) == msg


def test_every_registered_type_has_a_sample() -> None:
    assert set(message_types()) == {type(m).TAG for m in SAMPLES}


def test_columnar_rows_round_trip() -> None:
    step = decode_message(SAMPLES[7].to_msg())
    assert isinstance(step, StepOutputMsg)
    assert step.num_rows == 6
    assert step.rows() == step_rows()
    assert step.row(4).prompt_logprobs.token_logprobs() == [None, -1.5, -2.0]
    assert step.row(4).prompt_ids == [1, 2, 3] and step.row(0).prompt_ids is None
    assert step.row(5).embedding == b"\x00\x00\x80\x3f" * 3 and step.row(0).embedding is None
    assert step.row(2).finished and not step.row(1).finished
    assert step.row(2).finish_reason.to_dict() == {"type": "stop", "matched": 2}
    detok = decode_message(SAMPLES[9].to_msg())
    assert detok.rows() == detok_rows()


def test_from_msg_refuses_another_type() -> None:
    with pytest.raises(MessageError, match="expected a 'abort_req' message, got 'error'"):
        AbortReqMsg.from_msg(SAMPLES[10].to_msg())


def test_float_field_accepts_int_and_converts() -> None:
    body = wire(SAMPLES[0]) | {"created": 3}
    msg = decode_message(pack(body))
    assert msg.created == 3.0 and type(msg.created) is float


NO_TOOLS = {"name": None, "tool_calls": None, "tool_call_id": None}


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("rid", 5, "TokenizeReqMsg.rid: expected str, got int 5"),
        ("top_logprobs_num", "3", "TokenizeReqMsg.top_logprobs_num: expected int, got str"),
        ("top_logprobs_num", True, "expected int, got bool"),
        ("stream", 1, "TokenizeReqMsg.stream: expected bool, got int"),
        ("input_ids", [1, "2", 3], "TokenizeReqMsg.input_ids[1]: expected int, got str"),
        ("input_ids", [1, 2.0], "TokenizeReqMsg.input_ids[1]: expected int, got float"),
        ("input_ids", "123", "TokenizeReqMsg.input_ids: expected list, got str"),
        ("sampling_params", [1], "TokenizeReqMsg.sampling_params: expected map, got list"),
        ("sampling_params", {"a": {"b": b"x"}}, "sampling_params.a.b: expected plain data"),
        ("messages", [{"role": "user", **NO_TOOLS}],
         "TokenizeReqMsg.messages[0]: missing field(s) content"),
        ("messages", [{"role": "user", "content": 1, **NO_TOOLS}],
         "messages[0].content: expected str"),
        ("messages", [{"role": "user", "content": "x", **NO_TOOLS, "tool_calls": {}}],
         "messages[0].tool_calls: expected list"),
        ("tools", [[]], "TokenizeReqMsg.tools[0]: expected map"),
    ],
)  # fmt: skip
def test_wrong_field_type(field: str, value: object, expected: str) -> None:
    body = wire(SAMPLES[2]) | {field: value}
    if field == "messages":
        body["input_ids"] = None
    assert expected in reason_of(pack(body))


def test_wrong_types_inside_columns() -> None:
    body = wire(SAMPLES[7])
    body["window_ids"][1] = [1, None, 3]
    assert "StepOutputMsg.window_ids[1][1]: expected int, got NoneType" in reason_of(pack(body))
    body = wire(SAMPLES[7])
    body["finish_reasons"][2] = {"type": "done", "matched": None, "message": None}
    assert "finish_reasons[2].type: expected one of ['stop', 'length', 'abort']" in reason_of(
        pack(body)
    )


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda b: b.update(extra=1), "unknown field(s) 'extra'"),
        (lambda b: b.pop("router_id"), "missing field(s) router_id"),
        (lambda b: b.update(v=11), "tokenize_req: unsupported schema version 11 (speaks 12)"),
        (lambda b: b.pop("v"), "tokenize_req: unsupported schema version None"),
        (lambda b: b.update(v="2"), "unsupported schema version '2'"),
        (lambda b: b.update(t="summon_demon"), "unknown message tag 'summon_demon'"),
        (lambda b: b.pop("t"), "unknown message tag None"),
        (lambda b: b.update(text="both"), "exactly one of text, messages, input_ids"),
        (lambda b: b.update(input_ids=None), "exactly one of text, messages, input_ids"),
        (lambda b: b.update(top_logprobs_num=-1), "top_logprobs_num must be >= 0"),
        (lambda b: b.update(reply="summon"), "unknown reply 'summon'"),
        (lambda b: b.update(input_ids=None, text="t", reply="detokenize"),
         "detokenize needs input_ids"),
        (lambda b: b.update(cache_salt=""), "cache_salt is empty"),
        (lambda b: b.update(cache_salt=7), "cache_salt"),
    ],
)
def test_schema_violations(mutate, expected: str) -> None:
    body = wire(SAMPLES[2])
    mutate(body)
    assert expected in reason_of(pack(body))


def test_a_generate_request_with_an_empty_cache_salt_is_refused() -> None:
    body = wire(SAMPLES[4]) | {"cache_salt": ""}
    assert "GenerateReqMsg r1: cache_salt is empty" in reason_of(pack(body))


@pytest.mark.parametrize("field,value", [("action", "stop"), ("mode", "in_place")])
def test_a_pause_of_an_unknown_action_or_mode_is_refused(field: str, value: str) -> None:
    body = wire(PauseReqMsg("pause-1", "router-a", "pause", "keep")) | {field: value}
    assert f"PauseReqMsg: unknown {field} {value!r}" in reason_of(pack(body))


@pytest.mark.parametrize("field,value", [("action", "sleep"), ("tags", ["weights", "gpu"])])
def test_a_memory_request_of_an_unknown_action_or_tag_is_refused(field: str, value) -> None:
    body = wire(MemoryReqMsg("mem-1", "router-a", "release")) | {field: value}
    shown = value if field == "action" else "gpu"
    assert f"MemoryReqMsg: unknown {field.rstrip('s')} {shown!r}" in reason_of(pack(body))


@pytest.mark.parametrize("field,value,reason", [
    ("dtypes", ["float32", "complex64"], "unknown dtype 'complex64'"),
    ("shapes", [[64], [-1, 64]], "bad shape [-1, 64]"),
    ("names", ["x"], "1 names, 2 dtypes, 2 shapes"),
    ("load_format", "jit", "unknown load_format 'jit'"),
])  # fmt: skip
def test_a_distributed_update_with_bad_tensors_is_refused(field: str, value, reason) -> None:
    msg = DistributedWeightsReqMsg("u", "r", ["a", "b"], ["float32"] * 2, [[64], [2, 64]], "g")
    body = wire(msg) | {field: value}
    assert f"DistributedWeightsReqMsg: {reason}" in reason_of(pack(body))


def test_a_weights_group_request_of_an_unknown_action_is_refused() -> None:
    body = wire(WeightsGroupReqMsg("g-1", "router-a", "destroy", "g")) | {"action": "join"}
    assert "WeightsGroupReqMsg: unknown action 'join'" in reason_of(pack(body))


def test_the_weight_dtypes_are_the_engines() -> None:
    from engine.weight_groups import WEIGHT_DTYPES as ENGINE_DTYPES
    from shared.messages.worker import WEIGHT_DTYPES

    assert WEIGHT_DTYPES == ENGINE_DTYPES


def test_the_memory_tags_are_the_engines() -> None:
    from engine.memory_occupation import MEMORY_TAGS as ENGINE_TAGS
    from shared.messages.worker import MEMORY_TAGS

    assert MEMORY_TAGS == ENGINE_TAGS


def test_cross_field_checks_of_columnar_messages() -> None:
    body = wire(SAMPLES[7])
    body["starts"].pop()
    assert "StepOutputMsg.starts: column has 5 entries, expected 6" in reason_of(pack(body))
    body = wire(SAMPLES[7])
    body["embeddings"][5] = "not bytes"
    assert "embeddings[5]: expected bytes, got str" in reason_of(pack(body))
    body = wire(SAMPLES[7])
    body["prompt_logprobs"][4]["logprobs"].pop()  # from position 0: one per token but the first
    assert "PromptLogprobs: 1 logprobs for 3 token(s) from position 0" in reason_of(pack(body))
    body = wire(SAMPLES[7])
    body["prompt_logprobs"][4]["top_vals"] = None
    assert "top_ids and top_vals go together" in reason_of(pack(body))
    body = wire(SAMPLES[7])
    body["window_ids"][0] = [1]  # row 0 starts at 0: no output precedes it
    assert "rows[0]: start 0 with a window of 1" in reason_of(pack(body))
    body = wire(SAMPLES[7])
    body["token_logprobs"][2] = [-0.5, -0.1]
    assert "token_logprobs[2]: 2 entries for 1 new token(s)" in reason_of(pack(body))
    body = wire(SAMPLES[9])
    body["ends"][0] = 5
    assert "DetokOutputMsg.rows[0]: range [0, 5) with 1 token(s)" in reason_of(pack(body))
    body = wire(SAMPLES[9])
    body["finish_reasons"][1] = {"type": "length", "matched": 3, "message": None}
    assert "matched is only valid for 'stop'" in reason_of(pack(body))


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"", "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),
        (b"\x93\x01\x02", "not valid msgpack"),  # an array of 3 holding only 2 items
        (SAMPLES[7].to_msg()[:-5], "not valid msgpack"),  # truncated
        (SAMPLES[0].to_msg() + b"\x00", "not valid msgpack"),  # trailing bytes
        (b"hello world", "not valid msgpack"),
        (pack([1, 2, 3]), "expected a msgpack map, got list"),
        (pack({1: "x"}), "not valid msgpack"),  # non-str key
        (pack({"t": b"tokenize_req", "v": 1}), "unknown message tag b'tokenize_req'"),
        (b"\x81\xa1t\xc4\x02\xff\xfe", "unknown message tag"),
        (b"\x81\xa1t\xa2\xff\xfe", "not valid msgpack"),  # invalid utf-8 in a str
    ],
)
def test_garbage_bytes(data: bytes, expected: str) -> None:
    assert expected in reason_of(data)


def test_non_bytes_and_deep_nesting() -> None:
    assert "expected bytes, got str" in reason_of("not bytes")  # type: ignore[arg-type]
    nested: object = 1
    for _ in range(40):
        nested = [nested]
    body = wire(SAMPLES[2]) | {"sampling_params": {"x": nested}}
    assert "nested deeper than" in reason_of(pack(body))


def test_message_error_is_a_value_error_with_reason() -> None:
    err = MessageError("because")
    assert isinstance(err, ValueError) and err.reason == "because" and str(err) == "because"


def test_validate_catches_bad_instances_at_the_producer() -> None:
    SAMPLES[7].validate()
    bad = StepOutputMsg.from_rows(step_rows(), worker_id="w0", step="41")  # type: ignore[arg-type]
    with pytest.raises(MessageError, match="StepOutputMsg.step: expected int"):
        bad.validate()


def test_shared_never_imports_torch() -> None:
    code = (
        "import sys, shared.messages, shared.bus, shared.async_bus, shared.heartbeat, "
        "shared.settings, shared.redis_server, shared.logging; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
