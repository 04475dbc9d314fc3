"""Linear layers with group-wise quantized weights (``--quantization gguf``, ``int4``, ``int8``).

A quantized layer's ``weight`` is a ``QuantizedLinear`` op (the contract's replaceable op, in
``loom_plugin_api.ops``) holding a ``QuantizedWeight``: uint8 codes and one fp32 scale and zero
per group along the input dimension, a weight being ``(q - 2**(bits-1)) * scale + zero``. The
layer multiplies through the op, so the platform's ``quantized_linear`` kernel runs it.

Loading: :func:`make_quantized_params` trades the layer's dense ``weight`` parameter for three
that load through the layer's own ``weight_loader`` (so tensor-parallel slicing and the fused
q/k/v and gate/up shards work unchanged): ``qweight`` (uint8 ``(out, in)``), ``qscale`` and
``qzero`` (fp32 ``(out, in / group)``). A GGUF file fills them with its blocks' values as they
are (``model_loader/gguf_quant.py``); :func:`quantize_rtn` makes them from a dense checkpoint
weight (round to nearest). :func:`finish_quantized` then builds the op.

The CPU platform's kernel (:func:`cpu_quantized_linear`, installed by ``CpuPlatform``) keeps
two layouts of the same weights (:class:`CpuQuantizedWeight`). Decoding a few streams is bound
by reading the weights, so up to ``QUANT_MAX_ROWS`` rows (``QUANT_INT8_MAX_ROWS`` for the
int8-activation kernels) multiply through a kernel that reads the codes: the C 4-bit and 8-bit
kernels (``cpu_kernels.c``; torch's int4 matmul, ``_weight_int4pack_mm_for_cpu``, where they
cannot be built). They dequantize per row (the int8-activation kernels round x instead), so
from a handful of rows on they fall far behind a GEMM (torch's int4 measured: equal at 2 rows,
10x slower at 64): larger batches (prefill, many streams) multiply through a dense copy of
the exact dequantized weights in the compute dtype, prepacked for oneDNN like any CPU linear.
Memory: the codes (0.56 bytes per weight at 4 bits with scales, 1.06 at 8) plus the dense copy
(2 bytes in bf16).

In fp32 the 4-bit kernels compute with the exact weights; in bf16 they hold scales and zeros in
bf16 (a fifth of the bytes a step reads at groups of 32), so their weights are exact to within
bf16 rounding of the scale and zero. The 8-bit kernel keeps them in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from loom_plugin_api import CustomOp
from loom_plugin_api.ops.quantized_linear import QuantizedLinear, QuantizedWeight

from . import onednn

__all__ = [
    "QPARAMS", "QUANT_INT8_MAX_ROWS", "QUANT_MAX_ROWS", "CpuQuantizedWeight", "cpu_quantized_linear",
    "finish_quantized", "int4_available", "make_quantized_params", "quantize_rtn", "runs_a_kernel",
]

QUANT_MAX_ROWS = 4
"""Rows (tokens) up to which a step multiplies through the codes; more use the dense copy."""
QUANT_INT8_MAX_ROWS = 8
"""The same for weights the int8-activation kernels run (``cpu_qdot.c``, AVX512-VNNI): a row
costs them integer dot products, not a dequantized weight, so they stay ahead of the dense copy
up to their 8-row tiles (``bench/decode_linears.py``, the default model's 120 linears at 8 rows:
7.4 against 18.4 ms on an AMX Xeon, 2026-12-05)."""
QPARAMS = ("qweight", "qscale", "qzero")
_INT4_GROUPS = (32, 64, 128, 256)  # group sizes torch's int4 packing takes
# the overload itself: calling it skips the packet's overload resolution, a few us of a decode step's 120 calls
_INT4_MM = getattr(getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None), "default", None)


def int4_available() -> bool:
    """Whether this torch has the CPU int4 packing and matmul."""
    aten = torch.ops.aten
    return hasattr(aten, "_convert_weight_to_int4pack_for_cpu") and hasattr(aten, "_weight_int4pack_mm_for_cpu")


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest ``(q, scale, zero)`` of an ``(out, in)`` weight, groups along ``in``.

    4 bits: asymmetric, each group's range ``[min, max]`` in 16 steps (as GGUF's Q4_1);
    8 bits: symmetric, ``absmax / 127`` per group (as Q8_0). Codes are uint8, offset by
    ``2**(bits-1)`` (``QuantizedWeight``'s form).
    """
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide the input width {in_features}")
    w = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    if bits == 4:
        lo, hi = w.amin(-1), w.amax(-1)  # (out, groups)
        scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        q = ((w - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15)
        zero = lo + 8 * scale  # (q - 8) * scale + zero == q * scale + lo
    elif bits == 8:
        scale = (w.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        q = (w / scale.unsqueeze(-1)).round().clamp(-127, 127) + 128
        zero = torch.zeros_like(scale)
    else:
        raise ValueError(f"round-to-nearest quantization takes 4 or 8 bits, got {bits}")
    return q.to(torch.uint8).reshape(out_features, in_features), scale, zero


def make_quantized_params(layer: nn.Module, group_size: int) -> bool:
    """Give ``layer`` (a ``LinearBase``) quantized parameters in place of its dense weight;
    False (and the layer unchanged) when its per-rank input width is not whole groups."""
    out_features, in_features = layer.weight.shape
    if in_features % group_size:
        return False
    loader = layer.weight.weight_loader
    del layer.weight
    shapes = {"qweight": ((out_features, in_features), torch.uint8),
              "qscale": ((out_features, in_features // group_size), torch.float32),
              "qzero": ((out_features, in_features // group_size), torch.float32)}
    for name, (shape, dtype) in shapes.items():
        param = nn.Parameter(torch.empty(shape, dtype=dtype, device="cpu"), requires_grad=False)
        param.weight_loader = loader  # type: ignore[attr-defined]
        layer.register_parameter(name, param)
    return True


def quantize_model(model: nn.Module, bits: int, group_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """Quantize every loaded linear layer of ``model`` in place (``--quantization int4`` / ``int8``);
    ``(quantized, kept dense)``: a layer whose per-rank input width is not whole groups stays dense."""
    # here, not at the top: linear.py imports onednn, which this module imports
    from .linear import LinearBase

    done = kept = 0
    for module in list(model.modules()):
        if not isinstance(module, LinearBase) or not isinstance(module.weight, torch.Tensor):
            continue
        if module.weight.shape[1] % group_size:
            kept += 1
            continue
        q, scale, zero = quantize_rtn(module.weight.data, bits, group_size)
        del module.weight
        module.qweight, module.qscale, module.qzero = (nn.Parameter(t, requires_grad=False) for t in (q, scale, zero))
        if finish_quantized(module, bits, dtype):
            done += 1
        else:
            kept += 1
    return done, kept


def runs_a_kernel(op: QuantizedLinear) -> bool:
    """Whether ``op`` computes through a platform's kernel or replacement class: not through
    ``forward_native``, which dequantizes the whole weight on every call."""
    method = op.forward_method_name
    if method == "forward_native":
        return False
    if type(op) is not QuantizedLinear:  # a platform's replacement class runs its own forward
        return True
    return method != "forward_oot" and CustomOp.get_kernel("quantized_linear") is not None


def finish_quantized(layer: nn.Module, bits: int, dtype: torch.dtype) -> bool:
    """Turn a loaded layer's quantized parameters into its ``weight``: a ``QuantizedLinear`` op, or,
    where no kernel would run it (an out-of-tree platform without one, ``--custom-ops
    -quantized_linear``), a dense weight of the same values, as ``--quantization none`` holds it;
    whether the layer stayed quantized."""
    group_size = layer.qweight.shape[1] // layer.qscale.shape[1]
    weight = QuantizedWeight(layer.qweight.data, layer.qscale.data, layer.qzero.data, bits, group_size)
    for name in QPARAMS:
        delattr(layer, name)
    op = QuantizedLinear(weight, dtype)
    if not runs_a_kernel(op):
        layer.weight = nn.Parameter(weight.dequantize(dtype), requires_grad=False)
        return False
    layer.weight = op
    layer.register_state_dict_post_hook(_dense_state)
    prepared = op.kernel_weight()
    if isinstance(prepared, CpuQuantizedWeight):
        prepared.make_dense()  # now, at load: made on the first prefill, it would slow that request
        op.release_weight()  # the CPU layouts hold the codes and the exact values: one copy
    return True


class CpuQuantizedWeight:
    """The CPU kernel's layouts of a ``QuantizedWeight``: the codes for a few rows and ``dense``,
    the dequantized weights in the compute dtype (packed where enabled: ``onednn.pack``), for batches.

    The codes: 4-bit ones packed for the C kernel (``CpuKernels.pack_q4``: two codes a byte,
    scale and zero as bf16 pairs for bf16 activations), else torch's int4 layout where the C
    kernels are unavailable; 8-bit ones packed for the int8-activation kernel
    (``CpuKernels.pack_q8``, groups of 32 on AVX512-VNNI CPUs) or as they are, for the C 8-bit
    kernel (where it builds)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        # here, not at the top: the platform module imports the kernels' build machinery
        from ..platforms.cpu_kernels import kernels

        self.shape = weight.shape
        self.bits, self.group_size = weight.bits, weight.group_size
        out_features, in_features = self.shape
        self.q4: Any = None
        self.int4: tuple[torch.Tensor, torch.Tensor] | None = None
        self.codes: QuantizedWeight | None = None
        self.q8: Any = None
        if (weight.bits == 4 and weight.group_size % 32 == 0 and dtype in (torch.float32, torch.bfloat16)
                and kernels() is not None):
            self.q4 = kernels().pack_q4(weight.qweight, weight.scale, weight.zero, dtype)
        elif (weight.bits == 4 and dtype == torch.bfloat16 and weight.group_size in _INT4_GROUPS
              and out_features % 16 == 0 and int4_available()):  # in fp32 torch's takes 20x the dense GEMM
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.qweight.to(torch.int32).contiguous(), 1)
            # (in / group, out, 2): per group and output, the scale and the zero, in the activations' dtype
            scales_and_zeros = torch.stack([weight.scale.t(), weight.zero.t()], dim=-1).to(dtype).contiguous()
            self.int4 = (packed, scales_and_zeros)
        elif weight.bits == 8 and kernels() is not None:
            self.q8 = kernels().pack_q8(weight.qweight, weight.scale, weight.zero, weight.group_size)
            if self.q8 is None:
                self.codes = weight
        # the neutral weight, for the dense copy; a packed 8-bit one is rebuilt from its layout instead
        self._weight: QuantizedWeight | None = weight if self.q8 is None else None
        self.dtype = dtype
        self._dense: torch.Tensor | None = None
        # the few-rows path, chosen once: it runs for every linear layer of every decode step
        # (``few_rows(x)``: ``x @ W.T`` through the codes, or None where no kernel here takes them)
        self.few_rows: Callable[[torch.Tensor], torch.Tensor | None] = _no_few_rows
        # rows (tokens) up to which a step takes few_rows; more multiply through the dense copy
        int8 = (self.q4 is not None and self.q4.layout == 1) or self.q8 is not None
        self.max_rows = QUANT_INT8_MAX_ROWS if int8 else QUANT_MAX_ROWS
        if self.q4 is not None:
            self.few_rows = partial(kernels().q4_linear, packed=self.q4)
        elif self.int4 is not None:
            self.few_rows = self._few_rows_int4
        elif self.q8 is not None:
            self.few_rows = partial(kernels().q8a_linear, packed=self.q8)
        elif self.codes is not None:
            c = self.codes
            self.few_rows = partial(kernels().q8_linear, qweight=c.qweight, scale=c.scale, zero=c.zero,
                                    group_size=c.group_size)

    @property
    def reads_codes(self) -> bool:
        """Whether a few rows multiply through the codes here (else through the dense copy)."""
        return self.q4 is not None or self.int4 is not None or self.q8 is not None or self.codes is not None

    @property
    def dense(self) -> torch.Tensor:
        """The dequantized weights in the compute dtype (packed where enabled: ``onednn.pack``). A model's
        linear layers make theirs at load (:func:`finish_quantized`); one that only ever sees a
        few rows (the quantized LM head of ``LogitsProcessor``) never holds one."""
        return self.make_dense()

    def dense_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The dense copy where :func:`cpu_quantized_linear` multiplies ``x`` (of the compute
        dtype) by it, None where ``x``'s rows go through the codes (or ``x`` is of another dtype)."""
        if x.dtype != self.dtype or (self.reads_codes and x.numel() <= self.max_rows * x.shape[-1]):
            return None
        return self.dense

    def make_dense(self) -> torch.Tensor:
        if self._dense is None:
            if self._weight is None:  # only a packed 8-bit weight gets here before its dense copy
                from ..platforms.cpu_qdot import unpack_q8

                self._weight = QuantizedWeight(*unpack_q8(self.q8), 8, self.q8.group_size)
            dense = self._weight.dequantize(self.dtype)
            self._dense = onednn.pack(dense) if onednn.enabled_for(dense) else dense
            if self.codes is None:  # the codes are in the kernel's own layout: the neutral ones can go
                self._weight = None
        return self._dense

    @property
    def nbytes(self) -> int:
        """Bytes the few-rows kernel reads per call (codes, scales and zeros); the dense copy's without one."""
        if self.q4 is not None:
            parts = (self.q4.codes, self.q4.scale_zero) if self.q4.scale_zero is not None else \
                (self.q4.codes, self.q4.scale, self.q4.zero)
            return sum(t.numel() * t.element_size() for t in parts)
        if self.int4 is not None:
            return sum(t.numel() * t.element_size() for t in self.int4)
        if self.q8 is not None:
            return sum(t.numel() * t.element_size() for t in (self.q8.codes, self.q8.scale, self.q8.zero) if t is not None)
        if self.codes is not None:
            return sum(t.numel() * t.element_size() for t in (self.codes.qweight, self.codes.scale, self.codes.zero))
        return self.shape[0] * self.shape[1] * self.dtype.itemsize

    def _few_rows_int4(self, x: torch.Tensor) -> torch.Tensor:
        packed, scales_and_zeros = self.int4
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, self.shape[1]).contiguous()
        out = _INT4_MM(rows, packed, self.group_size, scales_and_zeros)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.shape[0])


def _no_few_rows(x: torch.Tensor) -> None:
    return None


def cpu_quantized_linear(x: torch.Tensor, weight: CpuQuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU platform's ``quantized_linear`` kernel (``KERNEL_SIGNATURES``)."""
    if x.dtype == weight.dtype and x.numel() <= weight.max_rows * x.shape[-1]:
        out = weight.few_rows(x)
        if out is not None:
            return out if bias is None else out.add_(bias)  # in the output's dtype, as forward_native
    bias = None if bias is None else bias.to(weight.dtype)
    return onednn.linear(x.to(weight.dtype), weight.dense, bias).to(x.dtype)


cpu_quantized_linear.prepare = CpuQuantizedWeight  # type: ignore[attr-defined]


def _dense_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """``state_dict()`` shows a quantized layer's weight as the dense ``(out, in)`` tensor of its
    values in the compute dtype (as ``onednn``'s hook does for packed layers)."""
    op = getattr(module, "weight", None)
    if isinstance(op, QuantizedLinear) and op.weight is not None:
        state_dict[prefix + "weight"] = op.weight.dequantize(op.dtype)
    elif isinstance(op, QuantizedLinear):  # released: the CPU layout's dense copy holds the same values
        state_dict[prefix + "weight"] = onednn.dense(op.kernel_weight().dense)
