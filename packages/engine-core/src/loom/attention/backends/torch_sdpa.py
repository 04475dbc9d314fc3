"""Paged attention in plain torch (``scaled_dot_product_attention``), for CPU memory.

Cache layout per layer: ``(2, num_blocks, block_size, num_kv_heads, head_size)``.
Decode requests (one new token) run through the paged-decode kernel compiled on this
machine (``native.py``), which reads K/V through the block tables in place; where that
kernel is not available they run as one batched SDPA over K/V gathered through their block
tables. Where the kernel's AVX512-BF16 path runs (bf16, head size a multiple of 32) and torch's
flash kernel has no AMX tiles to run on (``PagedDecode.takes_prefill``), prefill chunks whose
context is at most ``KERNEL_PREFILL_MAX_CTX`` go through it too, each token a
query over the positions up to its own (causal by construction, a cached prefix included; the
kernel shares each K/V tile among 16 such rows). Where the compiled kernels have AMX tiles
(``PagedDecode.takes_amx_prefill``: bf16, head size a multiple of 32 up to 128), every prefill
chunk whose context is at most ``AMX_PREFILL_MAX_CTX`` runs in one call per layer of
``paged_prefill_amx.c`` over the paged cache, a cached prefix included; in fp32 on AVX2 CPUs
without AVX-512 (``PagedDecode.takes_f32_prefill``) those up to ``F32_PREFILL_MAX_CTX`` run the
same way through ``paged_prefill_f32.c``. Other prefill chunks with
no cached prefix run batched, one causal SDPA call per chunk length; a chunk after a cached
prefix runs alone, masked over the prefix plus the chunk.
Plans are built once per step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from loom_plugin_api import AttentionBackend, AttentionImpl, AttentionMetadata

from . import native

KERNEL_PREFILL_MAX_CTX = 4096
"""Prefill chunks up to this context run through the AVX512-BF16 kernel where that one takes
prefills (no AMX). Per layer of the default model it beat torch's flash kernel at every length
measured up to 4,096 tokens (139 vs 148 ms for one prompt of 4,096, 2.5 vs 6.1 for 16 of 128;
2026-12-05), and a review measured it slower at 8,192 (706-792 vs 632-671 ms): each row reads its
whole context, so past a few thousand tokens the flash kernel's blocking wins."""

AMX_PREFILL_MAX_CTX = 8192
"""Prefill chunks up to this context run through the AMX kernel where it runs. Against torch's
flash kernel (itself on AMX) as this backend calls it, the kernel alone, per layer of the default
model (2026-12-06, 2 cores of a Xeon with AMX; ``bench/prefill_attention.py`` times both through
the backend): 16 prompts of 128 tokens 0.43 vs 1.33 ms, 8 prompts of 36-510 1.29 vs 4.70, 512
after 1,536 cached 2.0 vs 4.3, one of 4,096 18 vs 26, one of 8,192 73 vs 98, one of 12,288 203
vs 220, one of 16,384 406 vs 385."""

F32_PREFILL_MAX_CTX = 8192
"""Prefill chunks up to this context run through the fp32 kernel where it runs (AVX2 without
AVX-512). Per layer of the default model, the backend's forward with the kernel against torch's
flash kernel (``python bench/prefill_attention.py --dtype float32``, 2026-12-07, 2 cores of an
AMD EPYC with AVX2): 16 prompts of 128 tokens 3.5 vs 9.4 ms, 8 prompts of 16-512 9.2 vs 20.0,
one of 1,000 9.2 vs 13.1, 512 after 1,536 cached 16.9 vs 20.6, one of 4,096 145 vs 164, 2,048
after 6,144 cached 250 vs 351, one of 8,192 564 vs 641. A row's whole context is one softmax
pass, so its scores and the laid-out K/V grow with the context; the limit is the longest context
measured, as for the AMX kernel."""


@dataclass(slots=True)
class _DecodePlan:
    """Query rows for the paged kernel: the decode requests, and (``kernel_prefill``) every token
    of the prefill chunks with a context up to ``KERNEL_PREFILL_MAX_CTX``."""
    token_idx: torch.Tensor  # (Bd,) flat token index of each query row
    rows: torch.Tensor  # (Bd,) request row of each query (in the block tables)
    ctx: torch.Tensor  # (Bd,) context length of each query (a prefill token: up to its position)
    max_ctx: int
    slots: torch.Tensor | None  # (Bd, max_ctx) cache slot per context position (padding -> valid slot)
    mask: torch.Tensor | None  # (Bd, 1, 1, max_ctx) True where the key is in context
    # slots and mask are built only for the gather path (no native kernel)


