"""Response bodies and SSE chunks of the three generation APIs, built from `Delta`s.

* `/v1/completions` and `/v1/chat/completions`: OpenAI's shapes (`text_completion`,
  `chat.completion`, their `.chunk` forms), `usage` with `prompt_tokens_details`, SGLang's
  `matched_stop` beside `finish_reason`.
* `/generate`: SGLang's `{text, output_ids, meta_info}`; when streamed, every chunk carries
  the text and ids so far (SGLang's default, what its `bench_serving` expects), or with
  `incremental` (SGLang's `--incremental-streaming-output`) only the new ones, and the
  logprobs of only the new tokens; `meta_info`'s counts are the whole output's either way.
  With `logprob_start_len`, the prompt's logprobs as `input_token_logprobs` (and
  `input_top_logprobs`). Every logprob entry is SGLang's `[logprob, token id, text]`, the
  text None unless `return_text_in_logprobs`; the prompt's first token's logprob is None.
* `echo` (`/v1/completions`): the prompt's text goes before the output's, in the response or
  the first chunk of each choice, and with `logprobs` so do the prompt tokens' logprobs. On
  chat (vLLM's), the last message's text goes before the content if it is the assistant's
  (with `continue_final_message`, the whole message).
* Chat with tools: the text goes through the choice's `ChoiceTools` (services/router_tools.py)
  and comes out as `content` and `tool_calls` (deltas of them when streamed).

A stream yields nothing before the first delta, so an error that comes before any output
(a prompt too long, no worker) still becomes a plain HTTP error; after that, an error is
sent as an SSE event `{"error": ...}` followed by `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from services.router_handle import RequestHandle, merged
from services.router_logprobs import (
    AS_TOKEN_IDS,
    TokenNames,
    generate_obj,
    openai_logprobs,
    ranked_prompt,
)
from services.router_protocol import ApiError
from services.router_stream import Choice, Delta, usage
from services.router_tools import ChatSplit, Part, ToolMode

DONE = b"data: [DONE]\n\n"
_MARK = "\x00text\x00"
_MARK_JSON = json.dumps(_MARK, ensure_ascii=False).encode()
_ARGUMENTS_DELTA = {"index", "function"}  # a call delta with only more arguments


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def collect(handles: list[RequestHandle]) -> list[Choice]:
    choices = {h.sub.index: Choice(h.sub.index, arrived=h.arrived) for h in handles}
    async for index, delta in merged(handles):
        choices[index].add(delta)
    for h in handles:
        choices[h.sub.index].rid = h.public_rid  # the last one, if the request was resent
    return [choices[i] for i in sorted(choices)]


class Formatter:
    """Builds one request's responses; `kind` is "completion", "chat" or "generate"."""

    def __init__(
        self,
        kind: str,
        rid: str,
        created: int,
        model: str,
        names: TokenNames,
        handles: list[RequestHandle],
        include_usage: bool = False,
        continuous_usage: bool = False,
        batch: bool = False,
        incremental: bool = False,
        tool_mode: ToolMode | None = None,
        reasoning_parser: str | None = None,
        weight_version: Callable[[], str] | None = None,
    ) -> None:
        self.kind, self.rid, self.created, self.model = kind, rid, created, model
        # /generate's meta_info.weight_version (SGLang's): the deployment's, as each output
        # goes out
        self.weight_version: Callable[[], str | None] = weight_version or (lambda: None)
        self.names, self.handles = names, handles
        self.include_usage, self.batch, self.incremental = include_usage, batch, incremental
        self.continuous_usage = continuous_usage  # vLLM's: every chunk says its choice's usage
        self.prompt_of = {h.sub.index: h.sub.prompt_index for h in handles}
        self.want_logprobs = handles[0].sub.return_logprob
        self.token_ids = handles[0].sub.return_token_ids  # vLLM's return_token_ids
        self.top_n = handles[0].sub.top_logprobs_num
        # the OpenAI logprobs' tokens: decoded, or vLLM's return_tokens_as_token_ids
        self.openai_names = AS_TOKEN_IDS if handles[0].sub.return_tokens_as_token_ids else names
        # SGLang's return_text_in_logprobs: /generate's logprob entries carry token texts
        self.logprob_names = names if handles[0].sub.return_text_in_logprobs else None
        self.echo = kind == "completion" and handles[0].sub.echo
        self.chat_echo = _chat_echo(handles[0].sub) if kind == "chat" else ""
        self.subs = {h.sub.index: h.sub for h in handles}
        self.tool_mode = tool_mode
        self.reasoning_parser = reasoning_parser if kind == "chat" else None
        self._templates: dict[tuple[int, int], list[bytes]] = {}  # (choice, call or -1)

    # -- whole responses ------------------------------------------------------------------------
    async def response(self) -> Any:
        choices = await collect(self.handles)
        if self.kind == "generate":
            want, names = self.want_logprobs, self.logprob_names
            version = self.weight_version()
            outs = [generate_obj(c, c.text, 0, want, self.top_n, names, version)
                    for c in choices]  # fmt: skip
            return outs if self.batch else outs[0]
        body = self._envelope("chat.completion" if self.kind == "chat" else "text_completion")
        body["choices"] = []
        by_index = {c.index: c for c in choices}
        for c in choices:
            c.split = self._new_split()
            part = self._split(c, c.text, final=True)
            lps, tops = c.token_logprobs, c.top_logprobs
            choice = self._choice(c, part, c.output_ids, lps, tops, final=True, echo=True)
            if c.split is not None and c.split.calls:
                choice["message"]["tool_calls"] = c.split.calls
            if self.token_ids:  # a chat's prompt ids in the body, a completion's per choice
                where = choice if self.kind == "completion" else body
                where.setdefault("prompt_token_ids", c.prompt_ids)
                choice["token_ids"] = c.output_ids
            sub = self.subs[c.index]
            if sub.prompt_logprobs is not None:  # vLLM's: a completion's per choice, a chat's
                # in the body; scored once per prompt
                scored = c if sub.prompt_scored_by is None else by_index[sub.prompt_scored_by]
                k, prompt = sub.prompt_logprobs, scored.prompt
                ranked = None if prompt is None else ranked_prompt(prompt, k, self.names)
                if self.kind == "completion":
                    choice["prompt_logprobs"] = ranked
                else:
                    body.setdefault("prompt_logprobs", ranked)
            body["choices"].append(choice)
        body["usage"] = usage(choices, self.prompt_of)
        return body

    # -- streams --------------------------------------------------------------------------------
    async def chunks(self) -> AsyncIterator[bytes]:
        choices = {h.sub.index: Choice(h.sub.index, rid=h.public_rid, arrived=h.arrived)
                   for h in self.handles}  # fmt: skip
        for choice in choices.values():
            choice.split = self._new_split()
        handles = {h.sub.index: h for h in self.handles}
        started = False
        try:
            async for index, delta in merged(self.handles):
                choice = choices[index]
                first = not choice.pieces
                choice.rid = handles[index].public_rid  # a request resent elsewhere has a new rid
                choice.add(delta)
                part = self._split(choice, delta.text, delta.finished)
                if self._says_nothing(delta, first, part):
                    continue  # tokens whose text is held back: no OpenAI chunk for them
                yield self._chunk(choice, delta, first, part)
                started = True
        except ApiError as err:
            if not started:
                raise
            yield sse(err.body())
            yield DONE
            return
        if self.include_usage and self.kind != "generate":
            body = self._envelope(self._chunk_object())
            body["choices"] = []
            body["usage"] = usage(list(choices.values()), self.prompt_of)
            yield sse(body)
        yield DONE

    def _new_split(self) -> ChatSplit | None:
        if self.tool_mode is None and self.reasoning_parser is None:
            return None
        return ChatSplit(self.tool_mode, self.reasoning_parser)

    @staticmethod
    def _split(c: Choice, text: str, final: bool) -> Part:
        """What `text`, the choice's next text, is: content, reasoning, tool call deltas."""
        return Part(text) if c.split is None else c.split.step(text, final)

    def _says_nothing(self, d: Delta, first: bool, part: Part) -> bool:
        if self.kind == "generate" or d.finished or self.want_logprobs:
            return False
        if self.token_ids and (d.output_ids or first):
            return False  # every id goes out
        if part.content or part.reasoning or part.calls:
            return False
        if first and self.echo:
            return False  # the echoed prompt
        return not (first and self.kind == "chat")  # the first chat chunk names the role

    def _chunk(self, c: Choice, d: Delta, first: bool, part: Part | None = None) -> bytes:
        """The SSE chunk of delta `d`, whose text is `part` (all content if not given)."""
        part = Part(d.text) if part is None else part
        if self.kind == "generate":
            # (incremental: the new tokens alone; else everything so far)
            start = len(c.output_ids) - len(d.output_ids) if self.incremental else 0
            text = d.text if self.incremental else c.text
            obj = generate_obj(c, text, start, self.want_logprobs, self.top_n, self.logprob_names,
                               self.weight_version())  # fmt: skip
            if self.batch:
                obj["index"] = c.index
            return sse(obj)
        fast = not (first or d.finished or self.want_logprobs or self.continuous_usage
                    or self.token_ids)  # fmt: skip
        if fast and not part.reasoning:
            if not part.calls:
                return self._text_chunk(c.index, part.content)
            call = part.calls[0] if len(part.calls) == 1 and not part.content else None
            if call is not None and call.keys() == _ARGUMENTS_DELTA and len(call["function"]) == 1:
                return self._text_chunk(c.index, call["function"]["arguments"], call["index"])
        return self._full_chunk(c, d, first, part)

    def _text_chunk(self, index: int, text: str, call: int = -1) -> bytes:
        """A middle chunk that carries only text (most of them), or only a piece of a call's
        arguments: `_full_chunk`'s bytes for a marker text, rendered once per choice (and call),
        with the real text spliced in."""
        parts = self._templates.get((index, call))
        if parts is None:
            if call < 0:
                marked = self._full_chunk(Choice(index), Delta(text=_MARK), first=False)
            else:
                piece = {"index": call, "function": {"arguments": _MARK}}
                marked = self._full_chunk(Choice(index), Delta(), False, Part("", calls=[piece]))
            parts = self._templates[(index, call)] = marked.split(_MARK_JSON)
        return parts[0] + json.dumps(text, ensure_ascii=False).encode() + parts[1]

    def _full_chunk(self, c: Choice, d: Delta, first: bool, part: Part | None = None) -> bytes:
        part = Part(d.text) if part is None else part
        body = self._envelope(self._chunk_object())
        lps, tops = d.token_logprobs or [], d.top_logprobs or []
        choice = self._choice(c, part, d.output_ids, lps, tops, final=d.finished, echo=first)
        if self.kind == "chat":
            message = choice.pop("message")
            delta = choice["delta"] = message if first else {"content": message["content"]}
            if part.reasoning or part.calls:
                delta["content"] = delta["content"] or None
            if part.reasoning:
                delta["reasoning_content"] = part.reasoning
            if part.calls:
                delta["tool_calls"] = part.calls
        body["choices"] = [choice]
        if self.token_ids:
            if first:
                (choice if self.kind == "completion" else body)["prompt_token_ids"] = c.prompt_ids
            choice["token_ids"] = d.output_ids
        if self.continuous_usage:
            body["usage"] = {"prompt_tokens": c.prompt_tokens,
                             "completion_tokens": len(c.output_ids),
                             "total_tokens": c.prompt_tokens + len(c.output_ids)}  # fmt: skip
        return sse(body)

    # -- pieces ---------------------------------------------------------------------------------
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _choice(
        self,
        c: Choice,
        part: Part,
        ids: list[int],
        lps: list[float],
        tops: list[list[tuple[int, float]]],
        final: bool,
        echo: bool = False,
    ) -> dict[str, Any]:
        """A choice object; with `echo` (a whole response, or a choice's first chunk) and
        the request's `echo`, the prompt's text and logprobs go first."""
        out: dict[str, Any] = {"index": c.index}
        text = part.content
        if echo and self.chat_echo:
            text = self.chat_echo + text
        if echo and self.echo:
            text = self._prompt_text(c.index) + text
            prompt = c.prompt
            if prompt is not None:
                lps = prompt.token_logprobs() + lps
                tops = (prompt.top_pairs() or [None] * len(prompt.ids)) + tops
                ids = prompt.ids + ids
        if self.kind == "chat":
            called = c.split is not None and c.split.calls
            message = {"role": "assistant", "content": None if called and not text else text}
            if self.reasoning_parser is not None:
                message["reasoning_content"] = part.reasoning or None
            out["message"] = message
        else:
            out["text"] = text
        out["logprobs"] = None
        if self.want_logprobs:
            chat = self.kind == "chat"
            out["logprobs"] = openai_logprobs(self.openai_names, chat, self.top_n, ids, lps,
                                              tops)  # fmt: skip
        out["finish_reason"] = c.finish_type if final else None
        out["matched_stop"] = c.matched if final else None
        return out

    def _prompt_text(self, index: int) -> str:
        sub = self.subs[index]
        if sub.text is not None:
            return sub.text
        skip = sub.sampling_params.get("skip_special_tokens", True)
        return self.names.text(sub.input_ids or [], skip_special_tokens=skip)


def _chat_echo(sub: Any) -> str:
    """The text chat's `echo` puts first: the last message's, if it is the assistant's."""
    last = sub.messages[-1] if sub.echo and sub.messages else None
    return last.content if last is not None and last.role == "assistant" else ""
