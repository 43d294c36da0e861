"""Records shared by several message types."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from shared.messages.base import Record
from shared.messages.schema import MessageError

FinishType = Literal["stop", "length", "abort"]

# Output tokens a step message carries before each request's new tokens: enough for the
# longest incomplete UTF-8 character (4 byte tokens) plus context for tokenizers whose
# text for a token depends on the token before it.
DETOK_WINDOW_LEN = 6


@dataclass(frozen=True, slots=True)
class FinishReason(Record):
    """Why a request ended, as SGLang reports it in `meta_info.finish_reason`.

    `matched` is the stop token id (int) or stop string (str) that ended the request, None
    for length limits and aborts. `message` explains an abort.
    """

    type: FinishType
    matched: int | str | None = None
    message: str | None = None

    def _check(self) -> None:
        if self.type != "stop" and self.matched is not None:
            raise MessageError(f"FinishReason: matched is only valid for 'stop', not {self.type!r}")

    def to_dict(self, length: int | None = None) -> dict[str, Any]:
        """SGLang's JSON form (`meta_info.finish_reason`): `matched` for "stop", `length`
        (the caller knows it: the tokens generated) for "length", `message` when set."""
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length" and length is not None:
            out["length"] = length
        if self.message is not None:
            out["message"] = self.message
        return out


@dataclass(frozen=True, slots=True)
class PromptLogprobs(Record):
    """A request's prompt logprobs from position `start` (SGLang's `logprob_start_len`).

    `ids` are the prompt tokens from `start` on; `logprobs` those of each of them, except
    that the prompt's first token has none (when `start` is 0, `logprobs` covers `ids[1:]`);
    `top_ids` / `top_vals`, when asked for, the best candidates at the same positions;
    `ranks` (vLLM's), for each of `logprobs`, how many tokens had a logprob at least as high.
    """

    start: int
    ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None = None
    top_vals: list[list[float]] | None = None
    ranks: list[int] | None = None

    def _check(self) -> None:
        want = len(self.ids) - (self.start == 0)
        if self.start < 0 or not self.ids or len(self.logprobs) != want:
            raise MessageError(
                f"PromptLogprobs: {len(self.logprobs)} logprobs for {len(self.ids)} token(s) "
                f"from position {self.start}"
            )
        if (self.top_ids is None) != (self.top_vals is None):
            raise MessageError("PromptLogprobs: top_ids and top_vals go together")
        if self.ranks is not None and (
            len(self.ranks) != want or any(r < 1 for r in self.ranks)
        ):
            raise MessageError("PromptLogprobs: ranks do not match logprobs")
        if self.top_ids is not None and self.top_vals is not None:
            if len(self.top_ids) != want or any(
                len(i) != len(v) for i, v in zip(self.top_ids, self.top_vals, strict=False)
            ) or len(self.top_vals) != want:
                raise MessageError("PromptLogprobs: top_ids / top_vals do not match logprobs")

    @property
    def none_first(self) -> list[None]:
        """The missing entry of the prompt's first token, if `ids` starts there."""
        return [None] if self.start == 0 else []

    def token_logprobs(self) -> list[float | None]:
        """One per token of `ids` (None for the prompt's first)."""
        return self.none_first + list(self.logprobs)

    def top_pairs(self) -> list[list[tuple[int, float]] | None] | None:
        """(token id, logprob) candidates per token of `ids` (None for the prompt's first)."""
        if self.top_ids is None or self.top_vals is None:
            return None
        pairs = [list(zip(i, v, strict=True)) for i, v in zip(self.top_ids, self.top_vals)]
        return self.none_first + pairs


def check_columns(owner: str, columns: dict[str, list], num_rows: int) -> None:
    """Raise MessageError unless every column has `num_rows` entries."""
    for name, column in columns.items():
        if len(column) != num_rows:
            raise MessageError(
                f"{owner}.{name}: column has {len(column)} entries, expected {num_rows}"
            )


def check_optional_lengths(owner: str, name: str, column: list, lengths: list[int]) -> None:
    """Raise MessageError unless each non-None entry has the length of its request's tokens."""
    if column.count(None) == len(column):
        return  # the common case: no request of the step asked for logprobs
    for i, (entry, want) in enumerate(zip(column, lengths, strict=True)):
        if entry is not None and len(entry) != want:
            raise MessageError(f"{owner}.{name}[{i}]: {len(entry)} entries for {want} new token(s)")


class Columnar:
    """Mixin for messages that carry one row per request as parallel columns.

    A columnar layout encodes and validates several times faster than a list of maps and
    is a third of the size (see the measurements in the bus report). `ROW` is a NamedTuple
    whose fields line up, in order, with the message fields named in `COLUMNS`; `rows()`
    and `from_rows()` convert with `zip`, so building and reading rows stays cheap.
    """

    __slots__ = ()
    ROW: ClassVar[type]
    COLUMNS: ClassVar[tuple[str, ...]]

    @classmethod
    def from_rows(cls, rows: Iterable[tuple], **header: Any) -> Any:
        """Build the message from row tuples plus its non-column fields."""
        rows = list(rows)
        if any(len(r) != len(cls.COLUMNS) for r in rows):
            raise ValueError(f"{cls.__name__}.from_rows: rows must be {cls.ROW.__name__} tuples")
        columns = (
            [list(col) for col in zip(*rows, strict=True)] if rows else [[] for _ in cls.COLUMNS]
        )
        return cls(**header, **dict(zip(cls.COLUMNS, columns, strict=True)))

    @property
    def num_rows(self) -> int:
        return len(getattr(self, self.COLUMNS[0]))

    def rows(self) -> list:
        """One `ROW` per request, in message order."""
        make = self.ROW._make  # type: ignore[attr-defined]
        return list(map(make, zip(*(getattr(self, name) for name in self.COLUMNS), strict=True)))

    def row(self, i: int) -> Any:
        return self.ROW(*(getattr(self, name)[i] for name in self.COLUMNS))

    def _check_columns(self) -> None:
        check_columns(
            type(self).__name__, {n: getattr(self, n) for n in self.COLUMNS}, self.num_rows
        )
