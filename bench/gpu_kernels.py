"""Triton kernels of loom-platform-cuda against torch, as fractions of the device's peak.

    python bench/gpu_kernels.py            # every case
    python bench/gpu_kernels.py --quick    # the headline decode case and one case per kernel

Headline: paged-attention decode, batch 64 x context 2048, 32 query / 8 KV heads, head_size
128, bf16, block size 16 (goal: >= 70% of HBM bandwidth).

Each case prints the Triton kernel and torch's own way of doing the same op, timed in the same
run with ``triton.testing.do_bench`` (median; L2 flushed between runs), with achieved GB/s and
TFLOP/s over the op's useful bytes and FLOPs. Peaks come from the device, not from a table:

* memory bandwidth = 2 (double data rate) x memory clock x bus width, from
  ``torch.cuda.get_device_properties`` (``memory_clock_rate``, ``memory_bus_width``), else from
  NVML, else from ``nvidia-smi``; the header says which source answered;
* 16-bit tensor-core FLOP/s = SMs x SM clock (both read from the device) x the dense
  FLOP per SM per clock of the architecture (the one number no API reports: a small table).

Needs a CUDA device; elsewhere it says so and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

DEVICE = "cuda"  # where the case builders allocate (a name, so they can be dry-run on CPU)
# Dense fp16/bf16 tensor-core FLOP per SM per clock, by compute capability.
_TENSOR_FLOP_PER_SM_CLOCK = {(8, 0): 2048, (8, 6): 1024, (8, 7): 1024, (8, 9): 1024, (9, 0): 4096, (10, 0): 8192}


@dataclass(slots=True)
class Peak:
    bandwidth: float | None  # bytes/s
    bandwidth_source: str
    flops: float | None  # FLOP/s
    flops_source: str


@dataclass(slots=True)
class Impl:
    name: str
    run: Callable[[], object]


@dataclass(slots=True)
class Case:
    kernel: str
    shape: str
    bytes: int  # useful bytes moved by the op
    flops: int | None  # None for elementwise ops, where FLOP/s says nothing
    impls: list[Impl] = field(default_factory=list)  # the Triton kernel first
    check: Callable[[], float] | None = None  # max |triton - torch reference|


def read_peak(device: torch.device) -> Peak:
    props = torch.cuda.get_device_properties(device)
    bandwidth, source = None, "not reported"
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        bandwidth = 2 * clock_khz * 1e3 * bus_bits / 8
        source = f"torch device properties ({clock_khz / 1e3:.0f} MHz x {bus_bits}-bit x 2)"
    else:
        bandwidth, source = _peak_bandwidth_nvml(device.index or 0, bus_bits)
    flops, flops_source = None, f"no FLOP/clock figure for sm_{props.major}{props.minor}"
    per_clock = _TENSOR_FLOP_PER_SM_CLOCK.get((props.major, props.minor))
    if per_clock and props.clock_rate:
        flops = props.multi_processor_count * props.clock_rate * 1e3 * per_clock
        flops_source = (f"{props.multi_processor_count} SMs x {props.clock_rate / 1e3:.0f} MHz x "
                        f"{per_clock} FLOP/clock (sm_{props.major}{props.minor} dense 16-bit)")
    return Peak(bandwidth, source, flops, flops_source)


def _peak_bandwidth_nvml(index: int, bus_bits: int) -> tuple[float | None, str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        return 2 * mhz * 1e6 * bits / 8, f"NVML ({mhz} MHz x {bits}-bit x 2)"
    except Exception as exc:  # pynvml absent or too old: try nvidia-smi, and say why
        reason = f"NVML unavailable ({exc})"
    if not bus_bits:
        return None, f"{reason}; bus width unknown"
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=clocks.max.memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True)
        mhz = float(out.stdout.strip().splitlines()[0])
    except (OSError, subprocess.CalledProcessError, ValueError) as exc:
        return None, f"{reason}; nvidia-smi failed ({exc})"
    return 2 * mhz * 1e6 * bus_bits / 8, f"nvidia-smi ({mhz:.0f} MHz) x {bus_bits}-bit x 2"


# ---------------------------------------------------------------- paged batches


@dataclass(slots=True)
class Batch:
    query: torch.Tensor  # (T, H*D)
    kv_cache: torch.Tensor  # (2, num_blocks, block_size, Hk, D)
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    q_lens: list[int]
    ctx_lens: list[int]
    heads: tuple[int, int, int]  # H, Hk, D


def make_batch(requests: list[tuple[int, int]], h: int, hk: int, d: int, bs: int, dtype: torch.dtype) -> Batch:
    """requests: (context after the step, new tokens); blocks shuffled across the cache."""
    dev = DEVICE
    nblocks = [math.ceil(ctx / bs) for ctx, _ in requests]
    perm = torch.randperm(sum(nblocks), device=dev)
    tables = torch.zeros(len(requests), max(nblocks), dtype=torch.int64, device=dev)
    used = 0
    for i, n in enumerate(nblocks):
        tables[i, :n] = perm[used:used + n]
        used += n
    q_lens = [q for _, q in requests]
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int64, device=dev)
    return Batch(
        query=torch.randn(sum(q_lens), h * d, dtype=dtype, device=dev),
        kv_cache=torch.randn(2, sum(nblocks), bs, hk, d, dtype=dtype, device=dev),
        query_start_loc=qsl,
        seq_lens=torch.tensor([ctx for ctx, _ in requests], dtype=torch.int64, device=dev),
        block_tables=tables, q_lens=q_lens, ctx_lens=[ctx for ctx, _ in requests], heads=(h, hk, d),
    )


def gather_kv(b: Batch, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request i's K and V, (Hk, ctx, D) each, gathered through its block table."""
    bs = b.kv_cache.shape[2]
    pos = torch.arange(b.ctx_lens[i], device=DEVICE)
    slots = b.block_tables[i, pos // bs] * bs + pos % bs
    k = b.kv_cache[0].flatten(0, 1)[slots].transpose(0, 1)
    v = b.kv_cache[1].flatten(0, 1)[slots].transpose(0, 1)
    return k, v


def attention_case(name: str, requests: list[tuple[int, int]], k, ref, bs: int = 16,
                   dtype: torch.dtype = torch.bfloat16) -> Case:
    h, hk, d = 32, 8, 128
    b = make_batch(requests, h, hk, d, bs, dtype)
    scale = d**-0.5
    elt = b.query.element_size()
    visible = sum(sum(range(ctx - q + 1, ctx + 1)) for ctx, q in requests)  # keys seen, over all tokens
    nbytes = sum(b.ctx_lens) * hk * d * elt * 2 + 2 * b.query.numel() * elt
    args = (b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, scale,
            max(b.q_lens), max(b.ctx_lens))
    case = Case("paged_attention", f"{name} {h}/{hk} d{d} bs{bs}", nbytes, 4 * h * d * visible)
    case.impls.append(Impl("triton", lambda: k.paged_attention(*args)))
    g = h // hk
    is_decode = all(q == 1 for q in b.q_lens) and len(set(b.ctx_lens)) == 1
    if is_decode:
        # loom's torch_sdpa decode: one batched SDPA, the query heads of a group folded into L
        n, ctx = len(requests), b.ctx_lens[0]
        pos = torch.arange(ctx, device=DEVICE)
        slots = b.block_tables[:, pos // bs] * bs + pos % bs  # (B, ctx)
        qd = b.query.view(n, hk, g, d)

        def torch_decode(kk=None, vv=None):
            kk = b.kv_cache[0].flatten(0, 1)[slots].transpose(1, 2) if kk is None else kk  # (B, Hk, ctx, D)
            vv = b.kv_cache[1].flatten(0, 1)[slots].transpose(1, 2) if vv is None else vv
            return F.scaled_dot_product_attention(qd, kk, vv, scale=scale).reshape(n, h * d)

        kk = b.kv_cache[0].flatten(0, 1)[slots].transpose(1, 2).contiguous()
        vv = b.kv_cache[1].flatten(0, 1)[slots].transpose(1, 2).contiguous()
        case.impls.append(Impl("torch gather + sdpa", torch_decode))
        case.impls.append(Impl("torch sdpa, K/V pre-gathered", lambda: torch_decode(kk, vv)))
    else:
        def torch_prefill():
            out = torch.empty_like(b.query)
            for i, (ctx, q) in enumerate(requests):
                s = int(b.query_start_loc[i])
                kk, vv = gather_kv(b, i)
                qq = b.query[s:s + q].view(q, h, d).transpose(0, 1)  # (H, q, D)
                mask = None
                if q > 1 and q != ctx:
                    mask = torch.ones(q, ctx, dtype=torch.bool, device=DEVICE).tril(ctx - q)
                o = F.scaled_dot_product_attention(qq[None], kk[None], vv[None], attn_mask=mask,
                                                   is_causal=q > 1 and q == ctx, scale=scale, enable_gqa=True)
                out[s:s + q] = o[0].transpose(0, 1).reshape(q, h * d)
            return out

        case.impls.append(Impl("torch gather + sdpa per request", torch_prefill))
    case.check = lambda: (k.paged_attention(*args).float()
                          - ref.paged_attention_ref(b.query, b.kv_cache, b.query_start_loc, b.seq_lens,
                                                    b.block_tables, scale).float()).abs().max().item()
    return case


# ---------------------------------------------------------------- other kernels


def cache_case(k, ref, t: int = 4096, hk: int = 8, d: int = 128, bs: int = 16) -> Case:
    dt = torch.bfloat16
    nb = math.ceil(t / bs) + 64
    kv_cache = torch.zeros(2, nb, bs, hk, d, dtype=dt, device=DEVICE)
    key = torch.randn(t, hk * d, dtype=dt, device=DEVICE)
    value = torch.randn_like(key)
    slots = torch.randperm(nb * bs, device=DEVICE)[:t]
    flat_k, flat_v = kv_cache[0].view(-1, hk, d), kv_cache[1].view(-1, hk, d)

    def torch_cache():
        flat_k.index_copy_(0, slots, key.view(t, hk, d))
        flat_v.index_copy_(0, slots, value.view(t, hk, d))

    case = Case("reshape_and_cache", f"T{t} {hk}x{d} bs{bs}", 4 * key.numel() * 2 + slots.numel() * 8, None)
    case.impls += [Impl("triton", lambda: k.reshape_and_cache(key, value, kv_cache, slots)),
                   Impl("torch index_copy_", torch_cache)]

    def check() -> float:
        expected = ref.reshape_and_cache_ref(key, value, kv_cache, slots)
        k.reshape_and_cache(key, value, kv_cache, slots)
        return (kv_cache.float() - expected.float()).abs().max().item()

    case.check = check
    return case


def rms_norm_case(k, ref, t: int, hidden: int, residual: bool) -> Case:
    dt = torch.bfloat16
    x = torch.randn(t, hidden, dtype=dt, device=DEVICE)
    r = torch.randn_like(x) if residual else None
    w = torch.randn(hidden, dtype=dt, device=DEVICE)
    out, r_out = torch.empty_like(x), torch.empty_like(x)
    n = x.numel() * x.element_size()
    case = Case("rms_norm" + (" + residual" if residual else ""), f"T{t} hidden{hidden}",
                (4 if residual else 2) * n, None)
    if residual:
        case.impls.append(Impl("triton", lambda: k.rms_norm(x, w, 1e-6, r, out=out, residual_out=r_out)))
        case.impls.append(Impl("torch add + F.rms_norm", lambda: F.rms_norm(x + r, (hidden,), w, 1e-6)))
    else:
        case.impls.append(Impl("triton", lambda: k.rms_norm(x, w, 1e-6, out=out)))
        case.impls.append(Impl("torch F.rms_norm", lambda: F.rms_norm(x, (hidden,), w, 1e-6)))
    case.impls.append(Impl("torch reference (fp32)", lambda: ref.rms_norm_ref(x, w, 1e-6, r)))

    def check() -> float:
        got, expected = k.rms_norm(x, w, 1e-6, r), ref.rms_norm_ref(x, w, 1e-6, r)
        if residual:
            got, expected = got[0], expected[0]
        return (got.float() - expected.float()).abs().max().item()

    case.check = check
    return case


def rotary_case(k, ref, t: int = 4096, hq: int = 32, hk: int = 8, d: int = 128) -> Case:
    dt = torch.bfloat16
    query = torch.randn(t, hq * d, dtype=dt, device=DEVICE)
    key = torch.randn(t, hk * d, dtype=dt, device=DEVICE)
    positions = torch.randint(0, 8192, (t,), device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))
    freqs = torch.outer(torch.arange(8192, device=DEVICE).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], -1)
    elt = query.element_size()
    case = Case("rotary_embedding", f"T{t} {hq}/{hk} d{d} neox", 2 * (query.numel() + key.numel()) * elt
                + t * d * 4 + t * 8, None)
    case.impls += [Impl("triton (in place)", lambda: k.rotary_embedding(positions, query, key, d, cache, True)),
                   Impl("torch reference", lambda: ref.rotary_embedding_ref(positions, query, key, d, cache, True))]

    def check() -> float:
        expected = ref.rotary_embedding_ref(positions, query, key, d, cache, True)
        got = k.rotary_embedding(positions, query.clone(), key.clone(), d, cache, True)
        return max((a.float() - b.float()).abs().max().item() for a, b in zip(got, expected))

    case.check = check
    return case


