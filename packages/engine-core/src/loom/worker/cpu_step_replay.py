"""A decode step, recorded once and replayed: the CPU's counterpart of CUDA graphs.

A decode step of a given number of requests runs the same kernels on the same buffers every
time; what changes is a handful of values (the tokens, their positions and cache slots, the
context lengths, the block tables). Run eagerly, one stream's step of the default model spends
more time in Python (modules, ops, argument checks, allocations) around its ~300 kernel calls
than in them; a batch's step, about a tenth of its time, in which the kernels' other threads
wait.

:class:`StepGraph` captures a step: it runs the model once, eagerly, on static input tensors,
and records in order every compiled-kernel call (``attention.backends.native.call``: the
function and its plain-int arguments) and every torch op that computes (a
``TorchDispatchMode``). Views and allocations are not recorded: their results are the step's
buffers, which the graph keeps alive. A replay writes the new inputs into the static tensors
and repeats the list; each run of compiled-kernel calls that ``platforms/cpu_tape.c`` can make
goes in one call into C (``tape_run``: about 1.5 us of Python a call otherwise), the others stay
ctypes calls. Capture is refused (``StepGraph.capture`` returns no graph and says why)
where the step reads a tensor into Python (``.item()``), builds a tensor from Python data
(``torch.tensor``, ``torch.from_numpy``: ``lift_fresh``) or draws random numbers: a replay would
repeat the captured value. A Python value passed straight to a kernel (an int argument computed
from the step's data) is invisible to both, so the first replay is checked against an eager run
of the same step (:meth:`StepGraph.check`) before replays are trusted. Python values the step takes
from the attention metadata's lists are baked in, so the captured metadata holds bounds
there (``seq_lens_list`` and ``max_seq_len`` are the capacity), and only a backend whose
decode path reads the lengths from tensors is captured (the CPU's ``TorchSDPABackend`` and its
int8 variant, where their decode rows run in a compiled kernel: ``decodes_in_kernel``).
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from loom_plugin_api import AttentionMetadata, set_forward_context
from torch.utils._python_dispatch import TorchDispatchMode

from ..attention.backends import native
from ..logger import init_logger
from ..platforms import cpu_kernels

logger = init_logger(__name__)

__all__ = ["Capture", "StepGraph", "StepReplayError"]

aten = torch.ops.aten
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                aten.new_empty.default, aten.new_empty_strided.default}
_FROM_PYTHON = {aten._local_scalar_dense.default, aten.lift_fresh.default, aten.lift_fresh_copy.default,
                aten.lift.default, aten.is_nonzero.default, aten.equal.default}


class StepReplayError(RuntimeError):
    """A replayed kernel returned an error code (out of memory, a position outside the rotary
    cache): the step's result is not usable."""


def _storage(t: object) -> int | None:
    # (a oneDNN-packed weight is opaque: it has no storage, and no kernel takes a pointer into it)
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and not t.is_mkldnn else None


def _is_view(func: torch._ops.OpOverload, args: tuple, outs: Sequence[object]) -> bool:
    """Whether the op's results are views of its inputs: an op whose schema says it may alias
    (``to``, ``reshape``) copies where it has to, and then computes like any other."""
    if not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
        return False
    inputs = {_storage(a) for a in args} - {None}
    return all(_storage(o) in inputs for o in outs)


