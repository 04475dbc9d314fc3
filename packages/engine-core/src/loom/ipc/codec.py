"""A typed msgpack codec for dataclass messages.

A message travels as a msgpack array of its field values in declaration order (nested
dataclasses the same way), so the wire stays compact and each side rebuilds the exact
typed struct from the class's annotations. Only the types messages use are supported:
None, bool, int, float, str, bytes, list[X], dict[K, X], X | None, and dataclasses.
Encoders and decoders are compiled once per type: this runs every engine step.

Decoding checks every value against its annotation (an ``int`` is an int and not a bool, a
``list[int]`` a list of them, ...), so a peer's bad body is a ``ValueError`` naming the
field at the receiver's door, never a struct that fails somewhere deep in the engine.
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


_LEAVES: dict[Any, tuple[type, ...]] = {int: (int,), float: (float, int), str: (str,), bool: (bool,),
                                        bytes: (bytes,), type(None): (type(None),)}
"""What a value of each leaf annotation may be on the wire (exact types: a bool is not an int)."""


def _bad(tp: Any, value: Any) -> ValueError:
    name = getattr(tp, "__name__", None) or str(tp)
    return ValueError(f"expected {name}, got {type(value).__name__} {value!r:.100}")


def _allowed(tp: Any) -> frozenset[type] | None:
    """The wire types of a leaf annotation or a union of leaves; None for anything else."""
    origin = typing.get_origin(tp)
    members = typing.get_args(tp) if origin in (types.UnionType, typing.Union) else (tp,)
    if not all(m in _LEAVES for m in members):
        return None
    return frozenset(t for m in members for t in _LEAVES[m])


def _leaf_check(tp: Any) -> _Fn | None:
    """The decoder of a leaf annotation or a union of leaves; None for anything else."""
    allowed = _allowed(tp)
    if allowed is None:
        return None

    def check(x: Any) -> Any:
        if type(x) not in allowed:
            raise _bad(tp, x)
        return x

    return check


def _struct_decoder(tp: Any) -> _Fn:
    """A decoder generated for one dataclass: leaves and lists of leaves checked inline (this
    runs for every request of every step), nested structs through their own decoders."""
    fields = [(f.name, _hints(tp)[f.name]) for f in _fields(tp)]
    per_field = [(name, _decoder(ftp)) for name, ftp in fields]
    n = len(fields)
    ns: dict[str, Any] = {"tp": tp, "_struct_error": _struct_error, "per_field": per_field}
    checks, kwargs = [], []
    for i, (name, ftp) in enumerate(fields):
        allowed = _allowed(ftp)
        args = typing.get_args(ftp)
        items = _allowed(args[0]) if typing.get_origin(ftp) is list else None
        if allowed is not None:
            ns[f"A{i}"] = allowed
            checks.append(f"type(v{i}) in A{i}")
            kwargs.append(f"{name}=v{i}")
        elif items is not None:  # token ids and the like: checked in place by C loops, not copied
            ns[f"A{i}"] = items
            checks.append(f"(type(v{i}) is list and all(map(A{i}.__contains__, map(type, v{i}))))")
            kwargs.append(f"{name}=v{i}")
        else:
            ns[f"D{i}"] = per_field[i][1]
            kwargs.append(f"{name}=D{i}(v{i})")
    unpack = f"    {''.join(f'v{i}, ' for i in range(n))}= data\n" if n else ""
    check = f"    if not ({' and '.join(checks)}):\n        raise TypeError('bad field')\n" if checks else ""
    source = (
        "def decode_struct(data):\n"
        f"    if type(data) is not list or len(data) != {n}:\n"
        f"        raise ValueError(f'{tp.__name__} expects {n} fields, got {{data!r:.200}}')\n"
        "    try:\n"
        + "".join("    " + line + "\n" for line in (unpack + check).splitlines())
        + f"        return tp({', '.join(kwargs)})\n"
        "    except (ValueError, TypeError) as e:  # TypeError: a field's type, or a __post_init__'s check\n"
        f"        raise _struct_error(tp, per_field, data, e) from None\n"
    )
    exec(compile(source, f"<decoder of {tp.__name__}>", "exec"), ns)
    return ns["decode_struct"]


@functools.cache
def _decoder(tp: Any) -> _Fn:
    if dataclasses.is_dataclass(tp):
        return _struct_decoder(tp)
    leaf = _leaf_check(tp)
    if leaf is not None:
        return leaf
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            fn = _decoder(inner[0])
            return lambda x: None if x is None else fn(x)
    elif origin is list:
        allowed = _allowed(args[0])
        if allowed is not None:  # token ids and the like: checked in place, not copied

            def check_list(xs: Any) -> list[Any]:
                if type(xs) is not list:
                    raise _bad(tp, xs)
                if not all(map(allowed.__contains__, map(type, xs))):  # C loops: this runs per step
                    raise _bad(args[0], next(x for x in xs if type(x) not in allowed))
                return xs

            return check_list
        item = _decoder(args[0])

        def decode_list(xs: Any) -> list[Any]:
            if type(xs) is not list:
                raise _bad(tp, xs)
            return [item(x) for x in xs]

        return decode_list
    elif origin is dict:
        key, value = _decoder(args[0]), _decoder(args[1])

        def decode_dict(d: Any) -> dict[Any, Any]:
            if type(d) is not dict:
                raise _bad(tp, d)
            return {key(k): value(v) for k, v in d.items()}

        return decode_dict
    return _identity


def _struct_error(tp: type, fields: list[tuple[str, _Fn]], data: list[Any], error: Exception) -> ValueError:
    """The error of a struct that does not decode, naming the first field that does not."""
    for (name, dec), value in zip(fields, data):
        try:
            dec(value)
        except (ValueError, TypeError) as e:
            return ValueError(f"{tp.__name__}.{name}: {e}")
    return ValueError(f"{tp.__name__}: {error}")  # the struct's own check refused the values


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
