"""Message base classes: wire format, schema validation and the tag → type registry.

Every message on a stream is one msgpack map::

    {"t": <type tag>, "v": <schema version>, <field>: <value>, ...}

A message type is a frozen dataclass deriving from `Message` with a `TAG` and a `VERSION`.
Nested structures (a finish reason, a chat turn) derive from `Record`: a frozen dataclass
encoded as a plain map without tag or version. The schema is the dataclass's type hints;
`from_msg` checks every value against it, so a consumer never sees an int where a str belongs.

Supported field types: `int` (bool is refused), `float` (an int is accepted and converted),
`str`, `bool`, `bytes` (msgpack bin), `Literal[...]`, `X | None`, `list[X]`, `dict[str, X]`,
`Any` (plain data: None, bool, int, float, str, list and str-keyed maps of those) and
`Record` subclasses.

Every field must be present on the wire, even one with a default in Python: defaults are
for constructing messages, not for filling gaps in what a peer sent. A peer that needs a
new field bumps the type's `VERSION`, and consumers refuse versions they do not speak.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import msgpack

from shared.messages.schema import Checker, MessageError, compile_checker

__all__ = ["Message", "MessageError", "Record", "decode_message", "message_types"]

_RESERVED = frozenset({"t", "v"})
_REGISTRY: dict[str, type[Message]] = {}


def _encode_default(obj: object) -> object:
    """msgpack hook: a nested Record becomes a map of its fields."""
    if isinstance(obj, Record):
        return {name: getattr(obj, name) for name in obj._field_names()}
    raise TypeError(f"cannot encode {type(obj).__name__} in a message")


class Record:
    """A frozen dataclass that travels as a plain msgpack map inside a message."""

    __slots__ = ()
    _fields_cache: ClassVar[tuple[str, ...] | None] = None
    _checks_cache: ClassVar[tuple[tuple[str, Checker], ...] | None] = None

    @classmethod
    def _field_names(cls) -> tuple[str, ...]:
        names = cls.__dict__.get("_fields_cache")
        if names is None:
            names = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
            if _RESERVED & set(names):
                raise TypeError(f"{cls.__name__}: field names {sorted(_RESERVED)} are reserved")
            cls._fields_cache = names
        return names

    @classmethod
    def _checkers(cls) -> tuple[tuple[str, Checker], ...]:
        """Compiled lazily: type hints may name classes defined later in the module."""
        checks = cls.__dict__.get("_checks_cache")
        if checks is None:
            import typing

            hints = typing.get_type_hints(cls)
            checks = tuple((n, compile_checker(hints[n], Record)) for n in cls._field_names())
            cls._checks_cache = checks
        return checks

    @classmethod
    def _from_wire(cls, data: object, path: str) -> Record:
        """Build an instance from a decoded map, checking every field; `path` names it."""
        if type(data) is not dict:
            raise MessageError(f"{path}: expected a map, got {type(data).__name__}")
        names = cls._field_names()
        if len(data) != len(names) or not all(n in data for n in names):
            _report_field_mismatch(data, names, path)
        values = {name: check(data[name], f"{path}.{name}") for name, check in cls._checkers()}
        obj = cls(**values)
        obj._check()
        return obj

    def _check(self) -> None:
        """Cross-field invariants; override and raise MessageError. Called after decoding."""

    def validate(self) -> None:
        """Check this instance as a consumer would (round trip through the wire format)."""
        type(self)._from_wire(msgpack.unpackb(self._pack_body()), type(self).__name__)

    def _pack_body(self) -> bytes:
        return msgpack.packb(self, default=_encode_default, use_bin_type=True)


def _report_field_mismatch(data: dict, names: tuple[str, ...], path: str) -> None:
    missing = [n for n in names if n not in data]
    unknown = sorted(repr(k) for k in data if k not in names)
    parts = []
    if missing:
        parts.append(f"missing field(s) {', '.join(missing)}")
    if unknown:
        parts.append(f"unknown field(s) {', '.join(unknown)}")
    raise MessageError(f"{path}: {'; '.join(parts)}")


class Message(Record):
    """A top-level message: a Record with a type tag and a schema version."""

    __slots__ = ()
    TAG: ClassVar[str] = ""
    VERSION: ClassVar[int] = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.TAG:
            return
        known = _REGISTRY.get(cls.TAG)
        # dataclass(slots=True) rebuilds the class, so the same class may register twice.
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise TypeError(f"message tag {cls.TAG!r} used by {known.__name__} and {cls.__name__}")
        _REGISTRY[cls.TAG] = cls

    def to_msg(self) -> bytes:
        """Encode as msgpack bytes (the value of the stream entry's single field)."""
        body: dict[str, object] = {"t": self.TAG, "v": self.VERSION}
        for name in self._field_names():
            body[name] = getattr(self, name)
        return msgpack.packb(body, default=_encode_default, use_bin_type=True)

    @classmethod
    def from_msg(cls, data: bytes) -> Message:
        """Decode and validate; raise MessageError unless `data` is a valid `cls`."""
        msg = decode_message(data)
        if cls is not Message and type(msg) is not cls:
            raise MessageError(f"expected a {cls.TAG!r} message, got {msg.TAG!r}")
        return msg


def decode_message(data: bytes) -> Message:
    """Decode any registered message type, dispatching on its tag.

    Raises MessageError (never anything else) for bytes that are not msgpack, not a map,
    carry an unknown tag or version, or whose fields do not match the type's schema.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MessageError(f"expected bytes, got {type(data).__name__}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MessageError(f"not valid msgpack: {type(exc).__name__}: {exc}") from None
    if type(body) is not dict:
        raise MessageError(f"expected a msgpack map, got {type(body).__name__}")
    tag = body.pop("t", None)
    version = body.pop("v", None)
    cls = _REGISTRY.get(tag) if type(tag) is str else None
    if cls is None:
        raise MessageError(f"unknown message tag {tag!r}")
    if type(version) is not int or version != cls.VERSION:
        raise MessageError(f"{tag}: unsupported schema version {version!r} (speaks {cls.VERSION})")
    try:
        return cls._from_wire(body, cls.__name__)  # type: ignore[return-value]
    except RecursionError:
        raise MessageError(f"{tag}: nested too deeply") from None


def message_types() -> dict[str, type[Message]]:
    """All registered message types by tag (a copy)."""
    return dict(_REGISTRY)
