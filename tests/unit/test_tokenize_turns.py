"""The tokenizer's `truncate_turns` (the Responses API's `truncation: "auto"`): a chat too long
for the context loses its earliest whole turns, as few as make it fit with max_new_tokens,
and keeps its system messages; a chat that fits, or one whose last turn alone is too long,
is left whole (and the second refused)."""

from __future__ import annotations

import pytest

from engine.tokenizer import load_tokenizer
from services.tokenize_request import RequestError, RequestTokenizer
from shared.messages import ChatMessage, TokenizeReqMsg
from tests.factories import tiny_model

CONTEXT = 400
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.fixture(scope="module")
def service() -> RequestTokenizer:
    tokenizer = load_tokenizer(tiny_model("qwen2"))
    return RequestTokenizer(tokenizer, len(tokenizer), CONTEXT)


def _conversation() -> list[ChatMessage]:
    """A system message and six turns; turn 2 calls a tool (its result must stay with it)."""
    out = [ChatMessage("system", "You are terse.")]
    for t in range(6):
        out.append(ChatMessage("user", f"question {t}: " + "tell me more " * 6))
        if t == 2:
            out.append(ChatMessage("assistant", "", tool_calls=[CALL]))
            out.append(ChatMessage("tool", "result", tool_call_id="c1"))
        out.append(ChatMessage("assistant", f"answer {t}: " + "here it is " * 6))
    out.append(ChatMessage("user", "and finally?"))
    return out


def _generate(service: RequestTokenizer, messages: list[ChatMessage], max_new: int, **sp: object):
    msg = TokenizeReqMsg(
        "r", "router", "w", messages=messages, sampling_params={"max_new_tokens": max_new, **sp}
    )
    return service.to_generate(msg)


def _ids(service: RequestTokenizer, messages: list[ChatMessage]) -> list[int]:
    """The whole chat's ids, with no context limit."""
    unlimited = RequestTokenizer(service.tokenizer, service.vocab_size, 10**6)
    return _generate(unlimited, messages, 1).input_ids


def test_the_earliest_turns_go_until_the_chat_fits(service: RequestTokenizer) -> None:
    messages = _conversation()
    whole = _ids(service, messages)
    starts = [i for i, m in enumerate(messages) if m.role == "user"]
    # candidates: the system message, then the conversation from a user message on
    candidates = [_ids(service, messages[:1] + messages[s:]) for s in starts[1:]]
    assert all(len(a) > len(b) for a, b in zip([whole, *candidates], candidates))
    for max_new in (0, 10, 60, 150):
        room = min(CONTEXT - max_new, CONTEXT - 1)  # a prompt never fills the whole context
        with pytest.raises(RequestError, match="context length"):
            _generate(service, messages, max_new)  # truncation disabled: refused
        got = _generate(service, messages, max_new, truncate_turns=True).input_ids
        want = next(c for c in ([whole] if len(whole) <= room else []) + candidates
                    if len(c) <= room)  # fmt: skip
        assert got == want and len(got) + max_new <= CONTEXT and len(got) < CONTEXT
        text = service.tokenizer.decode(got)
        assert text.count("You are terse.") == 1 and "and finally?" in text
        assert ("result" in text) == ("question 2" in text)  # a tool result keeps its call
    assert want != whole and len(want) < len(whole) // 2  # some turns went, not all


def test_a_chat_that_fits_is_left_whole(service: RequestTokenizer) -> None:
    messages = _conversation()[:4]
    got = _generate(service, messages, 16, truncate_turns=True).input_ids
    assert got == _ids(service, messages)


def test_a_last_turn_too_long_alone_is_refused(service: RequestTokenizer) -> None:
    messages = _conversation()[:3] + [ChatMessage("user", "long " * CONTEXT)]
    with pytest.raises(RequestError, match="context length"):
        _generate(service, messages, 16, truncate_turns=True)
