"""The text oracle for detokenized output: the tokenizer's decode of all output tokens.

`assert_matches_decode(tokenizer, ids, text)` accepts exactly what `services.detokenize`
promises: equality whenever the output is valid UTF-8; for invalid byte runs, byte-level
BPE may differ only in the number of U+FFFD, and byte fallback only inside the invalid
runs of `<0xNN>` tokens (each run's text at most one character per byte).
"""

from __future__ import annotations

import re
from typing import Any

from services.detokenize import REPLACEMENT_CHAR, StepDetokenizer


def decode(tokenizer: Any, ids: list[int], skip: bool = True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def byte_fallback_pattern(det: StepDetokenizer, ids: list[int], skip: bool = True) -> str:
    """A regex for a byte-fallback decode of `ids`: exact text outside invalid runs of byte
    tokens, anything of at most one character per byte inside them."""
    tok = det.tokenizer
    special = set(tok.all_special_ids)
    segments: list[tuple[bool, list[int]]] = []
    for t in ids:
        if skip and t in special:
            continue
        is_byte = t in det.byte_values
        if is_byte and segments and segments[-1][0]:
            segments[-1][1].append(t)
        else:
            segments.append((is_byte, [t]))
    prefix_text = decode(tok, det.prefix_ids, False)
    parts = []
    for i, (is_byte, seg) in enumerate(segments):
        if is_byte:
            try:
                bytes(det.byte_values[t] for t in seg).decode("utf-8")
            except UnicodeDecodeError:
                parts.append(rf"[\s\S]{{0,{len(seg)}}}")
                continue
        if i:  # in context: after other text, no leading-space stripping
            text = decode(tok, det.prefix_ids + seg, False)[len(prefix_text) :]
        else:
            text = decode(tok, seg, False)
        parts.append(re.escape(text))
    return "".join(parts)


def matches_decode(det: StepDetokenizer, ids: list[int], text: str, skip: bool = True) -> bool:
    want = decode(det.tokenizer, ids, skip)
    if text == want:
        return True
    if REPLACEMENT_CHAR not in want:
        return False
    if det.byte_values:
        return re.fullmatch(byte_fallback_pattern(det, ids, skip), text) is not None
    return text.replace(REPLACEMENT_CHAR, "") == want.replace(REPLACEMENT_CHAR, "")


def assert_matches_decode(det: StepDetokenizer, ids: list[int], text: str, skip: bool = True):
    want = decode(det.tokenizer, ids, skip)
    assert matches_decode(det, ids, text, skip), f"ids {ids}\n got {text!r}\nwant {want!r}"
