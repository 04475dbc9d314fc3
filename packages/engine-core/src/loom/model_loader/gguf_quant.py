"""GGUF's block formats Q4_0, Q4_1 and Q8_0, and the K-quants Q4_K and Q6_K, read into group-wise
codes (the same values, none re-quantized).

llama.cpp stores a Q4_0 or Q4_1 matrix row by row in blocks of 32 weights along the input
dimension: an fp16 scale ``d`` (and, for Q4_1, an fp16 minimum ``m``), then 16 bytes whose
low nibbles are weights 0-15 of the block and high nibbles weights 16-31. The value of a
weight ``q`` (0..15) is ``d * (q - 8)`` (Q4_0) or ``d * q + m`` (Q4_1). Both are exactly
``(q - 8) * scale + zero`` with ``scale = d`` and ``zero = 0`` or ``m + 8 d``: the form of
torch's group-wise int4 matmul (group size 32): the file's 4-bit values run as they are
(``layers/quantized.py`` says what holding the scales in bf16 rounds).

:func:`split_int4_blocks` turns the raw bytes of a tensor (``GGUFReader``'s ``(rows,
bytes per row)`` uint8 array) into ``(q, scale, zero)``: ``q`` uint8 ``(rows, cols)`` and
the fp32 ``scale`` and ``zero`` ``(rows, cols / 32)``. Rows are the matrix's output
features, so a row permutation (Q/K un-permuting) or a row slice (tensor parallelism)
applies to all three alike.

Q8_0 blocks are an fp16 scale ``d`` and 32 int8 weights ``c``, the value ``d * c``:
:func:`split_blocks` gives them as 8-bit codes ``c + 128`` with ``scale = d`` and ``zero = 0``
(``QuantizedWeight``'s form, codes offset by ``2**(bits-1)``).

Two K-quants, the formats of the ``Q4_K_M`` files most GGUF models ship as, fit the same form:

- Q4_K: super-blocks of 256 weights (144 bytes): fp16 ``d`` and ``dmin``, eight 6-bit scales
  ``sc`` and mins ``m`` packed in 12 bytes, and 128 bytes of nibbles (per 64 weights, 32 bytes:
  low nibbles the first 32, high nibbles the next). A weight of sub-block ``j`` (32 weights) is
  ``d * sc_j * q - dmin * m_j``: 4-bit codes in groups of 32 with ``scale = d * sc_j`` (exact in
  fp32: 11 by 6 bits) and ``zero = 8 * scale - dmin * m_j`` (one fp32 rounding at most).
- Q6_K: super-blocks of 256 weights (210 bytes): 128 bytes of low nibbles, 64 of high bit
  pairs, sixteen int8 scales and an fp16 ``d``; a weight of sub-block ``j`` (16 weights) is
  ``d * sc_j * (q - 32)``, q 0..63: 8-bit codes ``q + 96`` in groups of 16 with
  ``scale = d * sc_j`` (exact) and ``zero = 0``.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

__all__ = ["FORMATS", "GROUP_SIZE", "INT4_TYPES", "dequantize_int4", "dequantize_q8_0", "split_blocks",
           "split_int4_blocks"]

GROUP_SIZE = 32
INT4_TYPES = ("Q4_0", "Q4_1")
FORMATS = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q8_0": (8, 32), "Q4_K": (4, 32), "Q6_K": (8, 16)}
"""GGUF types that load as quantized groups (``--quantization gguf``): (code width, group size);
others are dequantized."""
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def _blocks(raw: np.ndarray, block: int, type_name: str) -> torch.Tensor:
    """The raw ``(rows, bytes per row)`` bytes of a ``type_name`` tensor as a uint8 ``(rows, blocks,
    block)`` tensor on the same memory (the file's read-only map: nothing here writes to it)."""
    rows, nbytes = raw.shape
    if nbytes % block:
        unit = "super-blocks" if type_name.endswith("_K") else "blocks"
        raise ValueError(f"a {type_name} row of {nbytes} bytes is not whole {unit} of {block}")
    with warnings.catch_warnings():  # torch warns that the map is read-only; it is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(raw)).view(rows, nbytes // block, block)


def _fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at ``offset`` of every block, as fp32 ``(rows, blocks)``."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).squeeze(-1).float()


def split_int4_blocks(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q, scale, zero)`` of a Q4_0/Q4_1 tensor from its raw ``(rows, bytes per row)`` bytes."""
    if type_name not in _BLOCK_BYTES:
        raise ValueError(f"GGUF type {type_name} is not a 4-bit block format ({', '.join(INT4_TYPES)})")
    block = _BLOCK_BYTES[type_name]
    # in torch, not numpy: its element-wise kernels use every core the worker has at load
    blocks = _blocks(raw, block, type_name)
    d = _fp16_field(blocks, 0)
    zero = _fp16_field(blocks, 2).add_(d, alpha=8.0) if type_name == "Q4_1" else torch.zeros_like(d)
    nibbles = blocks[..., block - 16:]  # (rows, groups, 16)
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # weights 0-15, then 16-31
    return q.view(blocks.shape[0], -1).numpy(), d.numpy(), zero.numpy()


def _split_q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks = _blocks(raw, 144, "Q4_K")
    rows, nsb = blocks.shape[:2]
    d, dmin = _fp16_field(blocks, 0), _fp16_field(blocks, 2)  # (rows, nsb)
    s = blocks[..., 4:16].to(torch.int32)  # the 12 bytes of scales and mins
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    scale = d.unsqueeze(-1) * sc.float()  # (rows, nsb, 8)
    zero = scale * 8.0 - dmin.unsqueeze(-1) * m.float()
    nib = blocks[..., 16:].reshape(rows, nsb, 4, 32)  # per 64 weights: low nibbles, then high
    q = torch.stack([nib & 0x0F, nib >> 4], dim=3)  # (rows, nsb, 4, 2, 32)
    return q.reshape(rows, -1).numpy(), scale.reshape(rows, -1).numpy(), zero.reshape(rows, -1).numpy()


def _split_q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks = _blocks(raw, 210, "Q6_K")
    rows, nsb = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(rows, nsb, 2, 2, 32)  # (half, bytes 0-31 / 32-63, l)
    qh = blocks[..., 128:192].reshape(rows, nsb, 2, 1, 32)  # (half, l)
    sc = blocks[..., 192:208].view(torch.int8).float()  # (rows, nsb, 16)
    d = _fp16_field(blocks, 208)
    # per half of 128: weights l, l + 32, l + 64, l + 96 from ql[l], ql[l + 32] (low nibbles, then
    # high) and the bit pairs 0, 1, 2, 3 of qh[l]
    low = torch.cat([ql & 0x0F, ql >> 4], dim=3)  # (rows, nsb, 2, 4, 32): quarters 0..3
    high = torch.cat([(qh >> (2 * k)) & 3 for k in range(4)], dim=3)
    q = low | (high << 4)  # 0..63
    return ((q + 96).reshape(rows, -1).numpy(), (d.unsqueeze(-1) * sc).reshape(rows, -1).numpy(),
            torch.zeros(rows, nsb * 16).numpy())


def split_blocks(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q, scale, zero)`` of a tensor of a type in :data:`FORMATS` from its raw ``(rows, bytes
    per row)`` bytes; groups of ``FORMATS[type_name][1]``."""
    if type_name == "Q4_K":
        return _split_q4_k(raw)
    if type_name == "Q6_K":
        return _split_q6_k(raw)
    if type_name != "Q8_0":
        return split_int4_blocks(raw, type_name)
    blocks = _blocks(raw, 34, "Q8_0")
    rows = blocks.shape[0]
    d = _fp16_field(blocks, 0)  # (rows, groups)
    q = blocks[..., 2:] ^ 0x80  # the int8 c's bits with the sign flipped: the uint8 c + 128
    return q.reshape(rows, -1).numpy(), d.numpy(), torch.zeros_like(d).numpy()


def dequantize_int4(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """The fp32 weights ``(q - 8) * scale + zero`` (for checks; the model never needs them)."""
    groups = np.repeat(np.arange(scale.shape[1]), GROUP_SIZE)
    return (q.astype(np.float32) - 8.0) * scale[:, groups] + zero[:, groups]


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """fp32 weights of a Q8_0 tensor (blocks of an fp16 scale and 32 int8), vectorized in torch
    with one fp32 array allocated (the ``gguf`` package's loop over row groups takes 0.2 s for
    SmolLM2's embedding)."""
    blocks = _blocks(raw, 34, "Q8_0")
    rows = blocks.shape[0]
    out = blocks[..., 2:].view(torch.int8).float()  # (rows, groups, 32)
    return out.mul_(_fp16_field(blocks, 0).unsqueeze(-1)).view(rows, -1).numpy()
