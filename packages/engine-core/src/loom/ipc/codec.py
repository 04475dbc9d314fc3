"""A typed msgpack codec for dataclass messages.

A message travels as a msgpack array of its field values in declaration order (nested
dataclasses the same way), so the wire stays compact and each side rebuilds the exact
typed struct from the class's annotations. Only the types messages use are supported:
None, bool, int, float, str, bytes, list[X], dict[K, X], X | None, and dataclasses.
Encoders and decoders are compiled once per type: this runs every engine step.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")
_Fn = Callable[[Any], Any]


def _identity(x: Any) -> Any:
    return x


def _is_plain(fn: _Fn) -> bool:
    return fn is _identity


def _containers(tp: Any, compile: Callable[[Any], _Fn]) -> _Fn:
    """The (de)coder of an optional, a list or a dict: the same shape both ways."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            fn = compile(inner[0])
            return _identity if _is_plain(fn) else (lambda x: None if x is None else fn(x))
    elif origin is list:
        fn = compile(args[0])
        return _identity if _is_plain(fn) else (lambda xs: [fn(x) for x in xs])
    elif origin is dict:
        fn = compile(args[1])
        return _identity if _is_plain(fn) else (lambda d: {k: fn(v) for k, v in d.items()})
    return _identity


@functools.cache
def _encoder(tp: Any) -> _Fn:
    if dataclasses.is_dataclass(tp):
        fields = [(f.name, _encoder(_hints(tp)[f.name])) for f in _fields(tp)]
        return lambda obj: [enc(getattr(obj, name)) for name, enc in fields]
    return _containers(tp, _encoder)


@functools.cache
def _decoder(tp: Any) -> _Fn:
    if dataclasses.is_dataclass(tp):
        fields = [(f.name, _decoder(_hints(tp)[f.name])) for f in _fields(tp)]
        n = len(fields)

        def decode_struct(data: Any) -> Any:
            if not isinstance(data, list) or len(data) != n:
                raise ValueError(f"{tp.__name__} expects {n} fields, got {data!r:.200}")
            return tp(**{name: dec(v) for (name, dec), v in zip(fields, data)})

        return decode_struct
    return _containers(tp, _decoder)


def to_wire(obj: Any) -> Any:
    return _encoder(type(obj))(obj)


def from_wire(tp: type[T], data: Any) -> T:
    return _decoder(tp)(data)


def encode(obj: Any) -> bytes:
    return msgpack.packb(to_wire(obj), use_bin_type=True)


def decode(tp: type[T], payload: bytes) -> T:
    return from_wire(tp, msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True))


@functools.cache
def _fields(tp: type) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(tp) if f.init)


@functools.cache
def _hints(tp: type) -> dict[str, Any]:
    return typing.get_type_hints(tp)
