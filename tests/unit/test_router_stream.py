"""The router's reassembly of detokenizer rows: order, repeats, stop strings, hold-back."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from services.router_stream import OutputAssembler, StopMatcher
from shared.messages import DetokRow, FinishReason


def make_rows(pieces: list[str], finish: FinishReason | None = None) -> list[DetokRow]:
    """One row per piece, one token per character; the last row carries `finish`."""
    rows, pos = [], 0
    for i, text in enumerate(pieces):
        ids = [ord(c) for c in text]
        last = i == len(pieces) - 1
        reason = (finish or FinishReason("length")) if last else None
        rows.append(DetokRow("r", pos, pos + len(ids), text, ids, reason, 5, pos + len(ids), 2))
        pos += len(ids)
    return rows


def feed(assembler: OutputAssembler, batches: list[list[DetokRow]]) -> list:
    return [d for batch in batches if (d := assembler.add(batch)) is not None]


def reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Grow the text a character at a time; cut at the first stop string completed."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[: end - len(stop)], stop
    return text, None


def test_in_order_rows_release_text_ids_and_usage_at_the_end() -> None:
    a = OutputAssembler()
    deltas = feed(a, [[r] for r in make_rows(["Hel", "lo", " wo", "rld"])])
    assert [d.text for d in deltas] == ["Hel", "lo", " wo", "rld"]
    assert sum((d.output_ids for d in deltas), []) == [ord(c) for c in "Hello world"]
    assert [d.finished for d in deltas] == [False, False, False, True]
    assert deltas[-1].usage.completion_tokens == 11 and deltas[-1].usage.cached_tokens == 2


def test_a_gap_holds_later_rows_until_it_is_filled() -> None:
    r0, r1, r2 = make_rows(["ab", "cd", "ef"])
    a = OutputAssembler()
    assert a.add([r2]) is None and a.add([r1]) is None
    d = a.add([r0])
    assert d.text == "abcdef" and d.finished and d.output_ids == [ord(c) for c in "abcdef"]


def test_repeated_ranges_are_ignored_even_after_the_end() -> None:
    r0, r1 = make_rows(["ab", "cd"])
    a = OutputAssembler()
    assert a.add([r0, r0]).text == "ab"
    assert a.add([r0]) is None
    assert a.add([r1, r1]).text == "cd"
    assert a.add([r1, r0]) is None


def test_final_row_without_tokens_ends_the_request() -> None:
    r0 = make_rows(["ab"])[0]._replace(finish_reason=None)
    abort = DetokRow("r", 2, 2, "", [], FinishReason("abort", message="gone"), 5, 2, 0)
    a = OutputAssembler()
    a.add([r0])
    d = a.add([abort])
    assert d.text == "" and d.finish_reason.type == "abort" and a.finished


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.text(min_size=0, max_size=4), min_size=1, max_size=12),
    seed=st.integers(0, 2**32),
)
def test_any_arrival_order_with_repeats_gives_the_text_once(pieces: list[str], seed: int) -> None:
    rng = random.Random(seed)
    rows = make_rows(pieces)
    arrivals = rows + [rng.choice(rows) for _ in range(rng.randrange(4))]
    rng.shuffle(arrivals)
    batches, i = [], 0
    while i < len(arrivals):
        n = rng.randint(1, 3)
        batches.append(arrivals[i : i + n])
        i += n
    deltas = feed(OutputAssembler(), batches)
    assert "".join(d.text for d in deltas) == "".join(pieces)
    assert sum((d.output_ids for d in deltas), []) == [ord(c) for c in "".join(pieces)]
    assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished


def test_stop_string_across_rows_is_trimmed_and_its_start_held_back() -> None:
    a = OutputAssembler(["STOP"])
    rows = make_rows(["ab S", "T", "OP tail"], FinishReason("stop", "STOP"))
    assert a.add([rows[0]]).text == "ab "  # "S" could start "STOP": held back
    d = a.add([rows[1]])  # "ST" could too: no new text, but the token came in
    assert d.text == "" and d.output_ids == [ord("T")]
    d = a.add([rows[2]])
    assert d.text == "" and d.finish_reason.to_dict() == {"type": "stop", "matched": "STOP"}
    assert a.num_released == 3 and a.pending_text == ""


def test_held_back_text_is_released_when_it_stops_looking_like_a_stop() -> None:
    a = OutputAssembler(["bc"])
    rows = make_rows(["ab", "d", "e"])
    assert a.add([rows[0]]).text == "a"
    assert a.add([rows[1]]).text == "bd"
    assert a.add([rows[2]]).text == "e"


def test_router_ends_a_request_whose_stop_string_the_worker_missed() -> None:
    a = OutputAssembler(["</s>"])
    rows = make_rows(["hi </", "s> more", "x"])
    a.add([rows[0]])
    d = a.add([rows[1]])
    assert a.finished and a.stopped_here
    assert d.finish_reason.matched == "</s>" and d.usage.completion_tokens == 12
    assert a.num_released == 3 and a.add([rows[2]]) is None


def test_kept_stop_string_ends_the_text_once_complete() -> None:
    a = OutputAssembler(["STOP"], keep_stop=True)
    rows = make_rows(["ab S", "T", "OP tail"], FinishReason("stop", "STOP"))
    assert a.add([rows[0]]).text == "ab "  # held back as when trimming
    assert a.add([rows[1]]).text == ""
    assert a.add([rows[2]]).text == "STOP"
    b = OutputAssembler(keep_stop=True)  # one only the worker matched
    assert b.add(make_rows(["abc<eot>x"], FinishReason("stop", "<eot>"))).text == "abc<eot>"


def test_stop_reported_by_worker_is_trimmed_even_if_not_in_the_stop_list() -> None:
    a = OutputAssembler()
    d = a.add(make_rows(["abc<eot>"], FinishReason("stop", "<eot>")))
    assert d.text == "abc"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=14),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), max_size=3),
    seed=st.integers(0, 2**32),
    keep=st.booleans(),
)
def test_streamed_stop_trimming_matches_char_by_char_reference(
    text: str, stops: list[str], seed: int, keep: bool
) -> None:
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text) or not pieces:
        n = rng.randint(0, 3)
        pieces.append(text[i : i + n])
        i += n
    a = OutputAssembler(stops, keep_stop=keep)
    want, stop = reference_stop(text, stops)
    if keep and stop is not None:
        want += stop
    released = ""
    for row in make_rows(pieces):
        d = a.add([row])
        if d is not None:
            released += d.text
        assert want.startswith(released)  # nothing taken back
        if a.finished:
            break
    assert released == want
    if stop is not None:
        assert a.finish_reason.matched == stop


def test_hold_back_is_the_longest_tail_that_starts_a_stop() -> None:
    m = StopMatcher(["abcd", "cx", "", "abcd"])
    assert m.stops == ["abcd", "cx"]
    assert m.hold_back("zzabc") == 3
    assert m.hold_back("zzc") == 1
    assert m.hold_back("abcd") == 0  # a whole stop is found, not held back
    assert StopMatcher([]).hold_back("abc") == 0
