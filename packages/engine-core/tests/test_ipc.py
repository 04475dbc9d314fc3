"""The msgpack codec of loom.ipc: every message kind, and every struct it nests, round-trips.

Strategies are derived from each struct's type hints, so a new message kind (or a new field
of a type the derivation does not know) fails here until it is covered. SamplingParams
validates itself, so it has a hand-written strategy of valid values.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loom.ipc import codec, messages
from loom_plugin_api import LoRARequest, SamplingParams
from loom_plugin_api.step import ModelRunnerOutput

INT64 = st.integers(-(2**63), 2**63 - 1)
INTS = st.one_of(INT64, st.integers(0, 2**64 - 1))  # msgpack's range: int64 and uint64
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
SHORT = {"max_size": 3}


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.none() | st.integers(1, 2**31))
    n = draw(st.integers(1, 8))
    return SamplingParams(
        n=n,
        temperature=draw(st.floats(0, 1e6) | st.just(math.inf)),
        top_p=draw(st.floats(0, 1, exclude_min=True)),
        top_k=draw(st.integers(0, 2**31)),
        seed=draw(st.none() | st.integers(-(2**63), 2**64 - n)),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens or 2**31)),
        stop=draw(st.lists(st.text(min_size=1), **SHORT)),
        stop_token_ids=draw(st.lists(st.integers(0, 2**63), **SHORT)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.none() | st.integers(0, 20)),
        prompt_logprobs=draw(st.none() | st.integers(0, 20)),
        repetition_penalty=draw(st.floats(0, 1e6, exclude_min=True)),
        presence_penalty=draw(st.floats(-2, 2)),
        frequency_penalty=draw(st.floats(-2, 2)),
        skip_special_tokens=draw(st.booleans()),
        include_stop_str_in_output=draw(st.booleans()),
    )


HAND_WRITTEN: dict[type, st.SearchStrategy[Any]] = {
    SamplingParams: sampling_params(),
    LoRARequest: st.builds(LoRARequest, st.text(min_size=1), st.integers(1, 2**63 - 1), st.text(min_size=1)),
}
SCALARS: dict[Any, st.SearchStrategy[Any]] = {
    int: INTS, float: FLOATS, str: st.text(), bool: st.booleans(), bytes: st.binary(), type(None): st.none(),
}


def strategy(tp: Any) -> st.SearchStrategy[Any]:
    """Values of type ``tp``, for the types messages may use; any other type is an error."""
    if tp in HAND_WRITTEN:
        return HAND_WRITTEN[tp]
    if tp in SCALARS:
        return SCALARS[tp]
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = {f.name: strategy(hints[f.name]) for f in dataclasses.fields(tp) if f.init}
        return st.builds(tp, **fields)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return st.one_of(*map(strategy, args))
    if origin is list:
        return st.lists(strategy(args[0]), **SHORT)
    if origin is dict:
        return st.dictionaries(strategy(args[0]), strategy(args[1]), **SHORT)
    raise TypeError(f"no strategy for {tp!r}: teach test_ipc.strategy this type (and the codec, if needed)")


def structs(tp: Any, seen: set[type] | None = None) -> set[type]:
    """``tp`` and every dataclass nested in its fields."""
    seen = set() if seen is None else seen
    if dataclasses.is_dataclass(tp) and tp not in seen:
        seen.add(tp)
        for hint in typing.get_type_hints(tp).values():
            structs(hint, seen)
    for arg in typing.get_args(tp):
        structs(arg, seen)
    return seen


ALL_STRUCTS = sorted(set().union(*map(structs, messages.BODY_TYPES.values())), key=lambda t: t.__qualname__)


def same(a: Any, b: Any) -> bool:
    """Equal in value and in type at every level (1 is not 1.0 nor True); NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, list):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        keys = {(type(k), k) for k in a}
        return keys == {(type(k), k) for k in b} and all(same(v, b[k]) for k, v in a.items())
    return bool(a == b)


def test_every_kind_constant_has_a_body_type() -> None:
    kinds = set(messages.Kind) - set(messages.SUPERVISOR_KINDS)
    assert kinds == set(messages.BODY_TYPES)
    assert len(messages.KIND_OF) == len(messages.BODY_TYPES)  # one kind per struct: a sender names none


def test_every_struct_of_messages_py_is_sent_somewhere() -> None:
    own = {v for v in vars(messages).values()
           if dataclasses.is_dataclass(v) and v.__module__ == messages.__name__}
    sent = set(ALL_STRUCTS) | {tp for tp in messages.SUPERVISOR_KINDS.values() if tp is not None}
    assert own <= sent, own - sent


@pytest.mark.parametrize("tp", ALL_STRUCTS, ids=lambda t: t.__qualname__)
def test_every_struct_has_a_strategy(tp: type) -> None:
    strategy(tp)  # raises TypeError naming the type it cannot build


