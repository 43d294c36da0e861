"""Tool call parsers (services/tool_parsers.py, services/tool_call_objects.py) and the chat side
of tool calling (services/router_tools.py): formats, streaming == whole, held-back text, calls
streamed from their header, the tool modes."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from services.router_chat import ParserChoice, ToolFields, chat_template_of
from services.router_fields import ApiError
from services.router_tools import ChoiceTools, ToolMode
from services.tiny_tokenizer import CHATML_TEMPLATE
from services.tool_call_objects import CallDelta
from services.tool_parsers import (
    ALIASES,
    PARSERS,
    ToolCall,
    ToolCallStream,
    calls_of,
    canonical,
    infer_parser,
    parse,
)
from shared.settings import TOOL_CALL_PARSERS

CALL_F = ToolCall("f", '{"a": 1}')
CALL_G = ToolCall("g", "{}")
NO_NAME = '<tool_call>{"arguments": {}}</tool_call>'
LIST_ARGS = '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'
NO_NAME_CUT = '<tool_call>{"name": "", "arguments": {}}'
CALL_CUT = ToolCall("f", '{"a": [1, ')  # cut off in its arguments
CALL_BAD = ToolCall("f", '{"a": }')  # invalid after its header: still a call

CASES = [
    # hermes: content before, two calls, whitespace between dropped
    (
        "hermes",
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>{"name":"g","arguments":{}}</tool_call>',
        ("Sure.", [CALL_F, CALL_G]),
    ),
    ("hermes", "plain text, ends in spaces  \n", ("plain text, ends in spaces  \n", [])),
    ("hermes", "a < b <tool b", ("a < b <tool b", [])),  # a prefix of the tag, then not
    # a bad call is content, verbatim (whitespace before it too), and the text after it
    ("hermes", "x \n<tool_call>{bad}</tool_call> y", ("x \n<tool_call>{bad}</tool_call> y", [])),
    ("hermes", NO_NAME, (NO_NAME, [])),
    ("hermes", LIST_ARGS, (LIST_ARGS, [])),
    # unclosed at the end: a call once its header came (the arguments as far as they got),
    # else content
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}', ("", [CALL_F])),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": [1,', ("", [CALL_CUT])),
    ("hermes", '<tool_call>{"name": "f", "argu', ('<tool_call>{"name": "f", "argu', [])),
    ("hermes", NO_NAME_CUT, (NO_NAME_CUT, [])),
    # after its header, a call's arguments are what the model wrote, spaced as json.dumps does
    (
        "hermes",
        '<tool_call>{"name":"f","arguments":{ "s" :"} , \\\"{" ,"n":[1 ,{"x":null}]} }</tool_call>',
        ("", [ToolCall("f", '{"s": "} , \\\"{", "n": [1, {"x": null}]}')]),
    ),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>', ("", [CALL_BAD])),
    # keys in another order: a call when the object closes; text after a call is content
    ("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', ("", [CALL_F])),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}} oops</tool_call> x',
     ("oops x", [CALL_F])),
    # arguments written as a JSON text, "parameters" for "arguments"
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', ("", [CALL_F])),
    ("hermes", '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', ("", [CALL_F])),
    # llama3: the whole output, maybe after <|python_tag|>, ';'-separated
    (
        "llama3",
        ' <|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
        ("", [CALL_F, CALL_G]),
    ),
    ("llama3", '{"name": "f", "parameters": {"a": 1}}', ("", [CALL_F])),
    ("llama3", '{"name": "f", "parameters": {"a"', ("", [ToolCall("f", '{"a"')])),
    ("llama3", '{"name": "f"', ('{"name": "f"', [])),
    ("llama3", 'It is {"name": "f"}', ('It is {"name": "f"}', [])),  # not at the start
    ("llama3", "<|python", ("<|python", [])),
    # mistral: [TOOL_CALLS] and a JSON list
    (
        "mistral",
        'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g"}]',
        ("ok", [CALL_F, CALL_G]),
    ),
    ("mistral", "[TOOL_CALLS] nope", ("[TOOL_CALLS] nope", [])),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}] and so [TOOL_CALLS] on',
        ("and so [TOOL_CALLS] on", [CALL_F]),
    ),
]  # fmt: skip


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_whole_output(parser: str, text: str, expected: tuple[str, list[ToolCall]]) -> None:
    assert parse(parser, text) == expected


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_streamed_in_any_pieces_equals_whole(
    parser: str, text: str, expected: tuple[str, list[ToolCall]]
) -> None:
    """Whatever the split, the pieces of content join to the whole content, the call deltas
    join to the whole calls, and released content is never taken back (it is a prefix of the
    final)."""
    for seed in range(60):
        rng = random.Random(seed)
        stream, content, deltas, i = ToolCallStream(parser), "", [], 0
        while i < len(text):
            j = i + rng.randint(1, 6)
            piece, found = stream.feed(text[i:j])
            content, deltas, i = content + piece, deltas + found, j
            assert expected[0].startswith(content) or not expected[1], (seed, content)
            assert len({d.index for d in found}) == len(found)  # one delta per call per piece
        piece, found = stream.finish()
        assert (content + piece, calls_of(deltas + found)) == expected, seed


def test_a_call_streams_from_its_header_on() -> None:
    stream = ToolCallStream("hermes")
    assert stream.feed("Hi <tool_") == ("Hi", [])  # the tag's prefix and the space wait
    assert stream.feed('call>{"name": "f", "argum') == ("", [])  # no header yet
    assert stream.feed('ents": {"a"') == ("", [CallDelta(0, "f", '{"a"')])
    assert stream.feed(':1,\n "b": "x y') == ("", [CallDelta(0, None, ': 1, "b": "x y')])
    assert stream.feed('"}}</tool_') == ("", [CallDelta(0, None, '"}')])
    assert stream.feed("call> and") == ("and", [])  # whitespace after a call: dropped
    assert stream.feed(' <tool_call>{"name": "g", "arguments": {}}') == (
        "", [CallDelta(1, "g", "{}")])  # fmt: skip
    assert stream.finish() == ("", [])


def test_parser_names_inference_and_settings_agree() -> None:
    assert set(TOOL_CALL_PARSERS) == set(PARSERS) | set(ALIASES)
    assert canonical("qwen25") == "hermes" and canonical("llama3_json") == "llama3"
    with pytest.raises(ValueError, match="unknown tool call parser 'x'"):
        canonical("x")
    assert infer_parser(CHATML_TEMPLATE) == "hermes"
    assert infer_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert infer_parser("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert infer_parser('{% if tools %}{"name": .., "parameters": ..}{% endif %}') == "llama3"


def test_parser_choice_reads_the_template_of_a_model_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ApiError, match="--tool-call-parser"):
        ParserChoice(None).resolve([None, str(tmp_path)])
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": CHATML_TEMPLATE}]})
    )
    assert chat_template_of(str(tmp_path)) == CHATML_TEMPLATE
    assert ParserChoice(None).resolve([str(tmp_path)]) == "hermes"
    assert ParserChoice("mistral").resolve([str(tmp_path)]) == "mistral"  # the flag wins


TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
    {"type": "function", "function": {"name": "g"}},
]  # fmt: skip


def _fields(**kw: object) -> ToolFields:
    return ToolFields.model_validate({"tools": TOOLS, **kw})


def test_tool_choice_modes_and_their_grammars() -> None:
    params: dict = {}
    assert _fields().tool_params(params) == ToolMode("auto") and params == {}
    assert _fields(tool_choice="none").tool_params(params) is None
    assert ToolFields().tool_params(params) is None
    named = _fields(tool_choice={"type": "function", "function": {"name": "f"}})
    assert named.tool_params(params) == ToolMode("named", name="f")
    assert json.loads(params["json_schema"]) == TOOLS[0]["function"]["parameters"]
    for parallel, ok, bad in ((None, 2, 0), (False, 1, 2)):
        params = {}
        fields = _fields(tool_choice="required", parallel_tool_calls=parallel)
        assert fields.tool_params(params) == ToolMode("required")
        schema = json.loads(params["json_schema"])
        calls = [{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]
        jsonschema.validate(calls[:ok], schema)
        unknown, missing = {"name": "h", "parameters": {}}, {"name": "f", "parameters": {}}
        for wrong in (calls[:bad], [unknown], [missing]):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(wrong, schema)


@pytest.mark.parametrize(
    "kw, params, message",
    [
        ({"tools": None, "tool_choice": "auto"}, {}, "tool_choice needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "h"}}}, {}, "'h', which is not"),
        ({"tool_choice": "required"}, {"regex": "a"}, "cannot be combined"),
    ],
)
def test_tool_choice_errors(kw: dict, params: dict, message: str) -> None:
    with pytest.raises(ApiError, match=message):
        _fields(**kw).tool_params(params)


def test_choice_tools_per_mode() -> None:
    auto = ChoiceTools(ToolMode("auto", parser="hermes"))
    content, deltas = auto.step('x<tool_call>{"name": "g", "arguments": {}}</tool_call>', True)
    assert content == "x" and auto.called
    assert deltas == [{"index": 0, **auto.calls[0]}]
    assert auto.calls[0]["id"].startswith("call_") and auto.calls[0]["function"]["name"] == "g"
    named = ChoiceTools(ToolMode("named", name="f"))
    first = named.step('{"a"', False)[1][0]
    assert first["function"] == {"name": "f", "arguments": '{"a"'} and first["id"]
    assert named.step(": 1}", True) == ("", [{"index": 0, "function": {"arguments": ": 1}"}}])
    assert named.calls[0]["function"]["arguments"] == '{"a": 1}' and not named.called
    required = ChoiceTools(ToolMode("required"))
    assert required.step('[{"name": "f", "param', False) == ("", [])
    _, deltas = required.step('eters": {"a": "}]\\"{"', False)  # the header: f opens
    assert [(d["index"], d["function"]) for d in deltas] == [
        (0, {"name": "f", "arguments": '{"a": "}]\\"{"'})]  # fmt: skip
    _, deltas = required.step('}}, {"name": "g", "parameters": {}}]', True)
    assert [(d["index"], d["function"]) for d in deltas] == [
        (0, {"arguments": "}"}), (1, {"name": "g", "arguments": "{}"})]  # fmt: skip
    assert json.loads(required.calls[0]["function"]["arguments"]) == {"a": '}]"{'}
    assert required.called
    cut = ChoiceTools(ToolMode("required"))
    assert cut.step('[{"name": "f", "param', True) == ('[{"name": "f", "param', [])
    assert not cut.called
    cut = ChoiceTools(ToolMode("required"))  # cut after a header: the call keeps what came
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b'
    content, deltas = cut.step(text, True)
    assert content == "" and [d["function"]["arguments"] for d in deltas] == ['{"a": 1}', '{"b']
    cut = ChoiceTools(ToolMode("required"))  # cut before: the rest is text, verbatim
    content, deltas = cut.step('[{"name": "f", "parameters": {}}, {"name": "g"', True)
    assert content == '{"name": "g"' and [d["function"]["name"] for d in deltas] == ["f"]


def _joined(deltas: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) of each call that OpenAI deltas make."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], ["", ""])
        call[0] += d["function"].get("name", "")
        call[1] += d["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


def test_required_calls_are_the_same_however_the_text_is_split() -> None:
    text = ('[{"name": "f", "parameters": {"s": "a]}\\\\", "n": [1, {"x": "{"}]}},\n'
            ' {"name": "g", "parameters": {}}, {"name": "f", "parameters": {"s": "\\u00e9"}}]')
    whole = ChoiceTools(ToolMode("required")).step(text, True)
    assert whole[0] == "" and [json.loads(d["function"]["arguments"]) for d in whole[1]] == [
        {"s": "a]}\\", "n": [1, {"x": "{"}]}, {}, {"s": "é"}]  # fmt: skip
    rng = random.Random(7)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, 12)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        tools = ChoiceTools(ToolMode("required"))
        content, deltas = "", []
        for i, piece in enumerate(pieces):
            c, d = tools.step(piece, i == len(pieces) - 1)
            content, deltas = content + c, deltas + d
        assert content == "" and _joined(deltas) == _joined(whole[1])
        assert [c["function"] for c in tools.calls] == [d["function"] for d in whole[1]]


def _random_json(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -3, 17, 2.5, -1e-7])
    if kind in (2, 3, 4):
        return "".join(rng.choice('ab ,:{}[]"\\\n\té') for _ in range(rng.randrange(6)))
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": _random_json(rng, depth + 1) for i in range(rng.randrange(4))}


def test_streamed_arguments_are_what_json_dumps_writes_however_spaced_and_split() -> None:
    """The arguments a call streams join to `json.dumps` of what the model wrote, whatever its
    spacing (indent, separators) and however the text is split."""
    rng = random.Random(11)
    for _ in range(150):
        args = {f"a{i}": _random_json(rng) for i in range(rng.randrange(4))}
        written = json.dumps(
            {"name": "f", "arguments": args},
            indent=rng.choice([None, 0, 2]),
            separators=rng.choice([None, (",", ":"), (" , ", " : ")]),
            ensure_ascii=rng.random() < 0.5,
        )
        text = f"<tool_call>\n{written}\n</tool_call>"
        stream, deltas, i = ToolCallStream("hermes"), [], 0
        while i < len(text):
            j = i + rng.randint(1, 8)
            deltas += stream.feed(text[i:j])[1]
            i = j
        deltas += stream.finish()[1]
        (call,) = calls_of(deltas)
        assert json.loads(call.arguments) == args
        if "\\u" not in written:  # an escape the model wrote is kept as written
            assert call.arguments == json.dumps(args, ensure_ascii=False)
