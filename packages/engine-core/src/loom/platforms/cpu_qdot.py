"""The weight layout of ``cpu_qdot.c``'s decode matmuls with int8 activations ("layout 1"), and
a torch emulation of what they compute.

Those kernels quantize each row of x to int8 per group of 32 (``xq = round(x / dx)``,
``dx = max|x| / 127``, as llama.cpp does for its Q8 activations), sum codes times ``xq`` with
AVX512-VNNI's 8-bit dot products and apply the weight's scales and the group's exact sums of x in
fp32. The codes are laid out so that one instruction sums four codes of sixteen groups at once
(the C file's header has the byte order); these helpers pack and unpack that order. Groups are
32 weights: GGUF's Q4_0, Q4_1, Q4_K and Q8_0 blocks.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["PackedQ8", "emulate", "pack_codes", "pack_q8", "unpack_codes", "unpack_q8"]

GROUP = 32
_SB = 16  # groups a superblock


def _lanes(groups: int) -> int:
    """Lanes a group takes in a register of sixteen: ``groups`` rounded up to a power of two."""
    return 1 << (groups - 1).bit_length()


@functools.cache
def _order(groups: int) -> tuple[torch.Tensor, int]:
    """A superblock of ``groups`` groups in the 8-bit order: for each of its bytes, the index of
    the code it holds in the superblock's ``groups * 32`` codes (-1: padding); and its registers."""
    lanes = _lanes(groups)
    fold = min(8, _SB // lanes)  # sub-vectors a register
    registers = 8 // fold
    i = torch.arange(registers).view(-1, 1, 1)
    lane = torch.arange(_SB).view(1, -1, 1)
    b = torch.arange(4).view(1, 1, -1)
    group, v = lane % lanes, i * fold + lane // lanes
    src = group * GROUP + 4 * v + b
    return torch.where((group < groups) & (v < 8), src, -1).reshape(-1), registers


def _superblocks(k: int) -> list[tuple[int, int, int]]:
    """``(first group, superblocks, groups each)`` runs of a row of ``k`` codes."""
    ng = k // GROUP
    runs = [(0, ng // _SB, _SB)] if ng >= _SB else []
    if ng % _SB:
        runs.append((ng // _SB * _SB, 1, ng % _SB))
    return runs


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``(N, K)`` (K a multiple of 32) in layout 1 for ``bits`` 4 or 8: ``(N, bytes)``."""
    n, k = q.shape
    parts = []
    for g0, count, groups in _superblocks(k):
        src, registers = _order(groups)
        blk = q[:, g0 * GROUP:(g0 + count * groups) * GROUP]
        if groups == _SB:  # whole superblocks: (group, v, b) -> (v, group, b), a transpose (fast)
            reg = blk.reshape(n, count, _SB, 8, 4).transpose(2, 3).reshape(n, count, registers, 64)
        else:  # the last one, folded (a gather; small)
            blk = torch.cat([blk.reshape(n, count, groups * GROUP), blk.new_zeros(n, count, 1)], dim=-1)
            reg = blk[:, :, src].view(n, count, registers, 64)  # index -1: the zero
        if bits == 4:  # pairs of registers in the low and high nibbles; a lone one in its own halves
            reg = reg[..., :32] | (reg[..., 32:] << 4) if registers == 1 else reg[:, :, 0::2] | (reg[:, :, 1::2] << 4)
        parts.append(reg.reshape(n, -1))
    return torch.cat(parts, dim=1).contiguous()


def unpack_codes(codes: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """:func:`pack_codes` undone: the ``(N, k)`` codes."""
    n = codes.shape[0]
    out = torch.empty(n, k, dtype=torch.uint8)
    at = 0
    for g0, count, groups in _superblocks(k):
        src, registers = _order(groups)
        width = registers * 64 * bits // 8 if registers > 1 or bits == 8 else 32
        blk = codes[:, at:at + count * width].reshape(n, count, width)
        at += count * width
        if bits == 4:
            lo, hi = blk & 15, blk >> 4
            if registers == 1:
                reg = torch.cat([lo, hi], dim=-1)
            else:
                reg = torch.stack([lo.view(n, count, -1, 64), hi.view(n, count, -1, 64)], dim=3)
        else:
            reg = blk
        reg = reg.reshape(n, count, -1)
        keep = src >= 0
        dst = torch.empty(n, count, groups * GROUP, dtype=torch.uint8)
        dst[:, :, src[keep]] = reg[:, :, keep]
        out[:, g0 * GROUP:(g0 + count * groups) * GROUP] = dst.view(n, -1)
    return out


class PackedQ8:
    """An 8-bit weight ``w[o, i] = (q[o, i] - 128) * scale[o, i // 32] + zero[o, i // 32]`` for
    ``cpu_qdot.c``: ``codes`` in layout 1, ``scale`` float32 (N, K / 32), ``zero`` float32 or
    None where every zero is 0 (GGUF's Q8_0: nothing to read)."""

    __slots__ = ("codes", "scale", "zero", "n", "k")
    group_size = GROUP

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, n: int, k: int) -> None:
        self.codes, self.scale, self.zero, self.n, self.k = codes, scale, zero, n, k

    def __repr__(self) -> str:
        return f"PackedQ8(n={self.n}, k={self.k})"


def pack_q8(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> PackedQ8:
    """uint8 codes (N, K) with float32 scale and zero (N, K / 32) as a :class:`PackedQ8`."""
    n, k = qweight.shape
    if qweight.dtype != torch.uint8 or k % GROUP or scale.shape != (n, k // GROUP) or zero.shape != scale.shape:
        raise ValueError(f"pack_q8 takes uint8 (N, K) codes, K a multiple of {GROUP}, and float32 (N, K / {GROUP}) "
                         f"scale and zero, not {tuple(qweight.shape)}, {tuple(scale.shape)} and {tuple(zero.shape)}")
    zero = None if not zero.any() else zero.float().contiguous()
    return PackedQ8(pack_codes(qweight, 8), scale.float().contiguous(), zero, n, k)


def unpack_q8(packed: PackedQ8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`pack_q8` packed: codes uint8 (N, K), scale and zero float32 (N, K / 32)."""
    zero = packed.zero if packed.zero is not None else torch.zeros_like(packed.scale)
    return unpack_codes(packed.codes, packed.k, 8), packed.scale, zero


def emulate(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero_term: torch.Tensor) -> torch.Tensor:
    """What the kernels compute for x (rows, K) and the weight ``codes * scale + zero_term`` per
    group of 32 (codes (N, K) as they are, 0..15 or 0..255; ``zero_term`` = zero - 8 or 128 times
    scale), in float64 from the same int8 x: (rows, N). Differs from the kernels by the order of
    their fp32 sums only."""
    rows, k = x.shape
    n = codes.shape[0]
    xf = x.float().view(rows, k // GROUP, GROUP)
    dx = xf.abs().amax(-1) / 127
    usable = dx >= torch.finfo(torch.float32).tiny  # a subnormal step: the kernels take the group as 0
    xq = torch.round(xf * torch.where(usable, 1.0 / dx, torch.zeros_like(dx))[..., None])
    dots = torch.einsum("rgi,ngi->rng", xq.double(), codes.double().view(n, k // GROUP, GROUP))
    return (dots * (dx[:, None, :].double() * scale[None].double())).sum(-1) + xf.sum(-1).double() @ zero_term.double().t()
