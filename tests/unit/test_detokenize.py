"""Stateless incremental detokenization against the tokenizer's own decode of all tokens.

Every test streams output tokens through `StepDetokenizer` the way the worker cuts them
(random step sizes, a window of DETOK_WINDOW_LEN tokens before each step, the last step
finished) and compares the concatenated deltas with
`tokenizer.decode(output_ids, clean_up_tokenization_spaces=False)`.
"""

from __future__ import annotations

import functools
import random
import re

import pytest

from engine.tokenizer import load_tokenizer
from services.detokenize import REPLACEMENT_CHAR, StepDetokenizer
from shared.messages import DETOK_WINDOW_LEN, FinishReason, StepOutputMsg, StepRow
from tests.detok_oracle import byte_fallback_pattern, decode

BYTE_LEVEL = ("gpt2", "qwen2")
BYTE_FALLBACK = ("llama", "mistral")
VOCAB_SIZE = 1536

TEXTS = [
    "Hello world",
    " leading space, then  two spaces\nand a newline\n\n",
    "你好，世界！这是一个测试。",
    "日本語のテキスト🎉🎉 ok",
    "emoji 😀👍🏽🇫🇷 and café, naïve, Ωμέγα",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 — “quotes” ‘single’ …",
    "mixed 中文 and English 한국어 text",
    "a",
]


@functools.cache
def tokenizer(arch: str, tmp_root: str):
    from services.tiny_tokenizer import build_tokenizer

    path = f"{tmp_root}/{arch}"
    build_tokenizer(arch, VOCAB_SIZE).save_pretrained(path)
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("tokenizers"))


def stream(
    det: StepDetokenizer,
    ids: list[int],
    rng: random.Random,
    skip: bool = True,
    max_step: int = 5,
    abort_row: bool = False,
) -> str:
    """Deltas of `ids` cut into random steps, concatenated in order."""
    out, start = [], 0
    while start < len(ids):
        end = min(len(ids), start + rng.choice([1, 1, 1, 2, rng.randint(1, max_step)]))
        window = ids[max(0, start - DETOK_WINDOW_LEN) : start]
        last = end == len(ids) and not abort_row
        out.append(det.delta(ids[start:end], window, start, last, skip_special_tokens=skip))
        start = end
    if abort_row:  # a final row without tokens (an abort) releases what was held back
        window = ids[max(0, len(ids) - DETOK_WINDOW_LEN) :]
        out.append(det.delta([], window, len(ids), True, skip_special_tokens=skip))
    return "".join(out)


@pytest.mark.parametrize("arch", BYTE_LEVEL + BYTE_FALLBACK)
def test_text_round_trips_through_any_step_split(arch: str, tmp_root: str) -> None:
    tok = tokenizer(arch, tmp_root)
    det = StepDetokenizer(tok)
    rng = random.Random(arch)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        want = decode(tok, ids)
        assert REPLACEMENT_CHAR not in want
        for _ in range(30):
            assert stream(det, ids, rng) == want, (text, ids)


@pytest.mark.parametrize("arch", BYTE_LEVEL + BYTE_FALLBACK)
def test_one_token_per_step_through_byte_tokens(arch: str, tmp_root: str) -> None:
    """The decode loop's usual case: CJK and emoji arrive a byte token at a time."""
    tok = tokenizer(arch, tmp_root)
    det = StepDetokenizer(tok)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        deltas = [
            det.delta([ids[i]], ids[max(0, i - DETOK_WINDOW_LEN) : i], i, i == len(ids) - 1)
            for i in range(len(ids))
        ]
        assert "".join(deltas) == decode(tok, ids)
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_byte_fallback_spreads_characters_over_byte_tokens(tmp_root: str) -> None:
    """The case the tests above rely on: the tiny llama vocabulary spells CJK in bytes."""
    tok = tokenizer("llama", tmp_root)
    det = StepDetokenizer(tok)
    ids = tok.encode("你好", add_special_tokens=False)
    assert sum(t in det.byte_values for t in ids) >= 3
    # decode() of an incomplete character gives one U+FFFD per byte, not one in all
    first_two = [t for t in ids if t in det.byte_values][:2]
    assert decode(tok, first_two) == REPLACEMENT_CHAR * 2
    assert det.delta(first_two, [], 0, False) == ""


@pytest.mark.parametrize("arch", BYTE_LEVEL + BYTE_FALLBACK)
def test_random_valid_unicode_from_byte_tokens(arch: str, tmp_root: str) -> None:
    """Random characters of 1-4 UTF-8 bytes, interleaved with ordinary tokens."""
    tok = tokenizer(arch, tmp_root)
    det = StepDetokenizer(tok)
    rng = random.Random(7)
    ranges = [(0x20, 0x7E), (0xA1, 0x24F), (0x370, 0x3FF), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF)]
    for _ in range(150):
        chars = [chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 12))]
        ids = tok.encode("".join(chars), add_special_tokens=False)
        want = decode(tok, ids)
        assert REPLACEMENT_CHAR not in want
        assert stream(det, ids, rng, max_step=4) == want


