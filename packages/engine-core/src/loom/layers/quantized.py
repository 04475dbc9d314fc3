"""Linear layers with group-wise int4 weights (``--quantization gguf``).

Two layouts of the same weights: torch's int4 kernel reads a quarter of the bytes of bf16,
which is what decoding a few streams is bound by, but it dequantizes per row, so from a
handful of rows on it falls far behind a GEMM (measured here: equal at 2 rows, 10x slower at
64). A layer therefore multiplies up to ``INT4_MAX_ROWS`` rows through the int4 kernel and
larger batches (prefill, many streams) through a dense copy of the exact dequantized weights
in the compute dtype (prepacked for oneDNN like any CPU linear).

A layer chosen for int4 trades its dense ``weight`` parameter for three that load through
the layer's own ``weight_loader`` (so tensor-parallel slicing and the fused q/k/v and
gate/up shards work unchanged): ``qweight`` (uint8 values 0..15, ``(out, in)``), and the
fp32 ``qscale`` and ``qzero`` (``(out, in / 32)``); a weight is ``(q - 8) * scale + zero``
(``loom.model_loader.gguf_quant``). Once loaded, :func:`finish_int4` packs them for torch's
CPU int4 matmul (``_convert_weight_to_int4pack_for_cpu``, scales and zeros in the compute
dtype) and the layer's ``weight`` becomes an :class:`Int4Weight`, which ``onednn.linear``
multiplies through ``_weight_int4pack_mm_for_cpu``.

In fp32 the int4 kernel computes with the file's exact weights; in bf16 its scales and zeros are
held in bf16 (the kernel takes them in the activations' dtype), so its weights are the file's to
within bf16 rounding of the scale and zero, while the dense copy holds the exact values rounded
once to bf16. Memory: packed int4 (0.56 bytes per weight with scales) plus the dense copy (2
bytes in bf16), against 2 bytes for ``--quantization none``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["GROUP_SIZE", "INT4_MAX_ROWS", "QPARAMS", "Int4Weight", "available", "finish_int4", "make_int4_params"]

INT4_MAX_ROWS = 4
"""Rows (tokens) up to which a step multiplies through the int4 kernel; more use the dense copy."""
GROUP_SIZE = 32
"""Weights per scale and zero along ``in`` (GGUF's 4-bit block; torch also takes 64-256)."""
QPARAMS = ("qweight", "qscale", "qzero")


def available() -> bool:
    """Whether this torch has the CPU int4 packing and matmul."""
    aten = torch.ops.aten
    return hasattr(aten, "_convert_weight_to_int4pack_for_cpu") and hasattr(aten, "_weight_int4pack_mm_for_cpu")


class Int4Weight:
    """An ``(out, in)`` weight in torch's CPU int4 layout, groups of 32 along ``in``, and
    ``dense``: the same weights dequantized in the compute dtype, for batches of many rows."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> None:
        self.shape = tuple(q.shape)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        # (in / 32, out, 2): per group and output, the scale and the zero, in the activations' dtype
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        out_features, in_features = self.shape
        grouped = q.view(out_features, in_features // GROUP_SIZE, GROUP_SIZE).float() - 8
        self.dense: torch.Tensor = (grouped * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view(self.shape).to(dtype)
        """Replaced by its oneDNN-packed layout by ``onednn.prepack_model`` where enabled."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.shape[1])
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), self.packed, GROUP_SIZE,
                                                         self.scales_and_zeros)
        return out.view(*x.shape[:-1], self.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes the int4 kernel reads per call (the packed weights, scales and zeros)."""
        return self.packed.numel() * self.packed.element_size() + \
            self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()


def make_int4_params(layer: nn.Module) -> bool:
    """Give ``layer`` (a ``LinearBase``) int4 parameters in place of its dense weight; False
    (and the layer unchanged) when its per-rank shape does not fit torch's int4 packing: input
    width in whole groups of 32, output width a multiple of 16."""
    out_features, in_features = layer.weight.shape
    if in_features % GROUP_SIZE or out_features % 16:
        return False
    loader = layer.weight.weight_loader
    del layer.weight
    shapes = {"qweight": ((out_features, in_features), torch.uint8),
              "qscale": ((out_features, in_features // GROUP_SIZE), torch.float32),
              "qzero": ((out_features, in_features // GROUP_SIZE), torch.float32)}
    for name, (shape, dtype) in shapes.items():
        param = nn.Parameter(torch.empty(shape, dtype=dtype, device="cpu"), requires_grad=False)
        param.weight_loader = loader  # type: ignore[attr-defined]
        layer.register_parameter(name, param)
    return True


def finish_int4(layer: nn.Module, dtype: torch.dtype) -> None:
    """Pack a loaded int4 layer: its ``weight`` becomes an :class:`Int4Weight`."""
    weight = Int4Weight(layer.qweight.data, layer.qscale.data, layer.qzero.data, dtype)
    for name in QPARAMS:
        delattr(layer, name)
    layer.weight = weight
    layer.register_state_dict_post_hook(_dense_state)


def _dense_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """``state_dict()`` shows an int4 layer's weight as the dense ``(out, in)`` tensor of the
    file's values (as ``onednn``'s hook does for packed layers)."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, Int4Weight):
        dense = weight.dense
        state_dict[prefix + "weight"] = dense.to_dense() if dense.is_mkldnn else dense
