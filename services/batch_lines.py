"""A batch's input lines and output lines (services/batches.py), and the in-process call that
serves one line: the router's own HTTP app, called through ASGI without a socket, so a line is
answered exactly as the same request sent over HTTP would be.

An input line is `{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body"}`
(OpenAI's format); its output line `{"id": "batch_req_...", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}`, or, for a line never answered (the
batch was cancelled or expired first), `"response": null` and `"error": {"code", "message"}`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
             "/v1/score", "/v1/rerank")  # fmt: skip
MAX_ERRORS = 1000  # validation errors reported for one file
MAX_CUSTOM_ID = 512


@dataclass
class Line:
    custom_id: str
    body: dict[str, Any]


def parse_input(content: bytes, endpoint: str, max_requests: int) -> tuple[list[Line], list]:
    """The requests of a batch's input file, and its validation errors (OpenAI's `errors.data`
    items: `code`, `message`, `param`, `line` numbered from 1); any error fails the batch."""
    lines: list[Line] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()

    def error(code: str, message: str, number: int | None, param: str | None = None) -> None:
        if len(errors) < MAX_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": number})

    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        error("invalid_json_line", f"the file is not UTF-8: {exc}", None)
        return [], errors
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except ValueError as exc:
            error("invalid_json_line", f"line {number} is not JSON: {exc}", number)
            continue
        if not isinstance(item, dict):
            error("invalid_request", f"line {number} is not a JSON object", number)
            continue
        custom_id, url, body = item.get("custom_id"), item.get("url"), item.get("body")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
            error("invalid_request", f"line {number}: custom_id must be a string of 1 to "
                  f"{MAX_CUSTOM_ID} characters", number, "custom_id")  # fmt: skip
        elif custom_id in seen:
            error("duplicate_custom_id", f"line {number}: custom_id {custom_id!r} is on an "
                  "earlier line too", number, "custom_id")  # fmt: skip
        elif item.get("method") != "POST":
            error("invalid_request", f"line {number}: method must be 'POST'", number, "method")
        elif url != endpoint:
            error("mismatched_url", f"line {number}: url {url!r} is not the batch's endpoint "
                  f"{endpoint!r}", number, "url")  # fmt: skip
        elif not isinstance(body, dict):
            error("invalid_request", f"line {number}: body must be a JSON object", number, "body")
        else:
            seen.add(custom_id)
            lines.append(Line(custom_id, body))
    if not lines and not errors:
        error("empty_file", "the input file has no requests", None)
    elif len(lines) > max_requests:
        error("too_many_requests", f"the input file has {len(lines)} requests; a batch takes "
              f"at most {max_requests}", None)  # fmt: skip
    return lines, errors


def output_line(custom_id: str, status: int, request_id: str, body: Any) -> dict[str, Any]:
    response = {"status_code": status, "request_id": request_id, "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
            "error": None}  # fmt: skip


def unanswered_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}  # fmt: skip


def refused(line: Line) -> dict[str, Any] | None:
    """The output line of a request a batch does not send (a stream or a background response:
    a batch's answer is one body), or None."""
    for param in ("stream", "background"):
        if line.body.get(param):
            err = {"message": f"{param} is not supported in a batch", "type":
                   "invalid_request_error", "param": param, "code": "invalid_value"}  # fmt: skip
            return output_line(line.custom_id, 400, f"req_{uuid.uuid4().hex}", {"error": err})
    return None


@dataclass
class Usage:
    """A batch's token counts (OpenAI's batch `usage`), summed over its answered requests."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    def add(self, body: Any) -> None:
        usage = body.get("usage") if isinstance(body, dict) else None
        if not isinstance(usage, dict):
            return
        chat = "prompt_tokens" in usage  # chat, completions, embeddings; else Responses'
        self.input_tokens += _int(usage.get("prompt_tokens" if chat else "input_tokens"))
        self.output_tokens += _int(usage.get("completion_tokens" if chat else "output_tokens"))
        inputs = usage.get("prompt_tokens_details" if chat else "input_tokens_details")
        outputs = usage.get("completion_tokens_details" if chat else "output_tokens_details")
        if isinstance(inputs, dict):
            self.cached_tokens += _int(inputs.get("cached_tokens"))
        if isinstance(outputs, dict):
            self.reasoning_tokens += _int(outputs.get("reasoning_tokens"))

    def as_dict(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.input_tokens + self.output_tokens}  # fmt: skip


def _int(v: Any) -> int:
    return v if type(v) is int else 0


@dataclass
class Answer:
    status: int = 500
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)


async def call_app(app: Any, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> Answer:
    """POST `body` to `path` on the ASGI `app` in this process; its answer. The caller never
    disconnects; cancelling the call cancels the handler (which aborts its requests)."""
    answer, sent_body = Answer(), False
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode()), *headers],
             "client": ("127.0.0.1", 0), "server": ("batch", 0)}  # fmt: skip

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect: the call is cancelled instead
        raise AssertionError("unreachable")

    started = False

    async def send(message: dict[str, Any]) -> None:
        nonlocal started
        if message["type"] == "http.response.start":
            started = True
            answer.status = message["status"]
            answer.headers = {k.decode().lower(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")

    try:
        await app(scope, receive, send)
    except Exception as exc:  # Starlette answers a 500 and raises the handler's error again
        if not started:
            answer.status = 500
            err = {"message": f"internal error: {exc!r}", "type": "server_error", "param": None,
                   "code": None}  # fmt: skip
            answer.body = bytearray(json.dumps({"error": err}).encode())
    return answer