@pytest.mark.parametrize("arch", BYTE_LEVEL + BYTE_FALLBACK)
@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences(arch: str, skip: bool, tmp_root: str) -> None:
    """Random ids (special tokens included): exact whenever the output is valid UTF-8;
    otherwise only U+FFFD counts differ (byte-level), or the text inside invalid byte
    runs (byte fallback, see services.detokenize)."""
    tok = tokenizer(arch, tmp_root)
    det = StepDetokenizer(tok)
    rng = random.Random(f"{arch}-{skip}")
    specials = list(tok.all_special_ids)
    num_valid = num_invalid = 0
    for _ in range(400):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        for _ in range(rng.randint(0, 2)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        got = stream(det, ids, rng, skip=skip, abort_row=rng.random() < 0.2)
        want = decode(tok, ids, skip)
        if REPLACEMENT_CHAR not in want:
            num_valid += 1
            assert got == want, ids
            continue
        num_invalid += 1
        if det.byte_values:
            assert re.fullmatch(byte_fallback_pattern(det, ids, skip), got), (ids, got, want)
        else:
            assert got.replace(REPLACEMENT_CHAR, "") == want.replace(REPLACEMENT_CHAR, ""), ids
    assert num_valid >= 20 and num_invalid >= 20  # both branches really ran


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_special_tokens_kept_or_skipped(arch: str, tmp_root: str) -> None:
    tok = tokenizer(arch, tmp_root)
    det = StepDetokenizer(tok)
    rng = random.Random(3)
    body = tok.encode(" Hello 你好 world", add_special_tokens=False)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [im_start, *body[:3], im_end, *body[3:], im_end]
    for skip in (True, False):
        want = decode(tok, ids, skip)
        assert ("<|im_end|>" in want) is not skip
        for _ in range(20):
            assert stream(det, ids, rng, skip=skip) == want


def cuts_inside_characters(tok, ids: list[int]) -> list[int]:
    """Lengths k such that ids[:k] ends inside a character."""
    return [k for k in range(1, len(ids)) if decode(tok, ids[:k]).endswith(REPLACEMENT_CHAR)]


@pytest.mark.parametrize("arch", BYTE_LEVEL + BYTE_FALLBACK)
def test_incomplete_character_is_held_back_then_released(arch: str, tmp_root: str) -> None:
    tok = tokenizer(arch, tmp_root)
    det = StepDetokenizer(tok)
    num_cuts = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for k in cuts_inside_characters(tok, ids):
            num_cuts += 1
            # Stream ids[:k] unfinished: nothing of the incomplete character is sent.
            partial = "".join(
                det.delta([ids[i]], ids[max(0, i - DETOK_WINDOW_LEN) : i], i, False)
                for i in range(k)
            )
            assert REPLACEMENT_CHAR not in partial and decode(tok, ids).startswith(partial)
            # A final row without tokens (an abort) releases the tail as decode shows it.
            # (ids[:k] is invalid UTF-8: byte fallback may differ inside the invalid run.)
            tail = det.delta([], ids[max(0, k - DETOK_WINDOW_LEN) : k], k, True)
            assert tail.endswith(REPLACEMENT_CHAR)
            if det.byte_values:
                assert re.fullmatch(byte_fallback_pattern(det, ids[:k], True), partial + tail)
            else:
                assert partial + tail == decode(tok, ids[:k])
    assert num_cuts >= 5


def test_leading_space_of_first_token_follows_decode(tmp_root: str) -> None:
    """SentencePiece strips the text's leading space: the first token's, no later one's
    (whether or not the window still reaches the first token)."""
    tok = tokenizer("llama", tmp_root)
    det = StepDetokenizer(tok)
    ids = tok.encode("one two three four five six seven eight nine ten", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[0].startswith("▁")
    deltas = [
        det.delta([ids[i]], ids[max(0, i - DETOK_WINDOW_LEN) : i], i, False)
        for i in range(len(ids))
    ]
    assert not deltas[0].startswith(" ")
    spaced = [i for i in range(1, len(ids)) if pieces[i].startswith("▁")]
    assert spaced and max(spaced) > DETOK_WINDOW_LEN
    assert all(deltas[i].startswith(" ") for i in spaced)
    assert "".join(deltas) == decode(tok, ids)


def test_detokenize_step_groups_rows_by_router(tmp_root: str) -> None:
    tok = tokenizer("gpt2", tmp_root)
    det = StepDetokenizer(tok)
    a = tok.encode(" one two three", add_special_tokens=False)
    b = tok.encode(" four", add_special_tokens=False)
    stop = FinishReason("stop", matched=0)
    rows = [
        StepRow("r1", "routerA", 2, a[2:3], a[:2], None, 5, 3, 0),
        StepRow("r2", "routerB", 0, b, [], stop, 7, len(b), 2, token_logprobs=[-0.5] * len(b)),
        StepRow("r3", "routerA", 0, a[:1], [], None, 4, 1, 0),
    ]
    msg = StepOutputMsg.from_rows(rows, worker_id="w0", step=9)
    outs = {m.router_id: m for m in det.detokenize_step(msg)}
    assert set(outs) == {"routerA", "routerB"}
    rows_a = outs["routerA"].rows()
    assert [(r.rid, r.start, r.end) for r in rows_a] == [("r1", 2, 3), ("r3", 0, 1)]
    assert rows_a[0].text == decode(tok, a[:3])[len(decode(tok, a[:2])) :]
    assert rows_a[1].output_ids == a[:1] and rows_a[1].prompt_tokens == 4
    (row_b,) = outs["routerB"].rows()
    assert row_b.text == decode(tok, b) and row_b.finish_reason == stop
    assert row_b.cached_tokens == 2 and row_b.token_logprobs == [-0.5] * len(b)
    assert outs["routerB"].worker_id == "w0" and outs["routerB"].step == 9
    for out in outs.values():
        out.validate()