@pytest.mark.parametrize("kind", sorted(messages.BODY_TYPES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_kind_round_trips(kind: str, data: st.DataObject) -> None:
    tp = messages.BODY_TYPES[kind]
    msg = data.draw(strategy(tp), label=tp.__qualname__)
    wire = messages.encode(msg)
    assert same(messages.decode_body(kind, wire), msg)
    assert same(codec.decode(tp, wire), msg)


@pytest.mark.parametrize("tp", ALL_STRUCTS, ids=lambda t: t.__qualname__)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_nested_struct_round_trips(tp: type, data: st.DataObject) -> None:
    msg = data.draw(strategy(tp), label=tp.__qualname__)
    assert same(codec.decode(tp, codec.encode(msg)), msg)


def test_wire_layout_is_an_array_in_declaration_order() -> None:
    # Both sides must agree with peers built from other revisions: pin the layout itself.
    info = messages.WorkerInfo(rank=1, available_bytes=2**40, block_bytes=4096, block_size=16)
    assert codec.encode(info) == msgpack.packb([1, 2**40, 4096, 16])
    out = messages.EngineOutputs(errors=[messages.RequestError(request_id="r", message="bad")])
    assert msgpack.unpackb(codec.encode(out)) == [[], [["r", "bad", 400]], None]


def test_a_body_of_the_wrong_shape_is_an_error_naming_the_struct() -> None:
    wire = codec.encode(messages.InitCache(num_blocks=1, block_size=16))
    with pytest.raises(ValueError, match="EngineReady expects 2 fields"):
        messages.decode_body(messages.Kind.ENGINE_READY, msgpack.packb([1, 2, 3]))
    with pytest.raises(ValueError, match="unknown message kind 'NOPE'"):
        messages.decode_body("NOPE", wire)


@pytest.mark.parametrize("tp", ALL_STRUCTS, ids=lambda t: t.__qualname__)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_field_of_the_wrong_type_is_an_error_naming_it(tp: type, data: st.DataObject) -> None:
    """Every body is type-checked when decoded: a peer's bad value is refused at the door, naming the field."""
    wire = msgpack.unpackb(codec.encode(data.draw(strategy(tp), label=tp.__qualname__)), strict_map_key=False)
    hints = typing.get_type_hints(tp)
    for i, f in enumerate(f for f in dataclasses.fields(tp) if f.init):
        is_dict = typing.get_origin(hints[f.name]) is dict
        for bad in (["not a dict"] if is_dict else [{"x": 1}, [{"x": 1}]]):
            if bad == [{"x": 1}] and typing.get_origin(hints[f.name]) is not list:
                continue
            if bad == [{"x": 1}] and dataclasses.is_dataclass(typing.get_args(hints[f.name])[0]):
                bad = [["not", "a", "struct", "of", "this", "size", "at", "all", "!"]]
            forged = [*wire[:i], bad, *wire[i + 1:]]
            with pytest.raises(ValueError, match=rf"^{tp.__name__}\.{f.name}: "):
                codec.decode(tp, msgpack.packb(forged))


def test_wrong_types_that_python_would_coerce_are_refused() -> None:
    add = messages.AddRequest(request_id="r", prompt=None, prompt_token_ids=[1, 2], sampling_params=SamplingParams())
    wire = msgpack.unpackb(codec.encode(add))
    for i, bad, field in [(2, "abc", "prompt_token_ids"), (2, [1, True], "prompt_token_ids"), (0, 5, "request_id"),
                          (4, 1, "stream")]:
        with pytest.raises(ValueError, match=rf"^AddRequest\.{field}: expected"):
            codec.decode(messages.AddRequest, msgpack.packb([*wire[:i], bad, *wire[i + 1:]]))
    with pytest.raises(ValueError, match=r"^AbortRequests\.request_ids: expected list, got int 5"):
        messages.decode_body(messages.Kind.ABORT, msgpack.packb([5]))
    wire[3][0] = -5  # the struct's own check: SamplingParams.n >= 1
    with pytest.raises(ValueError, match=r"^AddRequest\.sampling_params: SamplingParams: n must be >= 1"):
        codec.decode(messages.AddRequest, msgpack.packb(wire))


def test_a_subclass_of_a_message_travels_as_its_base() -> None:
    class PlatformOutput(ModelRunnerOutput):
        pass

    out = PlatformOutput(req_ids=["a"], sampled_token_ids=[3])
    assert messages.kind_of(out) is messages.Kind.MODEL_OUTPUT
    with pytest.raises(TypeError, match="dict is not a message type"):
        messages.kind_of({})


class _Frames:
    """A connection that hands the channel prepared frames."""

    def __init__(self, frames: list) -> None:
        self.frames = frames

    def recv(self, timeout: float | None = None):
        return self.frames.pop(0) if self.frames else None


def test_a_peer_died_report_that_does_not_decode_still_says_a_process_died() -> None:
    from loom.ipc.channel import Channel
    from loom_supervisor import client

    good = msgpack.packb({"role": "worker", "rank": 1, "pid": 7, "exit_code": None, "signal": "SIGKILL",
                          "phase": "running", "reason": "", "stderr_tail": ["boom"]})
    channel = Channel(_Frames([
        client.Frame(1, "supervisor", "frontend", "PEER_DIED", good),
        client.Frame(1, "supervisor", "frontend", "PEER_DIED", b"\xc1"),  # not msgpack
        client.Frame(1, "supervisor", "frontend", "NOPE", b""),  # unknown kind: dropped
        client.Frame(1, "engine_core", "frontend", "ENGINE_READY", messages.encode(
            messages.EngineReady(num_blocks=4, block_size=16))),
    ]), "frontend")
    first, second, third = channel.recv(0), channel.recv(0), channel.recv(0)
    assert first.kind is messages.Kind.PEER_DIED and first.body.describe().startswith("worker:1 (pid 7) died")
    assert second.kind is messages.Kind.PEER_DIED and second.body is None
    assert isinstance(third.body, messages.EngineReady) and channel.recv(0) is None