def silu_case(k, ref, t: int = 4096, d: int = 14336) -> Case:
    x = torch.randn(t, 2 * d, dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty(t, d, dtype=x.dtype, device=DEVICE)
    case = Case("silu_and_mul", f"T{t} d{d}", 3 * t * d * x.element_size(), None)
    case.impls += [Impl("triton", lambda: k.silu_and_mul(x, out=out)),
                   Impl("torch F.silu * up", lambda: F.silu(x[:, :d]) * x[:, d:])]
    case.check = lambda: (k.silu_and_mul(x).float() - ref.silu_and_mul_ref(x).float()).abs().max().item()
    return case


# ---------------------------------------------------------------- run


def build_cases(quick: bool) -> list[Case]:
    from loom_platform_cuda import kernels as k
    from loom_platform_cuda.kernels import reference as ref

    cases = [attention_case("decode B64 ctx2048 (headline)", [(2048, 1)] * 64, k, ref)]
    if not quick:
        cases += [
            attention_case("decode B8 ctx8192 (split-K)", [(8192, 1)] * 8, k, ref),
            attention_case("decode B256 ctx512", [(512, 1)] * 256, k, ref),
            attention_case("decode B64 ctx2048 bs32", [(2048, 1)] * 64, k, ref, bs=32),
        ]
    cases.append(attention_case("prefill 4 x 2048", [(2048, 2048)] * 4, k, ref))
    if not quick:
        cases += [
            attention_case("chunked prefill 16 x 512 on 1536 cached", [(2048, 512)] * 16, k, ref),
            attention_case("mixed 32 decode ctx1024 + 2 x 512 chunks", [(1024, 1)] * 32 + [(1536, 512)] * 2, k, ref),
        ]
    cases += [cache_case(k, ref), rms_norm_case(k, ref, 4096, 4096, residual=True)]
    if not quick:
        cases.append(rms_norm_case(k, ref, 4096, 4096, residual=False))
    cases += [rotary_case(k, ref), silu_case(k, ref)]
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="headline decode and one case per kernel, short timing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_kernels.py: no CUDA device visible; the Triton kernel benchmark needs one. Nothing to do.")
        return 0
    try:
        import loom_platform_cuda  # noqa: F401
    except ImportError:  # not installed: bench the source tree
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "packages", "platform-cuda", "src"))
    import triton.testing

    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    peak = read_peak(device)
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}")
    bw = f"{peak.bandwidth / 1e9:.0f} GB/s" if peak.bandwidth else "unknown"
    fl = f"{peak.flops / 1e12:.0f} TFLOP/s" if peak.flops else "unknown"
    print(f"peak bandwidth {bw} [{peak.bandwidth_source}]; peak 16-bit tensor {fl} [{peak.flops_source}]")
    rep = 30 if args.quick else 100

    header = (f"{'kernel':<20} {'case':<58} {'impl':<32} {'us':>9} {'GB/s':>7} {'%BW':>5} "
              f"{'TFLOP/s':>8} {'%FLOP':>6} {'x triton':>8} {'max|err|':>9}")
    print(header)
    print("-" * len(header))
    failed = 0
    for case in build_cases(args.quick):
        triton_us = None
        try:
            err = f"{case.check():.2e}" if case.check else ""
        except Exception as exc:  # the timing below reports the failure itself
            err = f"error ({type(exc).__name__})"
        for i, impl in enumerate(case.impls):
            try:
                us = triton.testing.do_bench(impl.run, warmup=10, rep=rep, return_mode="median") * 1e3
            except Exception as exc:  # report and go on to the next case; the exit status says it failed
                failed += 1
                print(f"{case.kernel:<20} {case.shape:<58} {impl.name:<32} error: {type(exc).__name__}: {exc}")
                continue
            triton_us = us if i == 0 else triton_us
            gbs = case.bytes / us / 1e3
            tflops = case.flops / us / 1e6 if case.flops else None
            print(f"{case.kernel if i == 0 else '':<20} {case.shape if i == 0 else '':<58} {impl.name:<32} "
                  f"{us:9.1f} {gbs:7.0f} {_pct(gbs * 1e9, peak.bandwidth):>5} "
                  f"{f'{tflops:.1f}' if tflops is not None else '-':>8} "
                  f"{_pct(tflops * 1e12 if tflops else None, peak.flops):>6} "
                  f"{f'{us / triton_us:.2f}' if triton_us else '-':>8} {err if i == 0 else '':>9}")
    print("x triton: time relative to the Triton kernel (> 1: torch is slower). max|err|: Triton vs the fp32 "
          "torch reference.")
    return 1 if failed else 0


def _pct(value: float | None, peak: float | None) -> str:
    return f"{100 * value / peak:.0f}%" if value and peak else "-"


if __name__ == "__main__":
    sys.exit(main())
