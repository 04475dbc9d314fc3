"""CPU kernels compiled on this machine, for the torch SDPA backend's decode path.

``paged_decode.c`` is plain C over raw pointers: the system C compiler builds it in well
under a second with ``-march=native`` (so every CPU gets the vector instructions it has),
the result is cached under ``<LOOM_CACHE_DIR>/kernels/`` keyed by the source, the flags, the
compiler and the CPU, and ``ctypes`` calls it (the call releases the GIL). A torch C++
extension would give the same kernel but takes tens of seconds to compile against torch's
headers on two cores. Where no compiler is found, the build fails, the loaded kernel
disagrees with torch on a small check, or ``LOOM_CPU_NATIVE_KERNELS=0``, ``paged_decode()``
returns None and the backend keeps its torch path; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources

import torch

from ... import envs
from ...logger import init_logger
from ...platforms.cpu_features import cpu_flags

logger = init_logger(__name__)

_SOURCES = ("paged_decode.c", "paged_decode_dpbf16.c", "paged_decode_q8.c",  # compiled as one unit, in this order
            "paged_prefill_amx.c", "paged_prefill_f32.c")
_FLAGS = [
    "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
    # let the compiler vectorize float reductions (dot products, sums) across lanes
    "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64,
             _I64, _I64, _I64, _I64, _I64, ctypes.c_int, ctypes.c_float]
_KV_WRITE_ARGTYPES = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64]
_PREFILL_ARGTYPES = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64,
                     ctypes.c_int, ctypes.c_float]

tape: list | None = None
"""While a decode step is being captured (``loom.worker.cpu_step_replay``): every compiled
kernel call of the step, in order, appended by :func:`call`; None otherwise."""


def call(fn: ctypes._CFuncPtr, *args: object) -> int:
    """``fn(*args)``, and the call recorded on the :data:`tape` while a step is captured. Every
    call into this directory's and ``platforms/cpu_kernels.c``'s kernels goes through here:
    the arguments are plain ints and floats (pointers, strides, sizes), so the same call
    replays on the same buffers."""
    if tape is not None:
        tape.append((fn, args))
    return fn(*args)


class NativeKernelError(RuntimeError):
    pass


def _cpu_signature() -> bytes:
    """What ``-march=native`` may use: the machine and its instruction-set flags (the same
    ``/proc/cpuinfo`` read that ``dtype="auto"`` makes, done once per process)."""
    return " ".join([platform.machine(), *sorted(cpu_flags())]).encode()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise NativeKernelError("no C compiler found (cc, gcc or clang on PATH, or CC)")
    return cc


@functools.cache
def _compiler_version(cc: str) -> str:
    """``cc --version``, asked once per process (each kernel library's cache key includes it)."""
    return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout


def _build(cc: str, source: bytes, stem: str = "paged_decode", what: str = "the CPU paged-attention kernel") -> str:
    """Compile ``source`` into ``<LOOM_CACHE_DIR>/kernels/<stem>-<key>.so`` unless a build with
    the same key is cached; return the .so path. The CPU platform's fused ops build here too."""
    key = hashlib.sha256(b"\0".join(
        [source, " ".join(_FLAGS).encode(), _compiler_version(cc).encode(), _cpu_signature()])).hexdigest()[:16]
    folder = os.path.join(envs.LOOM_CACHE_DIR, "kernels")
    path = os.path.join(folder, f"{stem}-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = os.path.join(tmp, f"{stem}.c")
        with open(src, "wb") as f:
            f.write(source)
        out = os.path.join(tmp, "kernel.so")
        proc = subprocess.run([cc, *_FLAGS, "-o", out, src, "-lm"], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise NativeKernelError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[:2000]}")
        os.replace(out, path)  # atomic: another worker building the same key races harmlessly
    logger.info("Compiled %s into %s", what, path)
    return path


def torch_flash_uses_amx() -> bool:
    """Whether torch's CPU flash-attention kernel can be expected to run its bf16 matmuls on AMX
    tiles here (it takes oneDNN's brgemm, which packs for AMX where the CPU has it): the CPU
    reports AMX-BF16 (``/proc/cpuinfo``, and torch's own CPUID reading agrees) and this torch has
    oneDNN. Whether the kernel really does is what the measurement says: there it beat the
    prefill rows of ``paged_decode_dpbf16.c`` at every length measured (2026-12-06, 2 cores of a
    Xeon with AMX, the default model's heads, per layer: 16 x 128 tokens 1.5 vs 3.9 ms, one prompt
    of 1,000 3.4 vs 12.9, a chunk of 512 after 1,536 cached 5.0 vs 21.2 with its K/V gathered and
    masked)."""
    is_supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return ("amx_bf16" in cpu_flags() and is_supported is not None and bool(is_supported())
            and torch.backends.mkldnn.is_available())


class PagedDecode:
    """Decode attention straight from the paged cache; see ``paged_decode.c`` for layouts."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._fns, self._writes = {}, {}
        for dtype, suffix in _SUFFIX.items():
            fn = getattr(lib, f"paged_decode_{suffix}")
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            self._fns[dtype] = fn
            write = getattr(lib, f"kv_write_{suffix}")
            write.argtypes, write.restype = _KV_WRITE_ARGTYPES, ctypes.c_int
            self._writes[dtype] = write
        self._dp_used = lib.paged_decode_dp_bf16_used
        self._dp_used.argtypes, self._dp_used.restype = [_I64, _I64, _I64], ctypes.c_int
        self._takes_prefill: dict[tuple[torch.dtype, int, int, int], bool] = {}  # asked by every layer, every step
        self.sdpa_prefills_faster = torch_flash_uses_amx()
        self._prefill_amx = lib.paged_prefill_amx_bf16
        self._prefill_amx.argtypes, self._prefill_amx.restype = _PREFILL_ARGTYPES, ctypes.c_int
        lib.paged_prefill_amx_ready.restype = ctypes.c_int
        self.amx_prefill = bool(lib.paged_prefill_amx_ready())
        """Whether ``prefill`` runs here: built for AMX (``paged_prefill_amx.c``) and the tiles granted;
        cleared by the self-check (``_check_prefill``) where it fails or disagrees with the decode kernel."""
        self._prefill_f32 = lib.paged_prefill_f32
        self._prefill_f32.argtypes, self._prefill_f32.restype = _PREFILL_ARGTYPES, ctypes.c_int
        lib.paged_prefill_f32_ready.restype = ctypes.c_int
        self.f32_prefill = bool(lib.paged_prefill_f32_ready())
        """Whether fp32 prefill chunks should go to ``prefill`` (``paged_prefill_f32.c``): built for
        x86 with AVX2 and FMA and no AVX-512, where it was measured against torch's flash kernel.
        The call itself works on every CPU."""

    def supports(self, dtype: torch.dtype, head_size: int) -> bool:
        return dtype in self._fns and head_size % 8 == 0 and head_size <= 256

    def takes_prefill(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int) -> bool:
        """Whether prefill tokens should run through this kernel too (one query row per token, its
        context the positions up to its own): only where the AVX512-BF16 kernel computes them
        (``paged_decode_dpbf16.c``, which shares each K/V tile among 16 consecutive rows of a
        request). Per layer of the default model it took 2.5 ms for 16 prompts of 128 tokens
        where torch's flash kernel took 6.1, 8.2 vs 11.5 ms for one of 1,000 tokens, 139 vs 148
        for 4,096 (2026-12-05); the portable kernel is slower than torch's in fp32 and bf16. Not
        where torch's flash kernel multiplies on AMX tiles (``sdpa_prefills_faster``): there it
        took 1.5 ms where this kernel took 3.9 (16 x 128), 3.4 vs 12.9 (1,000), 35 vs 197 (4,096)."""
        key = (dtype, num_heads, num_kv_heads, head_size)
        takes = self._takes_prefill.get(key)
        if takes is None:
            takes = self._takes_prefill[key] = dtype == torch.bfloat16 and not self.sdpa_prefills_faster and bool(
                self._dp_used(num_heads, num_kv_heads, head_size))
        return takes

    def takes_amx_prefill(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int) -> bool:
        """Whether :meth:`prefill` takes chunks of this shape on AMX tiles: bf16, head size a
        multiple of 32 up to 128."""
        return (self.amx_prefill and dtype == torch.bfloat16 and head_size % 32 == 0 and 0 < head_size <= 128
                and num_heads % num_kv_heads == 0)

    def takes_f32_prefill(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int) -> bool:
        """Whether fp32 prefill chunks of this shape should go to :meth:`prefill` here
        (``f32_prefill``): head size a multiple of 16 up to 256."""
        return (self.f32_prefill and dtype == torch.float32 and head_size % 16 == 0 and 0 < head_size <= 256
                and num_heads % num_kv_heads == 0)

    def prefill(self, query: torch.Tensor, chunks: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                tables: torch.Tensor, out: torch.Tensor, *, num_heads: int, block_size: int, scale: float) -> None:
        """Write into ``out`` the causal attention of the step's prefill ``chunks``: bf16 on AMX tiles
        (``paged_prefill_amx.c``), fp32 on 8-lane FMA tiles (``paged_prefill_f32.c``). ``chunks``:
        (n, 4) int64 rows of (first query row, tokens, context, row of ``tables``), a chunk's query
        rows the last ``tokens`` positions of its context, whose K/V (its own included) are in the
        cache. Other layouts as in :meth:`__call__`."""
        _, hk, d = k_cache.shape
        fp32 = query.dtype == torch.float32
        name = "paged_prefill_f32" if fp32 else "paged_prefill_amx"
        if not (query.dtype == k_cache.dtype == v_cache.dtype == out.dtype and query.dtype in (torch.float32,
                                                                                            torch.bfloat16)
                and query.stride(1) == out.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
                and tables.dtype == torch.int64 and tables.stride(1) == 1 and chunks.dtype == torch.int64
                and chunks.is_contiguous() and chunks.dim() == 2 and chunks.shape[1] == 4):
            raise ValueError(f"{name}: dtypes or strides do not match the kernel's layout")
        rc = call(self._prefill_f32 if fp32 else self._prefill_amx, query.data_ptr(), query.stride(0),
                  chunks.data_ptr(), chunks.shape[0], k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                  tables.stride(0), out.data_ptr(), out.stride(0), num_heads, hk, d, block_size,
                  torch.get_num_threads(), scale)
        if rc == 2:
            sizes = "a multiple of 16 up to 256" if fp32 else "a multiple of 32 up to 128"
            raise ValueError(f"{name}: head size {d} is not {sizes}, or {num_heads} heads are not a multiple of "
                             f"{hk} KV heads")
        if rc == 3:
            raise RuntimeError("paged_prefill_amx: this build has no AMX kernel, or Linux refused the tiles")
        if rc:
            raise MemoryError(f"the CPU prefill kernel ({name}) could not allocate its scratch memory")

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, k_rows: torch.Tensor,
                 v_rows: torch.Tensor) -> bool:
        """``k_rows[slots] = key`` and ``v_rows[slots] = value`` for (T, row) ``key``/``value`` with
        unit inner strides, caches (num_slots, row) contiguous, ``slots`` (T,) int64 contiguous;
        False (nothing written) where the dtypes or layouts are not those. A slot out of range
        raises ``IndexError``, as ``index_copy_`` does."""
        fn = self._writes.get(key.dtype)
        t, row = key.shape[0], k_rows.shape[1]
        if (fn is None or not key.dtype == value.dtype == k_rows.dtype == v_rows.dtype or key.dim() != 2
                or value.dim() != 2 or key.shape[1] != row or value.shape != key.shape or key.stride(1) != 1
                or value.stride(1) != 1 or not (k_rows.is_contiguous() and v_rows.is_contiguous())
                or v_rows.shape != k_rows.shape or slots.dtype != torch.int64 or not slots.is_contiguous()
                or slots.shape != (t,)):
            return False
        if call(fn, key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), slots.data_ptr(), t, row,
                k_rows.data_ptr(), v_rows.data_ptr(), k_rows.shape[0]):
            raise IndexError(f"a slot of {slots.tolist()} is outside the KV cache's {k_rows.shape[0]} slots")
        return True

    def __call__(self, query: torch.Tensor, rows_q: torch.Tensor, rows_req: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, ctx_lens: torch.Tensor,
                 out: torch.Tensor, *, num_heads: int, block_size: int, scale: float) -> None:
        """Write into ``out`` the attention of query rows ``rows_q`` over their contexts.

        ``query``/``out``: (T, H*D), unit inner stride; ``k_cache``/``v_cache``: (slots, Hk, D)
        contiguous; ``rows_q``, ``rows_req`` (row of ``tables``) and ``ctx_lens``: (B,) int64;
        ``tables``: (R, max_blocks) int64 with unit inner stride. Shapes are the caller's to
        get right (the backend builds them once per step); dtypes and strides are checked.
        """
        fn = self._fns[query.dtype]
        _, hk, d = k_cache.shape
        if not (query.dtype == k_cache.dtype == v_cache.dtype == out.dtype and query.stride(1) == out.stride(1) == 1
                and k_cache.is_contiguous() and v_cache.is_contiguous() and tables.dtype == torch.int64
                and tables.stride(1) == 1
                and all(t.dtype == torch.int64 and t.is_contiguous() for t in (rows_q, rows_req, ctx_lens))):
            raise ValueError("paged_decode: dtypes or strides do not match the kernel's layout")
        rc = call(fn, query.data_ptr(), query.stride(0), rows_q.data_ptr(), rows_req.data_ptr(),
                  k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
                  ctx_lens.data_ptr(), out.data_ptr(), out.stride(0), rows_q.shape[0], num_heads, hk, d,
                  block_size, torch.get_num_threads(), scale)
        if rc == 2:
            raise ValueError(f"paged_decode: head size {d} is not a multiple of 8 up to 256, or {num_heads} "
                             f"heads are not a multiple of {hk} KV heads")
        if rc:
            raise MemoryError("the CPU paged-attention kernel could not allocate its scratch memory")


def _reference(query, rows_q, rows_req, k_cache, v_cache, tables, ctx_lens, num_heads, block_size, scale):
    """The same attention in torch ops, one request at a time (the self-check's answer)."""
    _, hk, d = k_cache.shape
    out = []
    for rq, rr, n in zip(rows_q.tolist(), rows_req.tolist(), ctx_lens.tolist()):
        pos = torch.arange(n)
        slots = tables[rr][pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(num_heads // hk, dim=1).transpose(0, 1)  # (H, n, D)
        v = v_cache[slots].float().repeat_interleave(num_heads // hk, dim=1).transpose(0, 1)
        q = query[rq].float().view(num_heads, 1, d)
        out.append(torch.softmax(q @ k.transpose(1, 2) * scale, dim=-1) @ v)
    return torch.stack(out).view(len(out), -1)


def _self_check(kernel: PagedDecode) -> None:
    """A small GQA problem with scattered blocks, per dtype, against ``_reference``."""
    g = torch.Generator().manual_seed(0)
    h, hk, d, bs, blocks = 4, 2, 16, 4, 12
    tables = torch.randperm(blocks, generator=g).view(3, 4)
    ctx = torch.tensor([13, 1, 16])
    rows_q, rows_req = torch.tensor([2, 0, 1]), torch.tensor([0, 2, 1])
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        query = torch.randn(3, h * d + 8, generator=g).to(dtype)[:, : h * d]  # strided rows, like a qkv split
        k_cache, v_cache = (torch.randn(blocks * bs, hk, d, generator=g).to(dtype) for _ in range(2))
        out = torch.zeros(3, h * d, dtype=dtype)
        kernel(query, rows_q, rows_req, k_cache, v_cache, tables, ctx, out, num_heads=h, block_size=bs,
               scale=d**-0.5)
        want = _reference(query, rows_q, rows_req, k_cache, v_cache, tables, ctx, h, bs, d**-0.5)
        if not torch.allclose(out[rows_q].float(), want, atol=tol, rtol=tol):
            raise NativeKernelError(f"the compiled kernel disagrees with torch in {dtype} "
                                    f"(max error {(out[rows_q].float() - want).abs().max():.3g})")
        kv = torch.randn(3, 2 * hk * d + 4, generator=g).to(dtype)  # strided rows, like a qkv split
        slots = torch.tensor([5, 0, 17])
        k_rows, v_rows = k_cache.view(-1, hk * d).clone(), v_cache.view(-1, hk * d).clone()
        if not kernel.write_kv(kv[:, : hk * d], kv[:, hk * d: 2 * hk * d], slots, k_rows, v_rows):
            raise NativeKernelError(f"the compiled KV write refused a {dtype} problem")
        k_want = k_cache.view(-1, hk * d).index_copy(0, slots, kv[:, : hk * d])
        v_want = v_cache.view(-1, hk * d).index_copy(0, slots, kv[:, hk * d: 2 * hk * d])
        if not (torch.equal(k_rows, k_want) and torch.equal(v_rows, v_want)):
            raise NativeKernelError(f"the compiled KV write disagrees with index_copy_ in {dtype}")
    # bf16 with a head size that is a multiple of 32 takes the AVX512-BF16 kernel where the CPU
    # has it: a prefill run (three rows of request 0, contexts growing by one) and two decode rows
    h, hk, d = 4, 2, 32
    rows_q, rows_req = torch.tensor([4, 0, 1, 2, 3]), torch.tensor([0, 0, 0, 1, 2])
    ctx = torch.tensor([3, 4, 5, 16, 9])
    k_cache, v_cache = (torch.randn(blocks * bs, hk, d, generator=g).to(torch.bfloat16) for _ in range(2))
    query = torch.randn(5, h * d, generator=g).to(torch.bfloat16)
    out = torch.zeros(5, h * d, dtype=torch.bfloat16)
    kernel(query, rows_q, rows_req, k_cache, v_cache, tables, ctx, out, num_heads=h, block_size=bs, scale=d**-0.5)
    want = _reference(query, rows_q, rows_req, k_cache, v_cache, tables, ctx, h, bs, d**-0.5)
    if not torch.allclose(out[rows_q].float(), want, atol=2e-2, rtol=2e-2):
        raise NativeKernelError(f"the compiled kernel disagrees with torch in bf16 with head size {d} "
                                f"(max error {(out[rows_q].float() - want).abs().max():.3g})")
    if kernel.amx_prefill:
        _check_prefill(kernel, g, torch.bfloat16)
    if kernel.f32_prefill:
        _check_prefill(kernel, g, torch.float32)


def _check_prefill(kernel: PagedDecode, g: torch.Generator, dtype: torch.dtype) -> None:
    """Prefill chunks (bf16 on AMX tiles, or fp32) against the decode kernel's rows (already checked
    against torch): a partial row block, whole blocks read from the step's rows in place, two key
    blocks at a time, every tile of a head of 128, and a context of two of the AMX kernel's softmax
    passes. Where they disagree, or a call fails, prefills of that dtype keep their other paths."""
    flag, what = ("amx_prefill", "AMX") if dtype == torch.bfloat16 else ("f32_prefill", "fp32")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    problems = [  # heads, KV heads, head size, block size, chunks (first row, tokens, context, table row)
        (4, 2, 128, 8, [[0, 5, 5, 1], [5, 38, 58, 0]]),  # 5 fresh tokens; 38 after 20 cached
        (2, 1, 32, 16, [[0, 20, 2048, 0]]),  # 20 after 2,028 cached: two whole passes
    ]
    try:
        for h, hk, d, bs, chunks in problems:
            blocks = (max(c[2] for c in chunks) + bs - 1) // bs
            tables = torch.randperm(len(chunks) * blocks, generator=g).view(len(chunks), blocks)
            k_cache, v_cache = (torch.randn(tables.numel() * bs, hk, d, generator=g).to(dtype) for _ in range(2))
            t = sum(c[1] for c in chunks)
            query = torch.randn(t, h * d + 8, generator=g).to(dtype)[:, : h * d]  # strided, as a qkv split
            out, want = (torch.zeros(t, h * d, dtype=dtype) for _ in range(2))
            kernel.prefill(query, torch.tensor(chunks), k_cache, v_cache, tables, out, num_heads=h, block_size=bs,
                           scale=d**-0.5)
            rows_req = torch.cat([torch.full((n,), r) for _, n, _, r in chunks])  # each token a decode row
            ctx = torch.cat([torch.arange(c - n + 1, c + 1) for _, n, c, _ in chunks])
            kernel(query, torch.arange(t), rows_req, k_cache, v_cache, tables, ctx, want, num_heads=h,
                   block_size=bs, scale=d**-0.5)
            if not torch.allclose(out.float(), want.float(), atol=tol, rtol=tol):
                raise NativeKernelError(f"it disagrees with the decode kernel (max error "
                                        f"{(out.float() - want.float()).abs().max():.3g})")
    except (RuntimeError, ValueError, MemoryError) as e:  # NativeKernelError among them
        setattr(kernel, flag, False)
        logger.warning("The CPU %s prefill kernel failed its self-check (%s); prefill attention keeps torch's SDPA",
                       what, e)


@functools.cache
def paged_decode() -> PagedDecode | None:
    """The compiled decode kernel, or None (the reason logged once) where it cannot be had."""
    if not envs.LOOM_CPU_NATIVE_KERNELS:
        logger.info("LOOM_CPU_NATIVE_KERNELS=0: CPU decode attention runs on torch ops")
        return None
    try:
        files = resources.files(__package__)
        source = b"".join(files.joinpath(f).read_bytes() for f in _SOURCES)
        kernel = PagedDecode(ctypes.CDLL(_build(_compiler(), source)))
        _self_check(kernel)
        return kernel
    except (NativeKernelError, OSError, subprocess.SubprocessError, AttributeError) as e:
        logger.warning("CPU paged-attention kernel unavailable, decode attention runs on torch ops "
                       "(slower): %s. Install a C compiler with OpenMP (gcc) to enable it, or set "
                       "LOOM_CPU_NATIVE_KERNELS=0 to silence this.", e)
        return None
