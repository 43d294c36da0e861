"""Which grammar a request's sampling parameters ask for, and the checks that need no
vocabulary (no torch here: the tokenizer service and the router share them).

A request has at most one: a JSON schema (a JSON string; "$$ANY$$" for any JSON), a regular
expression, an EBNF grammar, or an xgrammar structural tag (a JSON string, `{"type":
"structural_tag", "format": {...}}`: text with tagged regions, each under its own format).
"""

from __future__ import annotations

import json
from typing import Any

# `json_schema` value meaning "any JSON" (SGLang's convention)
ANY_JSON = "$$ANY$$"
# The schema OpenAI's JSON mode (`response_format: {"type": "json_object"}`, vLLM's
# `structured_outputs.json_object`) is decoded with: a JSON object, as SGLang and vLLM do
JSON_OBJECT = '{"type": "object"}'
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


def grammar_spec(params: Any) -> tuple[str, str] | None:
    """(kind, text) of the grammar `params` ask for, or None."""
    for kind in GRAMMAR_KINDS:
        value = getattr(params, kind)
        if value is not None:
            return kind, value
    return None


def grammar_error(params: Any) -> tuple[str, str] | None:
    """(field, why) if the grammar fields cannot be right whatever the vocabulary: more than
    one set, an empty one, a json_schema that is no JSON object or a structural tag in
    neither form `structural_tag_json` takes."""
    given = [k for k in GRAMMAR_KINDS if getattr(params, k) is not None]
    if len(given) > 1:
        return given[1], f"only one of {', '.join(GRAMMAR_KINDS)} may be set, got {given}"
    if not given:
        return None
    kind = given[0]
    text = getattr(params, kind)
    if not text.strip():
        return kind, "must not be empty"
    if kind == "json_schema" and text != ANY_JSON:
        try:
            schema = json.loads(text)
        except ValueError as exc:
            return kind, f"is not valid JSON: {exc}"
        if not isinstance(schema, (dict, bool)):
            return kind, "must be a JSON object (a JSON schema)"
    if kind == "structural_tag":
        try:
            structural_tag_json(text)
        except ValueError as exc:
            return kind, str(exc)
    return None


def structural_tag_json(tag: Any) -> str:
    """A structural tag as xgrammar compiles it: `{"type": "structural_tag", "format": {...}}`
    (its format as given), or from the legacy form SGLang and vLLM also accept, `{"structures":
    [{"begin", "schema", "end"}, ...], "triggers": [...]}` (text until a trigger, then the
    structure whose `begin` it starts, its content under `schema`). ValueError if it is
    neither; the format itself is checked when it compiles."""
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as exc:
            raise ValueError(f"is not valid JSON: {exc}") from None
    if not isinstance(tag, dict):
        raise ValueError("must be a JSON object")
    if "format" in tag:
        return json.dumps({"type": "structural_tag", "format": tag["format"]})
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not triggers:
        raise ValueError('needs a "format", or "structures" and "triggers"')
    tags = []
    for s in structures:
        if not isinstance(s, dict) or not {"begin", "end"} <= s.keys():
            raise ValueError('each structure needs a "begin" and an "end" (and a "schema")')
        schema = s.get("schema", True)
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"a structure's schema is not valid JSON: {exc}") from None
        content = {"type": "json_schema", "json_schema": schema}
        tags.append({"type": "tag", "begin": s["begin"], "content": content, "end": s["end"]})
    fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    return json.dumps({"type": "structural_tag", "format": fmt})
