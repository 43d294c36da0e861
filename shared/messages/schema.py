"""Value checkers compiled from type hints, used to validate decoded messages.

A checker is `check(value, path) -> value`: it returns the value (converted where the
schema allows it: an int where a float belongs) or raises MessageError naming `path`.
Lists are checked on a fast path first; only when that fails are they walked again
element by element, so that the error names the exact index without every element
paying for building its path.
"""

from __future__ import annotations

import itertools
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

Checker = Callable[[Any, str], Any]

_MAX_PLAIN_DEPTH = 16


class MessageError(ValueError):
    """A message could not be decoded or failed validation; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def _fail(path: str, expected: str, value: object) -> typing.NoReturn:
    raise MessageError(f"{path}: expected {expected}, got {_describe(value)}")


def _check_int(v: Any, path: str) -> int:
    return v if type(v) is int else _fail(path, "int", v)


def _check_float(v: Any, path: str) -> float:
    if type(v) is float:
        return v
    return float(v) if type(v) is int else _fail(path, "float", v)


def _check_str(v: Any, path: str) -> str:
    return v if type(v) is str else _fail(path, "str", v)


def _check_bool(v: Any, path: str) -> bool:
    return v if type(v) is bool else _fail(path, "bool", v)


def _check_bytes(v: Any, path: str) -> bytes:
    return v if type(v) is bytes else _fail(path, "bytes", v)


def _check_plain(v: Any, path: str, depth: int = 0) -> Any:
    """Any msgpack-native plain data: what a JSON body could carry."""
    if v is None or type(v) in (bool, int, float, str):
        return v
    if depth >= _MAX_PLAIN_DEPTH:
        raise MessageError(f"{path}: nested deeper than {_MAX_PLAIN_DEPTH} levels")
    if type(v) is list:
        for i, x in enumerate(v):
            _check_plain(x, f"{path}[{i}]", depth + 1)
        return v
    if type(v) is dict:
        for k, x in v.items():
            if type(k) is not str:
                _fail(f"{path} key", "str", k)
            _check_plain(x, f"{path}.{k}", depth + 1)
        return v
    _fail(path, "plain data (None, bool, int, float, str, list, map)", v)


_SCALARS: dict[object, tuple[type, Checker]] = {
    int: (int, _check_int),
    float: (float, _check_float),
    str: (str, _check_str),
    bool: (bool, _check_bool),
    bytes: (bytes, _check_bytes),
}


def _scalar_set(tp: Any) -> frozenset[type] | None:
    """The exact element types that make `tp` valid as is (scalar or optional scalar)."""
    if tp in _SCALARS:
        return frozenset({_SCALARS[tp][0]})
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (Union, types.UnionType) and all(
        a in _SCALARS or a is type(None) for a in args
    ):
        return frozenset(_SCALARS[a][0] if a in _SCALARS else a for a in args)
    return None


def _fast_path(elem_tp: Any) -> Callable[[list], bool] | None:
    """A C-speed test (`set(map(type, ...))`) that a list needs no per-element work.

    Covers lists of scalars and lists of (optional) lists of scalars: token ids, logprobs.
    """
    flat = _scalar_set(elem_tp)
    if flat is not None:
        return lambda v: set(map(type, v)) <= flat
    origin, args = typing.get_origin(elem_tp), typing.get_args(elem_tp)
    outer: frozenset[type] = frozenset({list})
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        elem_tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(elem_tp), typing.get_args(elem_tp)
        outer = frozenset({list, type(None)})
    inner = _scalar_set(args[0]) if origin is list else None
    if inner is None:
        return None
    return lambda v: (
        set(map(type, v)) <= outer
        and set(map(type, itertools.chain.from_iterable(filter(None, v)))) <= inner
    )


def _list_checker(
    elem: Checker, fast: Callable[[list], bool] | None, optional: bool = False
) -> Checker:
    def check(v: Any, path: str) -> list:
        if type(v) is not list:
            _fail(path, "list", v)
        if fast is not None and fast(v):
            return v  # every element already has exactly the right type: keep the list
        if optional and v.count(None) == len(v):
            return v  # an optional column nobody filled (logprobs not requested)
        try:
            if optional:  # inlined: columns of optional records are mostly None
                return [None if x is None else elem(x, path) for x in v]
            return [elem(x, path) for x in v]
        except MessageError:
            for i, x in enumerate(v):
                if x is not None or not optional:
                    elem(x, f"{path}[{i}]")  # raises again, now naming the index
            raise

    return check


def _dict_checker(elem: Checker) -> Checker:
    def check(v: Any, path: str) -> dict:
        if type(v) is not dict:
            _fail(path, "map", v)
        out = {}
        for k, x in v.items():
            if type(k) is not str:
                _fail(f"{path} key", "str", k)
            out[k] = elem(x, f"{path}.{k}")
        return out

    return check


def _optional_checker(inner: Checker) -> Checker:
    return lambda v, path: None if v is None else inner(v, path)


def _union_checker(options: list[tuple[type, Checker]], names: str) -> Checker:
    def check(v: Any, path: str) -> Any:
        for t, inner in options:
            if type(v) is t:
                return inner(v, path)
        _fail(path, names, v)

    return check


def _literal_checker(allowed: tuple[object, ...]) -> Checker:
    def check(v: Any, path: str) -> Any:
        if type(v) in (str, int) and v in allowed:
            return v
        _fail(path, f"one of {list(allowed)}", v)

    return check


def compile_checker(tp: Any, record_base: type) -> Checker:
    """Build a checker for type hint `tp`; `record_base` is the class of nested records."""
    if tp in _SCALARS:
        return _SCALARS[tp][1]
    if tp is Any:
        return _check_plain
    if isinstance(tp, type) and issubclass(tp, record_base):
        return tp._from_wire  # type: ignore[attr-defined]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        elem_tp, optional = _strip_none(args[0])
        elem = compile_checker(elem_tp if optional else args[0], record_base)
        return _list_checker(elem, _fast_path(args[0]), optional)
    if origin is dict and args[0] is str:
        return _dict_checker(compile_checker(args[1], record_base))
    if origin is Literal:
        return _literal_checker(args)
    if origin in (Union, types.UnionType):
        return _compile_union(args, record_base)
    raise TypeError(f"unsupported type in a message schema: {tp!r}")


def _strip_none(tp: Any) -> tuple[Any, bool]:
    """(X, True) for `X | None` with a single X, else (tp, False)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (Union, types.UnionType) and len(args) == 2:
        if type(None) in args:
            return next(a for a in args if a is not type(None)), True
    return tp, False


def _compile_union(args: tuple[Any, ...], record_base: type) -> Checker:
    rest = [a for a in args if a is not type(None)]
    if len(rest) == 1:
        inner = compile_checker(rest[0], record_base)
        return _optional_checker(inner) if len(rest) < len(args) else inner
    if not all(a in _SCALARS for a in rest):
        raise TypeError(f"unions other than of scalars and None are unsupported: {args!r}")
    options = [(_SCALARS[a][0], _SCALARS[a][1]) for a in rest]
    names = " or ".join(a.__name__ for a in rest)
    checker = _union_checker(options, names)
    return _optional_checker(checker) if len(rest) < len(args) else checker
