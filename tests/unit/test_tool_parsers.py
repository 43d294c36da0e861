"""Tool call parsers (services/tool_parsers.py) and the chat side of tool calling
(services/router_tools.py): formats, streaming == whole, held-back text, the tool modes."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from services.router_chat import ParserChoice, ToolFields, chat_template_of
from services.router_fields import ApiError
from services.router_tools import ChoiceTools, ToolMode
from services.tiny_tokenizer import CHATML_TEMPLATE
from services.tool_parsers import (
    ALIASES,
    PARSERS,
    ToolCall,
    ToolCallStream,
    canonical,
    infer_parser,
    parse,
)
from shared.settings import TOOL_CALL_PARSERS

CALL_F = ToolCall("f", '{"a": 1}')
CALL_G = ToolCall("g", "{}")
NO_NAME = '<tool_call>{"arguments": {}}</tool_call>'
LIST_ARGS = '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'

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
    # unclosed at the end: a call if its JSON is complete, else content
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}', ("", [CALL_F])),
    ("hermes", '<tool_call>{"name": "f", "argu', ('<tool_call>{"name": "f", "argu', [])),
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
    ("llama3", '{"name": "f", "parameters": {"a"', ('{"name": "f", "parameters": {"a"', [])),
    ("llama3", 'It is {"name": "f"}', ('It is {"name": "f"}', [])),  # not at the start
    ("llama3", "<|python", ("<|python", [])),
    # mistral: [TOOL_CALLS] and a JSON list
    (
        "mistral",
        'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g"}]',
        ("ok", [CALL_F, CALL_G]),
    ),
    ("mistral", "[TOOL_CALLS] nope", ("[TOOL_CALLS] nope", [])),
]  # fmt: skip


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_whole_output(parser: str, text: str, expected: tuple[str, list[ToolCall]]) -> None:
    assert parse(parser, text) == expected


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_streamed_in_any_pieces_equals_whole(
    parser: str, text: str, expected: tuple[str, list[ToolCall]]
) -> None:
    """Whatever the split, the pieces of content join to the whole content, the calls come
    in order, and released content is never taken back (it is a prefix of the final)."""
    for seed in range(60):
        rng = random.Random(seed)
        stream, content, calls, i = ToolCallStream(parser), "", [], 0
        while i < len(text):
            j = i + rng.randint(1, 6)
            piece, found = stream.feed(text[i:j])
            content, calls, i = content + piece, calls + found, j
            assert expected[0].startswith(content) or not expected[1], (seed, content)
        piece, found = stream.finish()
        assert (content + piece, calls + found) == expected, seed


def test_calls_are_released_when_they_close_not_at_the_end() -> None:
    stream = ToolCallStream("hermes")
    assert stream.feed("Hi <tool_") == ("Hi", [])  # the tag's prefix and the space wait
    assert stream.feed('call>{"name": "f", "arguments": {"a": 1}}') == ("", [])
    assert stream.feed("</tool_call> and") == ("and", [CALL_F])  # whitespace after: dropped
    assert stream.feed(" more ") == (" more", [])
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
    assert required.step('[{"name": "f", "parameters": {"a": "}]\\"{"', False) == ("", [])
    _, deltas = required.step('}}, {"name": "g", "para', False)  # f is complete: it goes now
    assert [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
        (0, "f", '{"a": "}]\\"{"}')]  # fmt: skip
    _, deltas = required.step('meters": {}}]', True)
    assert [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
        (1, "g", "{}")]  # fmt: skip
    assert json.loads(required.calls[0]["function"]["arguments"]) == {"a": '}]"{'}
    cut = ChoiceTools(ToolMode("required"))
    assert cut.step('[{"name": "f", "param', True) == ('[{"name": "f", "param', [])
    assert not cut.called
    cut = ChoiceTools(ToolMode("required"))  # cut after a call: it stays; the rest is text
    content, deltas = cut.step('[{"name": "f", "parameters": {}}, {"name": "g"', True)
    assert content == ', {"name": "g"' and [d["function"]["name"] for d in deltas] == ["f"]


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
        assert content == "" and [(d["index"], d["function"]) for d in deltas] == [
            (d["index"], d["function"]) for d in whole[1]]  # fmt: skip
