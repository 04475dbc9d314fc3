"""Roofline: loom's offline throughput as a fraction of this machine's GEMM-only bound.

For each model: the FLOPs of every linear layer of the workload (from the model's config,
per token through the layers; the LM head only where loom samples: the last prompt token
and each decode step), each of those shapes timed on this machine at the batch sizes the
scheduler runs (the prefill token budget, the decode batch) with ``F.linear``, with the
oneDNN-prepacked weight and, in fp32 on AVX2 CPUs and bf16 on AVX512-BF16 ones, with loom's own GEMM on the weight's panels
(``platforms/cpu_gemm.c``), each cycling through copies of its weight that add up to all the
weights of a step (so each comes from where a step's weights live: cache for a tiny model,
memory for a real one), and the bound = those FLOPs at the fastest of those speeds. Then
loom's output tok/s (``offline_throughput.run_loom``) as % of the bound, and (unless
``--no-profile``) two more runs of the workload on a fresh engine, each with new prompts so
that the prefix cache cannot help: one timed per step, one under
``torch.profiler``. Steps are split into prefill steps (prompt tokens scheduled; decodes of
earlier requests ride along) and decode steps, and the profiler's self CPU time per step is
bucketed into GEMMs, attention, norms and activations, embedding and LM head, sampling, other
ops and Python, through scopes the script hooks onto loom's modules and names it gives the CPU
platform's compiled kernels (each call of a replayed decode step's too, which otherwise run as
one C call per run of them and would count as the engine's own time).

The GEMM-only bound leaves out attention, whose decode steps read every running request's K/V
from memory: for the default model at 64 requests about as many bytes as the weights. A second
figure adds that reading, at the read bandwidth of a 1 GiB ``torch`` sum measured in the same
run (``single_stream.read_bandwidth``), to the GEMMs' time: the K/V each decode step attends to
(the cache's bytes per token: the model's dtype, or int8 codes and their scales), summed over
the workload. It counts no attention arithmetic and no prefill attention, and assumes the K/V
reads do not overlap the GEMMs and go no faster than that sum: an estimate of what the decode
steps cannot avoid, not a hard limit. The decode breakdown gives the same for one step: the
weights and the K/V it reads, and the time they take at that bandwidth.

With ``--peer-python`` (vLLM's interpreter, ``../shared/TOOLCHAIN.md``) the random-shape
models also run through vLLM's CPU build (``peer_vllm.py``) on the same prompts and weights,
in the same run, and the table gives loom / vLLM beside loom / bound.

    python bench/roofline.py --models opt-125m --dtype bfloat16
    python bench/roofline.py --models default opt-2m --no-profile
    python bench/roofline.py --models opt-125m opt-2m --dtype bfloat16 --no-profile --peer-python /tmp/vllm/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from loom.attention.backends import kv_int8, native
from loom.layers import onednn
from loom.platforms import cpu_gemm
from loom.worker import cpu_step_replay
from loom_plugin_api import custom_op
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(__file__))
from offline_throughput import SHAPES, VOCAB, build_random_model, run_loom, workload  # noqa: E402
from single_stream import read_bandwidth  # noqa: E402

# Module scopes: the bucket of everything a module runs, by a class name in its MRO.
SCOPES = {cls: bucket for bucket, classes in {
    "GEMMs": ["LinearBase"], "attention": ["Attention"], "rotary embedding": ["RotaryEmbedding"],
    "norms & activations": ["LayerNorm", "RMSNorm", "SiluAndMul", "ReLU", "GELU", "SiLU"],
    "embedding & LM head": ["VocabParallelEmbedding", "Embedding"], "sampling": ["LogitsProcessor", "Sampler"],
}.items() for cls in classes}
# Inside the LM head scope the GEMMs are the LM head; the running max/argmax is sampling.
SPLIT = {("sampling", "GEMMs"): "embedding & LM head"}
# Ops outside any module scope (and their children), by name.
OPS = [
    (re.compile(r"addmm|::mm$|::bmm$|::linear$|::matmul$|mkldnn|onednn"), "GEMMs"),
    (re.compile(r"q4_linear|q8_linear|qa_linear|panel_linear"), "GEMMs"),  # the CPU kernels of quantized weights, and loom's panel GEMM
    (re.compile(r"scaled_dot_product|flash_attention|index_copy|paged_decode|paged_prefill|kv_write"), "attention"),
    (re.compile(r"rotary"), "rotary embedding"),
    (re.compile(r"layer_norm|rms_norm|gelu|silu|relu"), "norms & activations"),
    (re.compile(r"::embedding"), "embedding & LM head"),
    (re.compile(r"argmax|topk|sort|softmax|multinomial|::max$"), "sampling"),
]
ROWS = [*dict.fromkeys(SCOPES.values()), "other aten ops", "Python in model code", "engine outside the model"]
STEP, MODEL = "engine step", "model forward"  # the scopes this script adds besides SCOPES' buckets
LABELS = {MODEL, *SCOPES.values()}


def model_linears(cfg: Any) -> tuple[list[tuple[str, int, int]], int, int, int]:
    """``([(name, in, out)] of one layer's linears as loom fuses them, LM head in, vocab, heads * head_dim)``."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    d = getattr(cfg, "head_dim", None) or h // heads
    mlp = {"opt": lambda f: [("fc1", h, f), ("fc2", f, h)],
           "llama": lambda f: [("gate_up", h, 2 * f), ("down", f, h)]}[cfg.model_type]
    ffn = getattr(cfg, "ffn_dim", None) or cfg.intermediate_size
    layer = [("qkv", h, (heads + 2 * kv_heads) * d), ("o", heads * d, h), *mlp(ffn)]
    return layer, getattr(cfg, "word_embed_proj_dim", None) or h, cfg.vocab_size, heads * d


def kv_bytes_per_token(model_config: Any, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """Bytes of one token's K and V in every layer's cache (the engine's ``ModelConfig`` gives the
    shapes): the model's dtype, or the int8 cache's row (codes and scales, ``kv_int8.row_bytes``)."""
    kv_heads, d = model_config.get_num_kv_heads(), model_config.get_head_size()
    row = kv_int8.row_bytes(kv_heads, d) if kv_cache_dtype == "int8" else kv_heads * d * dtype.itemsize
    return 2 * model_config.get_num_layers() * row


def time_linear(m: int, k: int, n: int, bias: bool, dtype: torch.dtype, copies: int = 1) -> dict[str, float]:
    """Median seconds of (m, k) x (n, k) by each GEMM this machine has for it: ``F.linear``; the
    weight prepacked for oneDNN (oneDNN's own call, also where ``onednn.linear`` hands many fp32
    rows to BLAS; inf where this torch cannot); and loom's own GEMM on the weight's panels
    (``platforms/cpu_gemm.c``: fp32 on AVX2 CPUs, bf16 on AVX512-BF16 ones; inf elsewhere), after warm-up. The weight cycles
    through ``copies`` tensors (``step_copies``), so it comes from where the weights of a whole
    step live. The bound takes the fastest."""
    x, ws = torch.randn(m, k, dtype=dtype), [torch.randn(n, k, dtype=dtype) for _ in range(copies)]
    b = torch.randn(n, dtype=dtype) if bias else None
    forms: dict[str, list[torch.Tensor] | None] = {"F.linear": ws, "oneDNN": None, "panels": None}
    if onednn.available() and dtype in onednn.DTYPES:
        forms["oneDNN"] = [onednn.pack_weight(w) for w in ws]
    gemm = onednn._panel_gemm()
    if gemm is not None and dtype in gemm.dtypes and cpu_gemm.fits(ws[0]):
        forms["panels"] = [cpu_gemm.to_panels(w) for w in ws]

    def run(w: torch.Tensor) -> None:  # oneDNN itself for a packed weight (onednn.linear may not call it)
        if w.is_mkldnn:
            torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        else:
            onednn.linear(x, w, b)  # F.linear, or the panel GEMM for a 3-D weight

    def median(weights: list[torch.Tensor] | None) -> float:
        if weights is None:
            return float("inf")
        times = []
        with torch.inference_mode():
            for i in range(200):
                start = time.perf_counter()
                run(weights[i % copies])
                times.append(time.perf_counter() - start)
                if i >= max(12, copies + 3) and sum(times[3:]) > 0.3:
                    break
        return statistics.median(times[3:])

    return {name: median(weights) for name, weights in forms.items()}


def step_copies(k: int, n: int, step_bytes: int, itemsize: int, at_least: int) -> int:
    """How many copies of a (n, k) weight add up to ``step_bytes``, the weights one step reads
    (at least ``at_least``): made one after another and timed in that order, each is read with
    a step's worth of weights touched since its last use, as in a step. Cycling
    through one layer's shape alone (one copy per layer) would keep a small weight in a large
    last-level cache that a real step, streaming every other weight and the K/V between two
    reads of it, does not give it (a 64 x 576 -> 576 decode GEMM of the default model: 43 us
    with its 30 copies, 110 us inside the model's step, on a Xeon with 480 MiB of L3)."""
    return max(at_least, -(-step_bytes // (k * n * itemsize)))


def roofline(cfg: Any, dtype: torch.dtype, args: argparse.Namespace, engine_config: Any) -> dict[str, Any]:
    budget = engine_config.scheduler_config.max_num_batched_tokens
    max_seqs = engine_config.scheduler_config.max_num_seqs
    layer, lm_in, vocab, q_dim = model_linears(cfg)
    bias = bool(getattr(cfg, "enable_bias", False) or getattr(cfg, "attention_bias", False))
    P, In, Out, L = args.num_prompts, args.input_len, args.output_len, cfg.num_hidden_layers
    size = dtype.itemsize
    step_bytes = size * (L * sum(k * n for _, k, n in layer) + lm_in * vocab)  # every weight, once
    m = {"prefill": min(budget, P * In), "decode": min(P, max_seqs)}  # rows of one step's layer GEMMs
    m_lm = {"prefill": max(1, min(P, budget // In)), "decode": m["decode"]}  # rows that sample in one step
    timed = [(name, ph, m[ph], k, n, time_linear(m[ph], k, n, bias, dtype, step_copies(k, n, step_bytes, size, L)))
             for ph in m for name, k, n in layer]
    timed += [("lm_head", ph, m_lm[ph], lm_in, vocab, time_linear(m_lm[ph], lm_in, vocab, False, dtype,
                                                                  step_copies(lm_in, vocab, step_bytes, size, 1)))
              for ph in m]
    rows = [(*shape, min(ts.values())) for *shape, ts in timed]
    t_layers = {ph: L * sum(t for name, p, *_, t in rows if p == ph and name != "lm_head") for ph in m}
    t_lm = {p: t for name, p, *_, t in rows if name == "lm_head"}
    tokens = {"prefill": P * In, "decode": P * (Out - 1)}  # through the layers (the last sample is not fed back)
    samples = {"prefill": P, "decode": P * (Out - 1)}  # through the LM head
    per_token, lm_flops = 2 * L * sum(k * n for _, k, n in layer), 2 * lm_in * vocab
    seconds = sum(t_layers[ph] * tokens[ph] / m[ph] + t_lm[ph] * samples[ph] / m_lm[ph] for ph in m)
    decode_contexts = P * sum(In + i for i in range(1, Out))  # the tokens each decode query attends to
    contexts = P * In * (In + 1) // 2 + decode_contexts  # causal context of every query
    kv_bytes = decode_contexts * kv_bytes_per_token(engine_config.model_config, dtype, args.kv_cache_dtype)
    kv_seconds = kv_bytes / args.bandwidth
    return dict(rows=rows, timed=timed, per_token=per_token, lm_flops=lm_flops, seconds=seconds, tok_s=P * Out / seconds,
                flops=sum(per_token * tokens[ph] + lm_flops * samples[ph] for ph in m),
                m=m, t_layers=t_layers, attn_flops=4 * q_dim * contexts * L, kv_bytes=kv_bytes,
                kv_tok_s=P * Out / (seconds + kv_seconds), weight_bytes=step_bytes,
                # one decode step of m["decode"] requests, on average
                step_kv_bytes=kv_bytes * m["decode"] / max(P * (Out - 1), 1))


def si(x: float, unit: str) -> str:
    return next((f"{x / f:.3g} {p}{unit}" for p, f in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)) if x >= f),
                f"{x:.3g} {unit}")


def instrument(llm: Any, phases: list[list[Any]], modules: bool) -> Callable[[], None]:
    """Wrap each engine step in a ``STEP`` scope, ``phases`` getting ``[prefill|decode|idle, tokens,
    seconds]`` per step; with ``modules``, a scope around the model and each module ``SCOPES``
    names. Returns the undo."""
    core, executor = llm.engine_core, llm.llm_engine.executor
    runner = executor.worker.model_runner
    step, execute, greedy = core.step, executor.execute_model, runner.model.logits_processor.greedy_token_ids
    stack: list[record_function] = []

    def enter(label: str, *_: Any) -> None:
        stack.append(record_function(label))
        stack[-1].__enter__()

    def leave(*_: Any) -> None:
        stack.pop().__exit__(None, None, None)

    def tagged_step(*a: Any, **kw: Any) -> Any:
        n, start = len(phases), time.perf_counter()
        with record_function(STEP):
            out = step(*a, **kw)
        if len(phases) == n:  # nothing ran: keep phases in step with the STEP events
            phases.append(["idle", 0, 0.0])
        phases[-1][2] = time.perf_counter() - start
        return out

    def tagged_execute(out: Any) -> Any:
        tokens = [len(r.token_ids) for r in out.scheduled]
        phases.append(["prefill" if any(t > 1 for t in tokens) else "decode", sum(tokens), 0.0])
        return execute(out)

    def scoped_greedy(*a: Any, **kw: Any) -> Any:  # the fused greedy LM head is no forward()
        with record_function("sampling"):
            return greedy(*a, **kw)

    # The CPU attention kernels are ctypes calls, no aten ops: give them names, or their time
    # would count as the attention scope's own Python.
    kernel_cls = native.PagedDecode
    kernel_call, prefill_call = kernel_cls.__call__, kernel_cls.prefill

    def named_kernel(*a: Any, **kw: Any) -> Any:
        with record_function("loom::paged_decode"):
            return kernel_call(*a, **kw)

    def named_prefill(self: Any, query: Any, *a: Any, **kw: Any) -> Any:
        name = "paged_prefill_f32" if query.dtype == torch.float32 else "paged_prefill_amx"
        with record_function(f"loom::{name}"):
            return prefill_call(self, query, *a, **kw)

    # and loom's own GEMM (eager steps: prefill, the LM head), with its SiLU-and-mul pass (a GEMM)
    gemm_call, gated_call = cpu_gemm.PanelGemm.__call__, cpu_gemm.PanelGemm.silu_and_mul

    def named_gemm(*a: Any, **kw: Any) -> Any:
        with record_function("loom::panel_linear"):
            return gemm_call(*a, **kw)

    def named_gated(*a: Any, **kw: Any) -> Any:
        with record_function("loom::panel_linear_silu"):
            return gated_call(*a, **kw)

    # Likewise the CPU platform's fused kernels behind the ops' forward_cpu (looked up per call).
    installed = dict(custom_op.kernel_registry)
    # A replayed decode step (cpu_step_replay) makes its compiled-kernel calls in one C call per
    # run of them, no op and no module in sight: make them one by one, each named (a µs of
    # Python each, against kernels of tens of µs), or the whole step would count as the engine's.
    tape_call = cpu_step_replay._Tape.__call__

    def named_tape(tape: Any) -> int:
        for i, (fn, _) in enumerate(tape._calls):
            with record_function(f"loom::{getattr(fn, '__name__', 'kernel')}"):
                if tape.call_one(i):
                    name = getattr(fn, "__name__", fn)
                    raise cpu_step_replay.StepReplayError(f"{name} failed in a replayed decode step (call {i})")
        return 0

    def named(label: str, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        with record_function(label):
            return fn(*a, **kw)

    if modules:
        kernel_cls.__call__, kernel_cls.prefill = named_kernel, named_prefill
        cpu_gemm.PanelGemm.__call__, cpu_gemm.PanelGemm.silu_and_mul = named_gemm, named_gated
        cpu_step_replay._Tape.__call__ = named_tape
        for name, fn in installed.items():
            custom_op.kernel_registry[name] = functools.partial(named, f"loom::{name}", fn)
    handles = []
    for module in [*runner.model.modules(), runner.sampler] if modules else []:
        label = MODEL if module is runner.model else next(
            (SCOPES[c.__name__] for c in type(module).__mro__ if c.__name__ in SCOPES), None)
        if label is not None:
            handles += [module.register_forward_pre_hook(functools.partial(enter, label)),
                        module.register_forward_hook(leave)]
    core.step, executor.execute_model = tagged_step, tagged_execute
    runner.model.logits_processor.greedy_token_ids = scoped_greedy

    def undo() -> None:
        for h in handles:
            h.remove()
        del core.step, executor.execute_model, runner.model.logits_processor.greedy_token_ids
        kernel_cls.__call__, kernel_cls.prefill = kernel_call, prefill_call
        cpu_gemm.PanelGemm.__call__, cpu_gemm.PanelGemm.silu_and_mul = gemm_call, gated_call
        cpu_step_replay._Tape.__call__ = tape_call
        custom_op.kernel_registry.update(installed)
    return undo


def breakdown(events: Any, phases: list[list[Any]]) -> dict[str, Counter[tuple[str, str]]]:
    """Per phase: µs of self CPU time per (bucket, op name)."""
    steps = sorted((e for e in events if e.name == STEP), key=lambda e: e.time_range.start)
    phase_of = {id(e): ph for e, (ph, *_) in zip(steps, phases)}
    out: dict[str, Counter[tuple[str, str]]] = {"prefill": Counter(), "decode": Counter()}
    for e in events:
        op_bucket = scope = None
        node = e
        while node is not None and node.name != STEP:  # up to the step, noting the nearest scope
            if node.name in LABELS:
                scope = scope or node.name
            elif scope is None and op_bucket is None:  # an op's children count as the op
                op_bucket = next((b for pat, b in OPS if pat.search(node.name)), None)
            node = node.cpu_parent
        if node is None or phase_of.get(id(node)) not in out:
            continue
        if e is node:
            bucket = "engine outside the model"
        elif e.name in LABELS:
            bucket = "Python in model code"
        else:
            bucket = SPLIT.get((scope, op_bucket)) or (scope != MODEL and scope) or op_bucket or "other aten ops"
        out[phase_of[id(node)]][bucket, e.name] += e.self_cpu_time_total
    return out


def machine(dtype: str) -> str:
    with open("/proc/cpuinfo") as f:
        info = f.read()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "unknown CPU")
    isa = sorted(set(info.split()) & {"avx512f", "avx512_bf16", "amx_bf16"})
    return (f"{cpu} ({', '.join(isa) or 'no AVX-512'}), {len(os.sched_getaffinity(0))} cores, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads), {dtype}")


def run_model(name: str, args: argparse.Namespace, root: str) -> tuple[float, dict[str, Any]]:
    from loom import LLM
    from loom.engine.arg_utils import EngineArgs
    from loom.transformers_utils.config import get_hf_config, resolve_model_path

    model = None if name == "default" else build_random_model(name, root)
    cfg = get_hf_config(*resolve_model_path(model))
    vocab = 49152 if model is None else VOCAB.get(name, 50272)
    prompts, *others = (workload(args.num_prompts, args.input_len, vocab, seed) for seed in range(3))
    elapsed, tokens = run_loom(model, prompts, args.output_len, args.dtype, args.kv_cache_dtype)
    loom_tps = tokens / elapsed
    engine = dict(dtype=args.dtype, max_model_len=max(args.input_len + args.output_len, 512),
                  kv_cache_dtype=args.kv_cache_dtype)  # as run_loom's
    r = roofline(cfg, getattr(torch, args.dtype), args, EngineArgs(model=model, **engine).create_engine_config())
    print(f"\n## {name} ({args.dtype})\n\n| linear (step) | m x k -> n | ms, the fastest | GFLOP/s F.linear | "
          "GFLOP/s oneDNN | GFLOP/s loom's panels |\n|---|---|---|---|---|---|")
    for lin, ph, m, k, n, times in r["timed"]:
        rate = [f"{2 * m * k * n / t / 1e9:,.0f}" if t < float("inf") else "-" for t in times.values()]
        print(f"| {lin} ({ph}) | {m} x {k} -> {n} | {min(times.values()) * 1e3:.3f} | {' | '.join(rate)} |")
    print(f"\n| figure | value |\n|---|---|\n| layer GEMMs per token | {si(r['per_token'], 'FLOP')} |\n"
          f"| LM head per sampled token | {si(r['lm_flops'], 'FLOP')} |\n| workload GEMMs | {si(r['flops'], 'FLOP')} |\n"
          f"| attention QK/PV, causal (not in the bound) | {si(r['attn_flops'], 'FLOP')} |\n"
          f"| GEMM-only bound | {r['seconds']:.3g} s = {r['tok_s']:,.0f} output tok/s |\n"
          f"| K/V the decode steps read ({args.kv_cache_dtype} cache) | {si(r['kv_bytes'], 'B')} |\n"
          f"| read bandwidth (1 GiB torch sum, best of 4) | {si(args.bandwidth, 'B/s')} |\n"
          f"| GEMMs + K/V at that bandwidth | {args.num_prompts * args.output_len / r['kv_tok_s']:.3g} s = {r['kv_tok_s']:,.0f} output tok/s |\n"
          f"| loom | {elapsed:.3g} s = {loom_tps:,.0f} output tok/s |\n| loom / bound | {loom_tps / r['tok_s']:.0%} |\n"
          f"| loom / (GEMMs + K/V) | {loom_tps / r['kv_tok_s']:.0%} |",
          flush=True)
    peer = run_peer(args.peer_python, model, prompts, args.output_len, args.dtype, root) if args.peer_python else None
    if peer is not None:
        print(f"| vLLM (same prompts, same weights) | {peer:,.0f} output tok/s = {peer / r['tok_s']:.0%} of the bound |\n"
              f"| loom / vLLM | {loom_tps / peer:.2f}x |", flush=True)
    if not args.no_profile:
        print_breakdown(LLM(model, **engine), others, args.output_len, r, args.bandwidth)
    return loom_tps, r, peer


def run_peer(python: str, model: str | None, prompts: list[list[int]], output_len: int, dtype: str,
             root: str) -> float | None:
    """vLLM's figure for the same workload (``peer_vllm.py`` under vLLM's own interpreter)."""
    if model is None:
        print("| vLLM | not run: the default model is a GGUF file; the peer runs the random-shape models |")
        return None
    path = os.path.join(root, "prompts.json")
    with open(path, "w") as f:
        json.dump(prompts, f)
    script = os.path.join(os.path.dirname(__file__), "peer_vllm.py")
    done = subprocess.run([python, script, model, path, str(output_len), dtype], capture_output=True, text=True)
    if done.returncode != 0:
        errors = [ln for ln in (done.stdout + done.stderr).splitlines() if "Error:" in ln] or ["(no error line)"]
        print(f"| vLLM | failed with {done.returncode}: {errors[-1].strip()[-160:]} |")
        return None
    result = [ln for ln in done.stdout.splitlines() if ln.startswith("peer-result ")]
    if not result:
        print(f"| vLLM | printed no result: {done.stdout.strip().splitlines()[-1:]} |")
        return None
    return float(json.loads(result[-1].split(" ", 1)[1])["tok_s"])


def print_breakdown(llm: Any, workloads: list[list[list[int]]], output_len: int, r: dict[str, Any],
                    bandwidth: float) -> None:
    """Run two workloads on ``llm``, timed per step then profiled, and print a table per phase."""
    from loom import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": workloads[0][0][:8]}], SamplingParams(max_tokens=2))  # warm-up
    runs: list[list[list[Any]]] = [[], []]  # timed, profiled
    try:
        for phases, prompts in zip(runs, workloads):
            undo = instrument(llm, phases, modules=phases is runs[1])
            try:  # the class-wide patches (kernels, tapes) must not outlive a failed run
                with profile(activities=[ProfilerActivity.CPU]) if phases is runs[1] else contextlib.nullcontext() as prof:
                    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            finally:
                undo()
    finally:
        llm.shutdown()
    print(f"\nBreakdown: the workload with new prompts on a fresh engine, timed per step "
          f"({sum(p[2] for p in runs[0]):.2f} s), then with other new prompts under torch.profiler ({sum(p[2] for p in runs[1]):.2f} s). Prefill steps schedule "
          "prompt tokens (decodes of earlier prompts ride along); decode steps one token per running request. "
          "Rows are of the profiled run, whose own overhead lands mostly in the Python rows.")
    for ph, us in breakdown(prof.events(), runs[1]).items():
        timed, steps = [p for p in runs[0] if p[0] == ph], [p for p in runs[1] if p[0] == ph]
        n, total = max(len(steps), 1), sum(us.values())
        gemm_s = sum(t for (b, _), t in us.items() if b == "GEMMs") / 1e6
        print(f"\n### {ph}: {len(steps)} steps, {sum(p[1] for p in steps):,} tokens; "
              f"{sum(p[2] for p in timed) * 1e3 / max(len(timed), 1):.1f} ms per step unprofiled, "
              f"{total / 1e3 / n:.1f} profiled; layer GEMMs at "
              f"{r['per_token'] * sum(p[1] for p in steps) / max(gemm_s, 1e-9) / 1e9:,.0f} GFLOP/s in loom, "
              f"{r['per_token'] * r['m'][ph] / r['t_layers'][ph] / 1e9:,.0f} alone ({r['m'][ph]} rows)"
              f"{memory_floor(r, bandwidth, sum(p[2] for p in timed) / max(len(timed), 1)) if ph == 'decode' else ''}"
              "\n\n| bucket | ms per step | % | largest ops (Python: scopes), ms per step |\n|---|---|---|---|")
        for row in ROWS:
            ops = sorted(((t, op) for (b, op), t in us.items() if b == row), reverse=True)
            top = ", ".join(f"{op} {t / 1e3 / n:.2f}" for t, op in ops[:3]) if row != ROWS[-1] else ""
            row_us = sum(t for t, _ in ops)
            print(f"| {row} | {row_us / 1e3 / n:.2f} | {row_us / max(total, 1):.1%} | {top} |")


def memory_floor(r: dict[str, Any], bandwidth: float, step_s: float) -> str:
    """What a decode step must read (every weight once, the K/V of its requests' contexts) and how
    long that takes at ``bandwidth``, against the step's unprofiled time."""
    total = r["weight_bytes"] + r["step_kv_bytes"]
    return (f"; it reads {si(total, 'B')} (weights {si(r['weight_bytes'], 'B')}, K/V {si(r['step_kv_bytes'], 'B')}), "
            f"{total / bandwidth * 1e3:.1f} ms at {si(bandwidth, 'B/s')}: the step at "
            f"{total / bandwidth / max(step_s, 1e-9):.0%} of the read bandwidth")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["default"], choices=["default", *SHAPES])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled run and its breakdown")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                        help="loom's KV cache (the peer keeps its default); the bound does not change")
    parser.add_argument("--peer-python", default=None,
                        help="vLLM's interpreter (../shared/TOOLCHAIN.md): also run the workload there, same run")
    args = parser.parse_args()
    print(f"# loom roofline, {datetime.datetime.now():%Y-%m-%d %H:%M}\n\n`python {shlex.join(sys.argv)}`\n\n"
          f"{machine(args.dtype)}; {args.num_prompts} prompts x ({args.input_len} in, {args.output_len} out), "
          "greedy, EOS ignored")
    args.bandwidth = read_bandwidth()
    results: dict[str, tuple[float, dict[str, Any], float | None]] = {}
    with tempfile.TemporaryDirectory() as root:
        for name in args.models:
            results[name] = run_model(name, args, root)
    print("\n| model | dtype | loom tok/s | GEMM-only bound tok/s | loom / bound | GEMMs + K/V bound tok/s | "
          "loom / it | vLLM tok/s | loom / vLLM |\n|---|---|---|---|---|---|---|---|---|")
    for name, (tps, r, peer) in results.items():
        vs = f"{peer:,.0f} | {tps / peer:.2f}x" if peer else "- | -"
        print(f"| {name} | {args.dtype} | {tps:,.0f} | {r['tok_s']:,.0f} | {tps / r['tok_s']:.0%} | "
              f"{r['kv_tok_s']:,.0f} | {tps / r['kv_tok_s']:.0%} | {vs} |")


if __name__ == "__main__":
    main()
