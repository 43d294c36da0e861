"""Tokenizing one request: text, chat messages or ids → a checked `GenerateReqMsg`.

Pure (no Redis), used by the tokenizer service. Token ids are checked against the
vocabulary, the prompt against the context length (also with `max_new_tokens` on top),
and the sampling parameters with the engine's own rules (`SamplingParams.from_dict` +
`verify`; that module imports no torch, so the tokenizer shares the rules instead of
copying them, and the router need not repeat them). Stop strings and the detokenizer
flags are lifted out of the sampling dict into their `GenerateReqMsg` fields.

vLLM's `truncate_prompt_tokens` (in the sampling dict, for the tokenizer only) keeps the
prompt's last k tokens (-1: as many as fit in the context with `max_new_tokens`; a text pair,
`text_pair`, is cut the way transformers truncates pairs);
`truncate_turns` (the Responses API's `truncation: "auto"`) drops a chat's earliest turns until
it fits. Its `bad_words` become the token sequences `bad_words_ids` (engine/tokenizer.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

from engine.layer_windows import position_limit
from engine.sampling.sampling_params import SamplingParams
from engine.tokenizer import apply_chat_template, bad_words_ids
from shared.messages import ChatMessage, GenerateReqMsg, TokenizeReqMsg, TokenizeRespMsg

_LIFTED = ("stop", "skip_special_tokens", "spaces_between_special_tokens")
_REQUEST_LEVEL = ("return_logprob", "top_logprobs_num", "logprob_start_len", "return_prompt_ranks")


class RequestError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def model_limits(model_path: str) -> tuple[int, int]:
    """(vocab size, context length) from the model's config.json (no torch needed)."""
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    context = config.get("max_position_embeddings") or config.get("n_positions") or 2048
    context = position_limit(config.get("model_type"), int(context), config.get("pad_token_id"))
    return int(config["vocab_size"]), context


