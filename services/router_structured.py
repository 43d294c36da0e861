"""Structured output requests of the OpenAI endpoints, as the engine's grammar parameters.

The engine takes SGLang's sampling parameters `json_schema` (a JSON string; "$$ANY$$" for any
JSON), `regex` and `ebnf` (engine/sampling/grammar.py). The OpenAI endpoints accept them as

    response_format  {"type": "text"} | {"type": "json_object"}
                     | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    regex, ebnf      SGLang's extra fields
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's extra fields

at most one of them per request. `guided_choice` (a list of strings) becomes an EBNF grammar
whose alternatives are those strings. What the router cannot check without the tokenizer
(whether a regex or grammar compiles) comes back from the worker as a 400.
"""

from __future__ import annotations

import json
from typing import Any

from engine.sampling.sampling_params import ANY_JSON

FIELDS = ("response_format", "regex", "ebnf", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar")  # fmt: skip


class StructuredOutputError(ValueError):
    """A structured output field that is wrong: `param` names it (a 400 for the client)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def grammar_params(request: Any) -> dict[str, str]:
    """The one grammar parameter `request`'s structured output fields ask for ({} if none)."""
    given = {name: getattr(request, name) for name in FIELDS if getattr(request, name) is not None}
    fmt = given.get("response_format")
    if fmt is not None and fmt.get("type", "text") == "text":
        del given["response_format"]  # plain text: no constraint
    if len(given) > 1:
        names = ", ".join(given)
        raise StructuredOutputError(
            f"only one structured output option may be set, got {names}", list(given)[1]
        )
    if not given:
        return {}
    (name, value), = given.items()
    if name == "response_format":
        return {"json_schema": _response_format_schema(value)}
    if name in ("regex", "guided_regex"):
        return {"regex": value}
    if name in ("ebnf", "guided_grammar"):
        return {"ebnf": value}
    if name == "guided_json":
        return {"json_schema": value if isinstance(value, str) else json.dumps(value)}
    return {"ebnf": _choice_grammar(value)}


def _response_format_schema(fmt: dict[str, Any]) -> str:
    kind = fmt.get("type")
    if kind == "json_object":
        return ANY_JSON
    if kind != "json_schema":
        raise StructuredOutputError(
            f"response_format type must be text, json_object or json_schema, got {kind!r}",
            "response_format",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise StructuredOutputError(
            "response_format json_schema must be an object with a schema", "response_format"
        )
    schema = spec.get("schema", spec.get("schema_"))  # (pydantic's alias in some clients)
    if schema is None:
        return ANY_JSON
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputError(
            "response_format json_schema.schema must be a JSON schema object", "response_format"
        )
    return json.dumps(schema)


def _choice_grammar(choices: list[str]) -> str:
    if not choices or not all(choices):
        raise StructuredOutputError(
            "guided_choice must be a non-empty list of non-empty strings", "guided_choice"
        )
    # EBNF string literals take JSON's escapes
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