@dataclass(slots=True)
class _PrefillItem:
    start: int  # first flat token of the chunk
    end: int
    slots: torch.Tensor  # (ctx,) cache slots of the whole context
    mask: torch.Tensor  # (q, ctx) causal mask with the prefix offset


@dataclass(slots=True)
class _PrefillGroup:
    """Prefill chunks of one length with no cached prefix: one batched causal SDPA call."""
    length: int
    tokens: torch.Tensor  # (n * length,) flat token indices, chunk after chunk
    span: tuple[int, int] | None = None  # (first, end) where those are one run of the step's tokens


@dataclass(slots=True)
class _Plan:
    decode: _DecodePlan | None
    prefills: list[_PrefillItem]  # chunks that attend to a cached prefix, one call each
    groups: list[_PrefillGroup]
    chunks: torch.Tensor | None = None  # (n, 4) prefill chunks for the chunk kernel: first row, tokens, context, request


# Gathered K/V of a step are tens of MB: a fresh allocation of that size is an mmap whose
# page faults cost more than the copy itself. Layers run one after another, so one pair of
# buffers, grown when needed, serves every layer of every step.
_workspace: dict[tuple[torch.dtype, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at ``slots`` (any shape S), as views (*S, Hk, D) into the shared workspace."""
    _, hk, d = k_cache.shape
    n = slots.numel()
    key = (k_cache.dtype, hk, d)
    bufs = _workspace.get(key)
    # (buffers made under inference_mode cannot be written outside it: a test, a tool)
    if bufs is None or bufs[0].shape[0] < n or (bufs[0].is_inference() and not torch.is_inference_mode_enabled()):
        size = max(n, 2 * bufs[0].shape[0]) if bufs is not None and bufs[0].shape[0] < n else n
        bufs = (k_cache.new_empty(size, hk, d), v_cache.new_empty(size, hk, d))
        _workspace[key] = bufs
    flat = slots.reshape(-1)
    k = torch.index_select(k_cache, 0, flat, out=bufs[0][:n])
    v = torch.index_select(v_cache, 0, flat, out=bufs[1][:n])
    return k.view(*slots.shape, hk, d), v.view(*slots.shape, hk, d)


def _context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length)
    return block_table[pos // block_size] * block_size + pos % block_size


def _one_run(firsts: list[int], length: int) -> bool:
    """Whether chunks of ``length`` tokens starting at ``firsts`` follow one another."""
    return all(b - a == length for a, b in zip(firsts, firsts[1:]))


def _group_rows(t: torch.Tensor, grp: _PrefillGroup) -> torch.Tensor:
    """The group's rows of a step tensor: a view where they are one unbroken run, else gathered."""
    return t[grp.span[0]:grp.span[1]] if grp.span is not None else t.index_select(0, grp.tokens)


def build_plan(md: AttentionMetadata, gather_decode: bool = True, kernel_prefill: bool = False,
               chunk_max_ctx: int = 0) -> _Plan:
    """Gather indices and masks for this step (computed once, reused by every layer); the
    decode requests' gather indices only when ``gather_decode`` (no native kernel). With
    ``kernel_prefill`` the prefill chunks up to ``KERNEL_PREFILL_MAX_CTX`` join the kernel's query
    rows; with ``chunk_max_ctx`` (which takes precedence) those up to that context go to a chunk
    prefill kernel (``PagedDecode.prefill``)."""
    kernel_prefill = kernel_prefill and not chunk_max_ctx
    key = f"torch_sdpa_plan_{int(gather_decode)}{int(kernel_prefill)}{chunk_max_ctx}"
    plan = md.scratch.get(key)
    if plan is not None:
        return plan
    bs = md.block_size
    q_lens = md.query_lens
    seq_lens = md.seq_lens_list
    starts = md.query_start_loc.tolist()
    kernel_rows = [i for i, q in enumerate(q_lens)
                   if q == 1 or (kernel_prefill and seq_lens[i] <= KERNEL_PREFILL_MAX_CTX)]
    decode = None
    if kernel_rows:
        if len(kernel_rows) == md.num_reqs and md.num_tokens == md.num_reqs:
            # decode only: request b is query row b, so the step's own tensors serve as they are
            # (no new tensor: a captured step replays on them, see loom.worker.cpu_step_replay)
            rows = token_idx = md.query_start_loc[:-1]
            ctx = md.seq_lens.contiguous()
        elif all(q_lens[i] == 1 for i in kernel_rows):
            rows = torch.tensor(kernel_rows, dtype=torch.long)
            token_idx, ctx = md.query_start_loc[rows].contiguous(), md.seq_lens[rows].contiguous()
        else:  # prefill chunks too: one query row per token
            counts = torch.tensor([q_lens[i] for i in kernel_rows])
            rows = torch.repeat_interleave(torch.tensor(kernel_rows, dtype=torch.long), counts)
            token_idx = torch.cat([torch.arange(starts[i], starts[i] + q_lens[i]) for i in kernel_rows])
            ctx = torch.cat([torch.arange(seq_lens[i] - q_lens[i] + 1, seq_lens[i] + 1) for i in kernel_rows])
        max_ctx = max(seq_lens[i] for i in kernel_rows)
        decode = _DecodePlan(token_idx=token_idx, rows=rows, ctx=ctx, max_ctx=max_ctx, slots=None, mask=None)
        if gather_decode:  # (no kernel: kernel_rows are the decodes alone)
            pos = torch.arange(max_ctx)
            valid = pos.unsqueeze(0) < ctx.unsqueeze(1)  # (Bd, max_ctx)
            pos_c = torch.where(valid, pos.unsqueeze(0), 0)
            tables = md.block_tables[rows]
            decode.slots = torch.gather(tables, 1, pos_c // bs) * bs + pos_c % bs
            decode.mask = valid[:, None, None, :]
    in_kernel = set(kernel_rows)
    chunk_rows = [i for i, q in enumerate(q_lens) if q > 1 and seq_lens[i] <= chunk_max_ctx]
    in_kernel.update(chunk_rows)
    prefills = []
    by_length: dict[int, list[int]] = {}
    for i, q in enumerate(q_lens):
        if i in in_kernel:
            continue
        ctx = seq_lens[i]
        if ctx == q:  # no cached prefix: the chunk's own K/V is the whole context
            by_length.setdefault(q, []).append(starts[i])
            continue
        slots = _context_slots(md.block_tables[i], ctx, bs)
        offset = ctx - q
        qpos = torch.arange(q).unsqueeze(1) + offset
        mask = torch.arange(ctx).unsqueeze(0) <= qpos
        prefills.append(_PrefillItem(starts[i], starts[i] + q, slots, mask))
    groups = [_PrefillGroup(q, (torch.tensor(first).unsqueeze(1) + torch.arange(q)).reshape(-1),
                            (first[0], first[0] + q * len(first)) if _one_run(first, q) else None)
              for q, first in by_length.items()]
    chunks = torch.tensor([[starts[i], q_lens[i], seq_lens[i], i] for i in chunk_rows]) if chunk_rows else None
    plan = _Plan(decode, prefills, groups, chunks)
    md.scratch[key] = plan
    return plan


class TorchSDPAImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, **extra: Any) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, **extra)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.group = num_heads // num_kv_heads
        # Built (or found in the cache) when the model is built, not at the first request.
        self._kernel = native.paged_decode()

    def _kernel_for(self, dtype: torch.dtype) -> native.PagedDecode | None:
        """The compiled kernel where it takes this dtype and head size, else None."""
        return self._kernel if self._kernel is not None and self._kernel.supports(dtype, self.head_size) else None

    def decodes_in_kernel(self, dtype: torch.dtype) -> bool:
        """Whether decode rows read the cache in place (a compiled kernel) rather than through a
        gather of their whole context: what a replayed decode step needs (``cpu_worker``)."""
        return self._kernel_for(dtype) is not None

    def _write(self, key_rows: torch.Tensor, value_rows: torch.Tensor, kv_cache: torch.Tensor,
               md: AttentionMetadata) -> None:
        """Store the step's (T, Hk * D) K/V rows at their slots."""
        # One row of Hk * D per slot: index_copy_ over 3-D views takes a per-element path that
        # is up to 20x slower for bf16 rows split out of the fused qkv output.
        kv_rows = kv_cache.view(2, -1, key_rows.shape[1])
        kernel = self._kernel_for(key_rows.dtype)
        if kernel is None or not kernel.write_kv(key_rows, value_rows, md.slot_mapping, kv_rows[0], kv_rows[1]):
            kv_rows[0].index_copy_(0, md.slot_mapping, key_rows)
            kv_rows[1].index_copy_(0, md.slot_mapping, value_rows)

    def _gather(self, kv_cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (any shape S) as (*S, Hk, D) in ``dtype``."""
        hk, d = self.num_kv_heads, self.head_size
        return _gather_kv(kv_cache[0].view(-1, hk, d), kv_cache[1].view(-1, hk, d), slots)

    def _decode(self, query: torch.Tensor, plan: _DecodePlan, kv_cache: torch.Tensor, out: torch.Tensor,
                md: AttentionMetadata) -> None:
        """The kernel's query rows, attended in place over the cache (``decodes_in_kernel``)."""
        hk, d = self.num_kv_heads, self.head_size
        self._kernel(query, plan.token_idx, plan.rows, kv_cache[0].view(-1, hk, d), kv_cache[1].view(-1, hk, d),
                     md.block_tables, plan.ctx, out, num_heads=self.num_heads, block_size=md.block_size,
                     scale=self.scale)

    def _takes_prefill(self, dtype: torch.dtype) -> bool:
        kernel = self._kernel_for(dtype)
        return kernel is not None and kernel.takes_prefill(dtype, self.num_heads, self.num_kv_heads, self.head_size)

    def _chunk_prefill_max_ctx(self, dtype: torch.dtype) -> int:
        """The longest context whose prefill chunks go to the kernel's ``prefill`` (0: none do)."""
        kernel = self._kernel_for(dtype)
        if kernel is None:
            return 0
        shape = (dtype, self.num_heads, self.num_kv_heads, self.head_size)
        if kernel.takes_amx_prefill(*shape):
            return AMX_PREFILL_MAX_CTX
        return F32_PREFILL_MAX_CTX if kernel.takes_f32_prefill(*shape) else 0

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        T = query.shape[0]
        H, Hk, D, g = self.num_heads, self.num_kv_heads, self.head_size, self.group
        self._write(key.reshape(T, Hk * D), value.reshape(T, Hk * D), kv_cache, attn_metadata)
        in_kernel = self.decodes_in_kernel(query.dtype)
        chunk_max_ctx = self._chunk_prefill_max_ctx(query.dtype) if in_kernel else 0
        plan = build_plan(attn_metadata, gather_decode=not in_kernel,
                          kernel_prefill=in_kernel and self._takes_prefill(query.dtype), chunk_max_ctx=chunk_max_ctx)
        if query.stride(-1) != 1:
            query = query.contiguous()
        q = query.view(T, H, D)
        out = torch.empty(T, H, D, dtype=query.dtype, device=query.device)
        if plan.decode is not None and in_kernel:
            self._decode(query, plan.decode, kv_cache, out.view(T, H * D), attn_metadata)
        elif plan.decode is not None:
            d = plan.decode
            Bd = d.token_idx.shape[0]
            # Fold the query heads of a KV group into the query-length axis: (Bd, Hk, g, D).
            qd = q[d.token_idx].view(Bd, Hk, g, D)
            kd, vd = self._gather(kv_cache, d.slots, query.dtype)  # (Bd, ctx, Hk, D)
            kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)  # (Bd, Hk, ctx, D)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=self.scale)
            out[d.token_idx] = od.reshape(Bd, H, D)
        if plan.chunks is not None:
            self._kernel.prefill(query, plan.chunks, kv_cache[0].view(-1, Hk, D), kv_cache[1].view(-1, Hk, D),
                                 attn_metadata.block_tables, out.view(T, H * D), num_heads=H,
                                 block_size=attn_metadata.block_size, scale=self.scale)
        # 4-D inputs take torch's flash kernel on CPU (3-D ones do not: about 2x slower); it
        # handles GQA itself (enable_gqa), so K/V are not repeated per query head.
        gqa = g > 1
        for grp in plan.groups:  # same-length chunks without a prefix: one batched causal call
            n, L = grp.tokens.shape[0] // grp.length, grp.length
            qg = _group_rows(q, grp).view(n, L, H, D).transpose(1, 2)  # (n, H, L, D)
            kg = _group_rows(key.view(T, Hk, D), grp).view(n, L, Hk, D).transpose(1, 2)
            vg = _group_rows(value.view(T, Hk, D), grp).view(n, L, Hk, D).transpose(1, 2)
            og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=self.scale, enable_gqa=gqa)
            if grp.span is not None:
                out[grp.span[0]:grp.span[1]].view(n, L, H, D).copy_(og.transpose(1, 2))
            else:
                out.index_copy_(0, grp.tokens, og.transpose(1, 2).reshape(n * L, H, D))
        for p in plan.prefills:  # chunks after a cached prefix: K/V gathered, masked with the offset
            qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # (1, H, q, D)
            kp, vp = self._gather(kv_cache, p.slots, query.dtype)  # (ctx, Hk, D)
            kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=self.scale, enable_gqa=gqa)
            out[p.start:p.end] = op[0].transpose(0, 1)
        return out.view(T, H * D)


class TorchSDPABackend(AttentionBackend):
    name: ClassVar[str] = "TORCH_SDPA"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchSDPAImpl

    @staticmethod
    def get_supported_block_sizes() -> list[int]:
        return [8, 16, 32, 64, 128]
