"""Compile every kernel launch of the wrappers for sm_90 (Hopper) without a GPU.

The interpreter accepts code that the GPU compiler rejects (and the reverse), so off-GPU the
tests also run this script in a fresh process without ``TRITON_INTERPRET``: each wrapper runs
as usual, but ``JITFunction.run`` is replaced by "specialize the arguments as the launcher
would, compile for sm_90, do not launch". Launches are keyed as ``JITFunction.run`` keys its
cache, so a launch that a GPU would serve from a compiled variant reuses it here too, and the
script checks that attention's split count does not compile a variant per value. Prints one
line per compiled kernel; exits non-zero when a compilation or that check fails.

    python packages/platform-cuda/tests/kernels/compile_sm90.py
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_sm90.py compiles for the GPU: run it without TRITON_INTERPRET")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

try:
    import loom_platform_cuda  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from loom_platform_cuda import kernels as k  # noqa: E402
from loom_platform_cuda.kernels import activation, attention, cache, layernorm, rotary  # noqa: E402
from loom_plugin_api.ops import LoRAMapping, QuantizedWeight  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
compiled: list[str] = []


@dataclass(frozen=True, slots=True)
class Launch:
    kernel: str
    key: str  # Triton's cache key: one compiled variant per distinct key
    args: dict


launches: list[Launch] = []
variants: dict[tuple[str, str], object] = {}  # (kernel, key) -> compiled kernel


def compile_instead_of_launch(self: JITFunction, *args, grid, warmup, **kwargs):
    backend = make_backend(TARGET)
    binder = create_function_from_signature(self.signature, self.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    launches.append(Launch(self.__name__, compute_cache_key({}, specialization, options), dict(bound_args)))
    if (self.__name__, launches[-1].key) in variants:
        return variants[self.__name__, launches[-1].key]
    options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
    kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    variants[self.__name__, launches[-1].key] = kernel
    consts = {self.arg_names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
    shown = {name: v for name, v in consts.items() if name.isupper()}
    compiled.append(f"{self.__name__} shared={kernel.metadata.shared} {shown}")
    print(compiled[-1], flush=True)
    return kernel


def paged_batch(requests: list[tuple[int, int]], h: int, hk: int, d: int, bs: int, dtype: torch.dtype):
    blocks = sum(-(-ctx // bs) for ctx, _ in requests)
    q_lens = torch.tensor([q for _, q in requests])
    qsl = torch.zeros(len(requests) + 1, dtype=torch.int64)
    qsl[1:] = q_lens.cumsum(0)
    return dict(
        query=torch.randn(int(qsl[-1]), h * d).to(dtype),
        kv_cache=torch.zeros(2, blocks, bs, hk, d, dtype=dtype),
        query_start_loc=qsl,
        seq_lens=torch.tensor([ctx for ctx, _ in requests]),
        block_tables=torch.zeros(len(requests), blocks, dtype=torch.int64),
        scale=d**-0.5, max_query_len=int(q_lens.max()), max_seq_len=max(ctx for ctx, _ in requests),
    )


def check_split_counts_share_variants() -> None:
    """The split heuristic picks dozens of counts in a serve: each must not compile a new variant."""
    for name, requests in [("decode", [(2048, 1)] * 2), ("prefill", [(2048, 64), (300, 1)])]:
        first = len(launches)
        for n in (2, 3, 5, 17):  # 17 splits of 2048 keys become 16: Triton specializes multiples of 16
            b = paged_batch(requests, 32, 8, 128, 16, torch.bfloat16)
            # the block table's width follows the batch too (decode: 256 = 16 * 16, 257, 259, 271 columns)
            b["block_tables"] = torch.zeros(len(requests), b["block_tables"].shape[1] + n - 2, dtype=torch.int64)
            k.paged_attention(**b, num_splits=n)
        attn = [x for x in launches[first:] if x.kernel == "_paged_attn_kernel"]
        reduce = [x for x in launches[first:] if x.kernel == "_reduce_splits_kernel"]
        counts = sorted({x.args["num_splits"] for x in attn})
        blocks = {x.args["BLOCK_S"] for x in reduce}
        if len(counts) != 4 or len(reduce) != 4:
            sys.exit(f"{name}: expected 4 split launches with distinct counts, got counts {counts}")
        if len({x.key for x in attn}) != 1:
            sys.exit(f"{name}: split counts {counts} compile {len({x.key for x in attn})} variants of "
                     f"_paged_attn_kernel, expected 1")
        if len({x.key for x in reduce}) != len(blocks):
            sys.exit(f"{name}: split counts {counts} compile {len({x.key for x in reduce})} variants of "
                     f"_reduce_splits_kernel, expected one per BLOCK_S in {sorted(blocks)}")
        print(f"{name}: split counts {counts} share 1 attention variant and {len(blocks)} reduce variants")


def main() -> None:
    JITFunction.run = compile_instead_of_launch
    # The tensors here are CPU stand-ins that are never launched on: skip the CUDA-device check.
    # kernels.quantized_linear names the function (same name as its module): patch the module itself
    qlinear = sys.modules["loom_platform_cuda.kernels.quantized_linear"]
    lora = sys.modules["loom_platform_cuda.kernels.lora"]  # likewise
    for module in (activation, attention, cache, layernorm, rotary, qlinear, lora):
        module.check_device = lambda **tensors: None
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        b = paged_batch([(2048, 1)] * 4, 32, 8, 128, 16, dtype)
        k.paged_attention(**b, num_splits=4)  # decode, split-K and its reduce
        b = paged_batch([(2048, 512), (40, 1)], 32, 8, 128, 16, dtype)
        k.paged_attention(**b)  # prefill tiling on a mixed batch
    k.paged_attention(**paged_batch([(100, 1)] * 2, 12, 4, 80, 32, torch.bfloat16))  # group 3, head 80
    k.paged_attention(**paged_batch([(100, 10)] * 2, 8, 8, 64, 32, torch.bfloat16))  # MHA
    check_split_counts_share_variants()

    key = torch.randn(4, 8 * 128, dtype=torch.bfloat16)
    k.reshape_and_cache(key, key, torch.zeros(2, 4, 16, 8, 128, dtype=torch.bfloat16), torch.arange(4))
    x = torch.randn(4, 4096, dtype=torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16)
    k.rms_norm(x, w, 1e-6)
    k.rms_norm(x, w, 1e-6, x.clone())
    k.rms_norm(x, w, 1e-6, x.clone(), max_block=1024)  # two passes
    cos_sin = torch.randn(16, 128)
    for neox in (True, False):
        k.rotary_embedding(torch.arange(4), torch.randn(4, 32 * 128, dtype=torch.bfloat16),
                           torch.randn(4, 8 * 128, dtype=torch.bfloat16), 128, cos_sin, neox)
    k.silu_and_mul(torch.randn(4, 2 * 14336, dtype=torch.bfloat16))
    for bits in (4, 8):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for group in (128, 48):  # whole input blocks, and per-element scales
                codes = torch.randint(0, 2**bits, (256, 768), dtype=torch.uint8)
                weight = QuantizedWeight(codes, torch.rand(256, 768 // group), torch.zeros(256, 768 // group),
                                         bits, group)
                k.quantized_linear(torch.randn(4, 768, dtype=dtype), k.prepare_quantized_linear(weight, dtype))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for t, rank in ((4, 16), (300, 128)):  # decode (split-K), prefill with two rank tiles
            slots = LoRAMapping.from_token_slots(torch.arange(t) % 3 - 1)
            k.lora(torch.randn(t, 1024, dtype=dtype), torch.randn(t, 4096, dtype=dtype),
                   torch.randn(2, rank, 4096, dtype=dtype), torch.randn(2, 1024, rank, dtype=dtype), slots)
    slots = LoRAMapping.from_token_slots(torch.zeros(4, dtype=torch.int64))  # adapters kept in fp32
    k.lora(torch.randn(4, 512, dtype=torch.bfloat16), torch.randn(4, 512, dtype=torch.bfloat16),
           torch.randn(1, 8, 512), torch.randn(1, 512, 8), slots)
    print(f"compiled {len(compiled)} kernels for sm_90 ({len(launches)} launches)")


if __name__ == "__main__":
    main()