def _again(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> int:
    func(*args, **kwargs)  # mutates its captured arguments, as in the captured step
    return 0


def _again_into(func: torch._ops.OpOverload, args: tuple, kwargs: dict, outs: Sequence[torch.Tensor]) -> int:
    new = func(*args, **kwargs)
    for out, value in zip(outs, new if isinstance(new, (tuple, list)) else (new,)):
        out.copy_(value)
    return 0


def _again_repointed(func: torch._ops.OpOverload, args: tuple, kwargs: dict,
                     uses: Sequence[Sequence[tuple[Any, int, int]]], live: list[torch.Tensor]) -> int:
    """Run the op and point the compiled-kernel calls that read its results at the new tensors
    (``uses``, per result: the tape op's argument array, the argument, the byte offset), instead
    of copying the results into the captured buffers; ``live`` keeps them until the next replay."""
    new = func(*args, **kwargs)
    live[:] = new if isinstance(new, (tuple, list)) else (new,)
    for value, points in zip(live, uses):
        base = value.data_ptr()
        for ints, i, offset in points:
            ints[i] = base + offset
    return 0


class _Recorder(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch otherwise wraps __torch_dispatch__ in dynamo's "disable", whose first call
        # imports torch._dynamo: 2 s and tens of MB in a worker that never compiles
        return False

    def __init__(self, ops: list, max_bytes: int | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.keep: list[Any] = []  # every tensor the step made: the kernels' int pointers point into them
        self.refused: str | None = None
        self.made: set[int] = set()  # the graph's storages: its static inputs, what the step allocated
        self.nbytes = 0  # their bytes
        self.max_bytes = max_bytes
        self.too_large = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's protocol)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.refused is not None:
            return out  # the rest of the step runs eagerly, nothing kept
        self.keep.append(out)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if func in _FROM_PYTHON or torch.Tag.nondeterministic_seeded in func.tags \
                or not all(isinstance(o, torch.Tensor) for o in outs):
            # (before the view test: lift_fresh, a tensor of Python data, "aliases" its input)
            self.refused = self.refused or f"the step runs {func} (a value from or to Python, or random numbers)"
        elif func in _ALLOCATIONS:
            self.count_buffers(outs)
        elif _is_view(func, args, outs):
            return out
        elif func._schema.is_mutable:
            self.ops.append((_again, (func, args, kwargs)))
        else:
            self.count_buffers(outs)
            self.ops.append((_again_into, (func, args, kwargs, outs)))
        return out

    def count_buffers(self, tensors: Sequence[torch.Tensor]) -> None:
        """Count ``tensors``' storages among the graph's buffers; recording stops where they pass
        ``max_bytes``."""
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.made:
                self.made.add(storage.data_ptr())
                self.nbytes += storage.nbytes()
        if self.max_bytes is not None and self.nbytes > self.max_bytes:
            self.too_large = True
            self.refused = f"the step's buffers exceed {self.max_bytes / (1 << 20):.0f} MiB"
            self.keep.clear()


_TAPE_INTS = 20  # cpu_tape.c's TAPE_INTS
_INT_CLASS = {ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int, ctypes.c_size_t, ctypes.c_ssize_t}


class _TapeOp(ctypes.Structure):
    """``tape_op`` of ``cpu_tape.c``: a kernel, its integer-class arguments in order, its float."""

    _fields_ = [("fn", ctypes.c_void_p), ("a", ctypes.c_int64 * _TAPE_INTS), ("f", ctypes.c_float),
                ("unused", ctypes.c_int32)]


def _tape_op(fn: object, args: tuple) -> _TapeOp | None:
    """The call as a ``tape_op``; None where ``cpu_tape.c`` cannot make it: not a compiled kernel
    returning a C ``int`` (no ``errcheck``), more integer arguments than it passes, more than one
    float, an argument of another ctypes type, or a value that is not a plain int (None for a
    null pointer) within int64."""
    types = getattr(fn, "argtypes", None)
    if (not isinstance(fn, ctypes._CFuncPtr) or types is None or len(types) != len(args)
            or fn.restype is not ctypes.c_int or getattr(fn, "errcheck", None) is not None):
        return None
    ints, floats = [], []
    for tp, value in zip(types, args):
        if tp in _INT_CLASS:
            if value is None and tp is ctypes.c_void_p:
                value = 0
            if type(value) is not int or not -(1 << 63) <= value < 1 << 63:
                return None
            ints.append(value)
        elif tp is ctypes.c_float and type(value) in (int, float):
            floats.append(float(value))
        else:
            return None
    if len(ints) > _TAPE_INTS or len(floats) > 1:
        return None
    op = _TapeOp(fn=ctypes.cast(fn, ctypes.c_void_p).value, f=floats[0] if floats else 0.0)
    op.a[:len(ints)] = ints
    return op


class _Tape:
    """Consecutive compiled-kernel calls of a captured step, made in one ctypes call (``tape_run``).
    ``bench/roofline.py`` makes them one by one (:meth:`call_one`) to name them in its profile;
    ``_calls`` holds each call's function and its arguments as captured (a repointed pointer,
    see :func:`_repointed`, changes in ``_ops`` only)."""

    def __init__(self, run: Callable[..., int], calls: list[tuple[Any, tuple]], ops: list[_TapeOp]) -> None:
        self._run = run
        self._calls = calls
        self._ops = (_TapeOp * len(ops))(*ops)
        self._n = len(ops)
        self._failed = ctypes.c_int64(-1)
        self._failed_ref = ctypes.byref(self._failed)

    def __call__(self) -> int:
        if self._run(self._ops, self._n, self._failed_ref):
            fn = self._calls[self._failed.value][0]
            raise StepReplayError(f"{getattr(fn, '__name__', fn)} failed in a replayed decode step")
        return 0

    def call_one(self, i: int) -> int:
        """Make the ``i``-th call alone: its kernel's return code."""
        return self._run(ctypes.byref(self._ops, i * ctypes.sizeof(_TapeOp)), 1, self._failed_ref)


def _taped(ops: list[tuple[Callable[..., int], tuple]]) -> list[tuple[Callable[..., int], tuple]]:
    """``ops`` with each run of compiled-kernel calls made one ``tape_run`` call, where the CPU
    kernels (``cpu_tape.c``) are built; the torch ops between them stay as they are."""
    k = cpu_kernels.kernels()
    run = getattr(k, "tape_run", None)
    if run is None or k.tape_op_size != ctypes.sizeof(_TapeOp):
        return ops
    out: list[tuple[Callable[..., int], tuple]] = []
    calls: list[tuple[Any, tuple]] = []
    encoded: list[_TapeOp] = []

    def flush() -> None:
        if calls:
            out.append((_Tape(run, list(calls), list(encoded)), ()))
            calls.clear()
            encoded.clear()

    for fn, args in ops:
        op = _tape_op(fn, args)
        if op is None:
            flush()
            out.append((fn, args))
        else:
            calls.append((fn, args))
            encoded.append(op)
    flush()
    return out


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors in an op's arguments (nested in lists, tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _repointed(ops: list[tuple[Callable[..., int], tuple]], runs: list[tuple[Callable[..., int], tuple]],
               keep: list[Any], output: torch.Tensor, held: Sequence[torch.Tensor] = ()) -> None:
    """``runs`` with every torch op whose results only compiled kernels on a tape read (a linear
    layer's, between RMSNorm and the attention kernels) made :func:`_again_repointed`: a replay
    then points those kernels at the op's new results rather than copying them into the captured
    buffers, which leave ``keep`` (and ``ops``, where the op is swapped too). A result is still
    copied where a torch op, a ctypes call made from Python or the step's output reads it, and
    where the model keeps a tensor of it (``held``: what its modules hold after the step, which
    would otherwise keep the captured value). A result's storage is new in the captured step
    (``keep`` holds every buffer, so none is reused), so any tape argument inside it is a pointer
    into it."""
    ints: list[tuple[int, Any, int]] = []  # (value, the tape op's argument array, index)
    pinned = {_storage(output), *(_storage(t) for t in held)}  # storages read other than through a tape
    loose: list[int] = []  # integer arguments of ctypes calls made from Python
    for fn, args in runs:
        if isinstance(fn, _Tape):
            for op in fn._ops:
                ints += [(v, op.a, i) for i, v in enumerate(op.a)]
        elif fn is _again or fn is _again_into:
            pinned.update(_storage(t) for t in _tensors(args[1:3]))
        else:
            loose += [v for v in args if type(v) is int]
            pinned.update(_storage(t) for t in _tensors(args))
    ints.sort(key=lambda e: e[0])
    values = [v for v, _, _ in ints]
    swapped, dropped = {}, set()
    for fn, args in runs:
        if fn is not _again_into:
            continue
        func, op_args, op_kwargs, results = args
        uses = []
        for r in results:
            storage = r.untyped_storage()
            start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
            if (start in pinned or r.storage_offset() or not r.is_contiguous()
                    or any(start <= v < end for v in loose)):
                break
            uses.append([(a, i, v - start) for v, a, i in ints[bisect.bisect_left(values, start):
                                                                 bisect.bisect_left(values, end)]])
        else:
            swapped[id(args)] = (_again_repointed, (func, op_args, op_kwargs, uses, []))
            dropped.update(_storage(r) for r in results)
    runs[:] = [swapped.get(id(args), (fn, args)) for fn, args in runs]  # (_taped made new pairs of the
    ops[:] = [swapped.get(id(args), (fn, args)) for fn, args in ops]    # same arguments)
    keep[:] = [k for k in keep if not any(_storage(t) in dropped for t in _tensors(k))]


class Capture(NamedTuple):
    """What :meth:`StepGraph.capture` gives."""

    graph: StepGraph | None
    output: torch.Tensor
    """The step's hidden states (``(batch, hidden)``)."""
    why: str
    """Why ``graph`` is None ("" where it is not)."""
    too_large: bool
    """Whether that is because the graph's buffers passed ``max_bytes``."""


class StepGraph:
    """A captured decode step of ``batch`` requests of one token each (see the module)."""

    def __init__(self, ops: list[tuple[Callable[..., int], tuple]], keep: list[Any], inputs: dict[str, torch.Tensor],
                 output: torch.Tensor, max_blocks: int, nbytes: int, held: Sequence[torch.Tensor] = ()) -> None:
        self._ops = ops
        """The recorded calls, repointed ops swapped in; compiled-kernel calls keep their captured
        arguments, which may point into released buffers: replay ``_runs``, never these."""
        self._runs = _taped(ops)
        """What a replay calls: ``ops``, each run of compiled-kernel calls in one ``tape_run``, the
        torch ops that only those read repointing them (:func:`_repointed`)."""
        _repointed(ops, self._runs, keep, output, held)
        self._keep = keep
        self._inputs = inputs
        self.output = output
        """The step's hidden states ``(batch, hidden)``, rewritten by every replay."""
        self.max_blocks = max_blocks
        """The longest block table a replay takes (the model's context length)."""
        self.nbytes = nbytes
        """The memory the graph keeps alive: the buffers the step allocated and its static inputs."""
        self.checked = False
        """Whether a replay was found to give what the eager step gives (:meth:`check`); the
        runner sets it."""

    @property
    def batch(self) -> int:
        """The requests (one token each) of the steps it replays."""
        return self._inputs["seq_lens"].shape[0]

    @property
    def num_ops(self) -> int:
        return len(self._ops)

    @classmethod
    def capture(cls, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                max_blocks: int, max_bytes: int | None = None) -> Capture:
        """Run ``model`` on this decode step (one token per request) and record it. The hidden
        states are the step's answer either way (the capture is an eager run). Where the graph's
        buffers (its static inputs and what the step allocates) pass ``max_bytes``, recording
        stops there (``Capture.too_large``) and the rest of the step runs as an eager one."""
        if md.max_query_len != 1 or md.num_tokens != md.num_reqs or md.block_tables.shape[1] > max_blocks:
            raise ValueError(f"StepGraph captures decode steps (one token per request) with a block table of at most "
                             f"{max_blocks} blocks, not {md.num_tokens} tokens for {md.num_reqs} requests and "
                             f"{md.block_tables.shape[1]} blocks")
        static = {
            "input_ids": input_ids.clone(), "positions": positions.clone(),
            "query_start_loc": md.query_start_loc.clone(), "seq_lens": md.seq_lens.clone(),
            "slot_mapping": md.slot_mapping.clone(),
            "block_tables": md.block_tables.new_zeros(md.num_reqs, max_blocks),
        }
        static["block_tables"][:, : md.block_tables.shape[1]] = md.block_tables
        capacity = max_blocks * md.block_size
        static_md = AttentionMetadata(
            num_reqs=md.num_reqs, num_tokens=md.num_tokens, query_start_loc=static["query_start_loc"],
            seq_lens=static["seq_lens"], query_lens=list(md.query_lens), seq_lens_list=[capacity] * md.num_reqs,
            max_query_len=1, max_seq_len=capacity, block_tables=static["block_tables"],
            slot_mapping=static["slot_mapping"], block_size=md.block_size,
        )
        ops: list = []
        recorder = _Recorder(ops, max_bytes)
        recorder.count_buffers(list(static.values()))
        native.tape = ops
        try:
            with recorder, set_forward_context(static_md, None):
                output = model(static["input_ids"], static["positions"])
        finally:
            native.tape = None
        why = recorder.refused
        if why is None and not any(isinstance(fn, ctypes._CFuncPtr) for fn, _ in ops):
            why = "the step calls no compiled kernel (nothing to gain)"
        if why is not None:
            return Capture(None, output, why, recorder.too_large)
        # what the modules hold after the step (the step's results a module kept among them)
        held = [t for m in model.modules() for t in _tensors(list(vars(m).values())) if not t.is_mkldnn]
        graph = cls(ops, recorder.keep + [static_md], static, output, max_blocks, recorder.nbytes, held)
        return Capture(graph, output, "", False)

    def fits(self, md: AttentionMetadata) -> bool:
        return (md.num_reqs == self.batch and md.num_tokens == md.num_reqs
                and md.max_query_len == 1 and md.block_tables.shape[1] <= self.max_blocks)

    def check(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
              md: AttentionMetadata) -> tuple[torch.Tensor, bool]:
        """Run this step replayed and eagerly: ``(the eager hidden states, whether the replay
        gave exactly them)``. A Python value the step passes straight to a kernel is invisible to
        the capture and would be replayed as captured; comparing one step both ways catches what
        changes from step to step. The eager run goes second, so what it writes (this token's
        K/V) is what stays, whatever the replay wrote."""
        replayed = self.replay(input_ids, positions, md).clone()
        with set_forward_context(md, None):
            eager = model(input_ids, positions)
        return eager, torch.equal(replayed, eager)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """This step's hidden states (``self.output``), for inputs that :meth:`fits`."""
        s = self._inputs
        s["input_ids"].copy_(input_ids)
        s["positions"].copy_(positions)
        s["seq_lens"].copy_(md.seq_lens)
        s["slot_mapping"].copy_(md.slot_mapping)
        s["block_tables"][:, : md.block_tables.shape[1]].copy_(md.block_tables)
        for fn, args in self._runs:
            if fn(*args):
                raise StepReplayError(f"{getattr(fn, '__name__', fn)} failed in a replayed decode step")
        return self.output