class RequestTokenizer:
    """Turns a `TokenizeReqMsg` into a `GenerateReqMsg`, or raises RequestError."""

    def __init__(self, tokenizer: Any, vocab_size: int, context_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len

    def to_generate(self, msg: TokenizeReqMsg, context_len: int | None = None) -> GenerateReqMsg:
        sp = dict(msg.sampling_params)
        lifted = {k: sp.pop(k) for k in _LIFTED if k in sp}
        for key in _REQUEST_LEVEL:
            sp.pop(key, None)  # the message fields say it
        keep = sp.pop("truncate_prompt_tokens", None)
        drop_turns = sp.pop("truncate_turns", None)
        if "bad_words" in sp:
            try:
                sp["bad_words_ids"] = bad_words_ids(self.tokenizer, sp.pop("bad_words") or [])
            except ValueError as exc:
                raise RequestError("invalid_request", str(exc)) from None
        params = self._check_params(sp, lifted, msg)
        context_len = context_len or self.context_len
        # (_check_length: a pooled prompt may fill the context, a generated one leaves a token)
        room = min(context_len - params.max_new_tokens, context_len - (not msg.embed))
        if keep is not None:
            keep = _keep_count(keep, room, context_len)
        types = None
        if msg.text_pair is not None:
            ids, types = self._pair(msg, keep)
        else:
            ids = self._input_ids(msg)
            if drop_turns and msg.messages is not None:
                ids = self._fit_turns(msg, ids, room)
            if keep is not None:
                ids = ids[-keep:]
        self._check_length(ids, params.max_new_tokens, context_len, msg.embed)
        return GenerateReqMsg(
            rid=msg.rid,
            router_id=msg.router_id,
            input_ids=ids,
            sampling_params=sp,
            stop=params.stop_strs,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            logprob_start_len=msg.logprob_start_len,
            created=msg.created,
            return_prompt_ranks=msg.return_prompt_ranks,
            priority=msg.priority,
            lora_name=msg.lora_name,
            return_prompt_ids=msg.return_prompt_ids,
            embed=msg.embed,
            token_type_ids=types,
            cache_salt=msg.cache_salt,
        )

    def answer(self, msg: TokenizeReqMsg) -> TokenizeRespMsg:
        """A query's answer (`reply` "tokenize" or "detokenize"), or RequestError."""
        if msg.reply == "detokenize":
            ids = list(msg.input_ids or [])
            self._check_ids(ids)
            skip = bool(msg.sampling_params.get("skip_special_tokens", False))
            text = self.tokenizer.decode(ids, skip_special_tokens=skip)
            return TokenizeRespMsg(msg.rid, msg.router_id, ids, text=text)
        ids = self._encode(msg)
        self._check_ids(ids)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if msg.return_token_strs else None
        return TokenizeRespMsg(msg.rid, msg.router_id, ids, token_strs=strs)

    def _input_ids(self, msg: TokenizeReqMsg) -> list[int]:
        ids = self._encode(msg)
        if not ids:
            raise RequestError("invalid_request", "the prompt is empty")
        self._check_ids(ids)
        return ids

    def _fit_turns(self, msg: TokenizeReqMsg, ids: list[int], room: int) -> list[int]:
        """The chat's prompt without its earliest turns, as few as make it `room` tokens or
        fewer (the Responses API's `truncation: "auto"`). A turn starts at a user message;
        the leading system messages stay. Dropping whole turns keeps the roles in the order
        templates require (a tool result never loses its call). If even the last turn is too
        long, the whole prompt is returned (and refused by the length check)."""
        messages = list(msg.messages or [])
        if len(ids) <= room:
            return ids
        lead = 0
        while lead < len(messages) and messages[lead].role in ("system", "developer"):
            lead += 1
        starts = [i for i in range(lead + 1, len(messages)) if messages[i].role == "user"]
        best, lo, hi = None, 0, len(starts) - 1  # the fewest turns dropped: starts[k] first
        while lo <= hi:  # the prompt shrinks as turns go: the first k that fits, by bisection
            k = (lo + hi) // 2
            kept = self._encode(msg, messages[:lead] + messages[starts[k] :])
            if len(kept) <= room:
                best, hi = kept, k - 1
            else:
                lo = k + 1
        return ids if best is None else best

    def _pair(self, msg: TokenizeReqMsg, keep: int | None = None) -> tuple[list[int], Any]:
        """A text pair's ids as its tokenizer joins them, and their token types (BERT's second
        text: 1; None when all are 0). With `keep`, cut to that many tokens the way
        transformers truncates pairs (HF's and vLLM's `truncation=True`: the longer text
        loses its last tokens first), so that both texts keep their starts and the special
        tokens stay."""
        cut = {} if keep is None else {"truncation": True, "max_length": keep}
        special = msg.add_special_tokens is not False
        try:
            pair = self.tokenizer(msg.text, text_pair=msg.text_pair, add_special_tokens=special,
                                  return_token_type_ids=True, **cut)  # fmt: skip
        except Exception as exc:  # (a max_length below the special tokens' count)
            if keep is None:
                raise
            raise RequestError("invalid_request", f"truncate_prompt_tokens: {exc}") from None
        ids = list(pair["input_ids"])
        if not ids:
            raise RequestError("invalid_request", "the prompt is empty")
        self._check_ids(ids)
        types = pair.get("token_type_ids")
        return ids, (list(types) if types and any(types) else None)

    def _check_ids(self, ids: list[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise RequestError(
                "invalid_request", f"input_ids: token ids must be in [0, {self.vocab_size})"
            )

    def _encode(self, msg: TokenizeReqMsg, messages: list[ChatMessage] | None = None) -> list[int]:
        """The prompt's ids: its text, its chat messages (or `messages` instead) templated,
        or its ids."""
        special = msg.add_special_tokens
        if msg.text_pair is not None:  # (a cross-encoder's query and document)
            return self._pair(msg)[0]
        if msg.text is not None:
            return self.tokenizer.encode(msg.text, add_special_tokens=special is not False)
        messages = msg.messages if messages is None else messages
        if messages is not None:
            turns = [_turn(m) for m in messages]
            kwargs = dict(msg.chat_template_kwargs or {})
            reserved_keys = ("messages", "tools", "add_generation_prompt",
                             "continue_final_message", "tokenize")  # fmt: skip
            for reserved in reserved_keys:
                if kwargs.pop(reserved, None) is not None:
                    raise RequestError(
                        "invalid_request", f"chat_template_kwargs: {reserved!r} is set by sluice"
                    )
            try:
                return apply_chat_template(
                    self.tokenizer,
                    turns,
                    add_generation_prompt=msg.add_generation_prompt,
                    tools=msg.tools,
                    continue_final_message=msg.continue_final_message,
                    add_special_tokens=bool(special),
                    **kwargs,
                )
            except Exception as exc:  # template errors: roles out of order, bad content
                raise RequestError("invalid_request", f"messages: {exc}") from None
        return list(msg.input_ids or [])

    def _check_params(
        self, sp: dict[str, Any], lifted: dict[str, Any], msg: TokenizeReqMsg
    ) -> SamplingParams:
        full = {**sp, **lifted, "return_logprob": msg.return_logprob}
        full["top_logprobs_num"] = msg.top_logprobs_num
        full["logprob_start_len"] = msg.logprob_start_len
        full["return_prompt_ranks"] = msg.return_prompt_ranks
        try:
            params = SamplingParams.from_dict(full)
            params.verify(self.vocab_size)
        except (ValueError, TypeError) as exc:
            raise RequestError("invalid_request", f"sampling_params: {exc}") from None
        if params.n != 1:
            raise RequestError("invalid_request", "sampling_params: n must be 1 per request")
        return params

    def _check_length(
        self, ids: list[int], max_new_tokens: int, context_len: int, pooled: bool = False
    ) -> None:
        """A prompt to generate from leaves room for a token; a pooled one may fill the
        context (a BERT embedding model reads its 512 positions, as sentence-transformers
        does)."""
        if len(ids) > context_len - (not pooled):
            raise RequestError(
                "prompt_too_long",
                f"the prompt has {len(ids)} tokens; the context length is {context_len}",
            )
        if len(ids) + max_new_tokens > context_len:
            raise RequestError(
                "prompt_too_long",
                f"{len(ids)} prompt tokens + max_new_tokens {max_new_tokens} exceed the "
                f"context length {context_len}",
            )


def _keep_count(keep: Any, room: int, context_len: int) -> int:
    """How many of the prompt's tokens `truncate_prompt_tokens` keeps (-1: `room`, at
    least one)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or (keep < 1 and keep != -1):
        raise RequestError("invalid_request", "truncate_prompt_tokens must be -1 or >= 1")
    if keep > context_len:
        raise RequestError(
            "invalid_request",
            f"truncate_prompt_tokens {keep} is more than the context length {context_len}",
        )
    return max(room, 1) if keep == -1 else keep


def _turn(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it: tool call arguments as a mapping (HF's
    convention, what vLLM passes too) when they are a JSON object, else as the text."""
    turn: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name is not None:
        turn["name"] = m.name
    if m.tool_call_id is not None:
        turn["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            function = dict(call.get("function") or {})
            try:
                args = json.loads(function.get("arguments") or "{}")
            except (TypeError, ValueError):
                args = None
            if isinstance(args, dict):
                function["arguments"] = args
            calls.append({**call, "function": function})
        turn["tool_calls"] = calls
    return turn
