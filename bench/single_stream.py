"""One chat stream, the way a person chatting sees it: tok/s, inter-token latency, TTFT, and
how close decoding comes to reading the weights once per token at this machine's bandwidth.

    python bench/single_stream.py                               # the default model, auto and none
    python bench/single_stream.py --quantization gguf none --serve
    python bench/single_stream.py --model path/to/model.gguf --prompt-len 1000
    python bench/single_stream.py --quantization gguf --serve --runs 5   # ratios' spread over 5 runs
    python bench/single_stream.py --quantization gguf --context 1500     # also decode after 1,500 tokens

For each ``--quantization``: ``loom.LLM`` on the chat question (the model's chat template),
``--output-len`` tokens, greedy, EOS suppressed; every engine step is timed, so the decode
steps are the inter-token latencies. Time to first token is measured on a fresh prompt of
``--prompt-len`` token ids (no prefix-cache hit). ``--context N`` adds a row per engine: decode
speed (steps after the first) on a fresh prompt of N token ids, where attention reads as much
as a large part of the weights (a long chat). The bound: the bytes of the weights one
decode step reads (every linear layer as loom holds it, the LM head, one embedding row),
over the read bandwidth of a 1 GiB ``torch`` sum measured in the same run.

``--serve`` also starts ``loom serve`` per setting and streams the same request with the
official OpenAI client: inter-token latency as the client sees it. When ``llama_cpp``
imports (``CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python``, about 5 minutes),
llama.cpp runs the same GGUF file with as many threads, in the same run. On a CPU with AMX
that native build enables ggml's AMX matmul, which crashed (SIGSEGV in
``ggml_backend_amx_mul_mat``) on the machine of 2026-12-02; build it there with
``-DGGML_NATIVE=OFF`` and the AVX-512 flags instead (docs/performance.md's "On an Intel Xeon with AMX"
paragraph lists them).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _serve import pct, start, stop, wait_healthy  # noqa: E402

QUESTION = "Write a short story about a robot who learns to paint."


def read_bandwidth() -> float:
    """Bytes/s of a 1 GiB fp32 ``torch`` sum, best of four."""
    x = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(4):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return (1 << 30) / best


def weight_bytes_per_token(model: Any) -> int:
    """What one decode step reads: each linear layer's weight as held (quantized codes + scales,
    or dense/prepacked), the LM head (its packed copy if there is one) and one embedding row."""
    from loom.layers.linear import LinearBase
    from loom.layers.logits_processor import LogitsProcessor
    from loom_plugin_api.ops import QuantizedLinear

    total = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            w = module.weight
            total += w.kernel_weight().nbytes if isinstance(w, QuantizedLinear) else w.numel() * w.element_size()
        elif isinstance(module, LogitsProcessor) and module.quantized_head is not None:
            total += module.quantized_head.kernel_weight().nbytes  # a decode step's few rows read the codes
        elif isinstance(module, LogitsProcessor):
            head = model.lm_head.weight
            total += head.numel() * head.element_size()
    embed = model.model.embed_tokens.weight
    return total + embed.shape[1] * embed.element_size()


def chat_prompt(llm: Any) -> list[int]:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True)
    return list(tok(text)["input_ids"])


def random_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n token ids drawn the same way for every engine (a fresh prompt: no prefix-cache hit; the
    long-context prompt takes another seed than the TTFT one, so equal lengths do not share one)."""
    g = torch.Generator().manual_seed(n + (seed << 32))
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def run_loom(model: str | None, quantization: str, dtype: str, output_len: int, prompt_len: int,
             context: int = 0) -> dict[str, Any]:
    from loom import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, quantization=quantization,
              max_model_len=max(2048, prompt_len + 64, context + output_len + 16))
    runner = llm.llm_engine.executor.worker.model_runner
    prompt = chat_prompt(llm)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    core = llm.engine_core
    step, times = core.step, []

    def timed_step(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        out = step(*a, **kw)
        times.append(time.perf_counter() - t)
        return out

    core.step = timed_step  # type: ignore[method-assign]
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params)
    elapsed = time.perf_counter() - start
    n = len(out[0].outputs[0].token_ids)
    itl = times[1:n]  # the first step prefills (a prefix-cache hit here: the warm-up asked the same)
    vocab = runner.model.config.vocab_size
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": random_prompt(prompt_len, vocab)}], SamplingParams(temperature=0, max_tokens=1))
    ttft = time.perf_counter() - t
    result = dict(tok_s=n / elapsed, itl_p50=pct(itl, 50), itl_p99=pct(itl, 99), ttft=ttft,
                  weight_bytes=weight_bytes_per_token(runner.model), text=out[0].outputs[0].text)
    if context:
        times.clear()
        out = llm.generate([{"prompt_token_ids": random_prompt(context, vocab, seed=1)}], params)
        steps = times[-(len(out[0].outputs[0].token_ids) - 1):]  # the decode steps, after the prefill's chunks
        result.update(ctx_tok_s=len(steps) / sum(steps), ctx_itl_p50=pct(steps, 50), ctx_itl_p99=pct(steps, 99))
    core.step = step  # type: ignore[method-assign]
    llm.shutdown()
    return result


async def stream_once(url: str, model: str, output_len: int) -> dict[str, float]:
    import openai

    stamps: list[float] = []
    # closed here, on its loop: left to the garbage collector it closes after asyncio.run's loop is gone
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as client:
        start = time.perf_counter()
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=output_len, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return dict(ttft=stamps[0] - start, itl_p50=pct(gaps, 50), itl_p99=pct(gaps, 99),
                tok_s=len(stamps) / (stamps[-1] - start))


def run_served(model: str | None, quantization: str, dtype: str, output_len: int, root: str,
               serve_args: list[str] = ()) -> dict[str, float]:
    args = ([model] if model else []) + ["--dtype", dtype, "--quantization", quantization, *serve_args]
    proc, url, _ = start(args, os.path.join(root, f"serve-{quantization}.log"))
    try:
        wait_healthy(proc, url)
        served = model or "SmolLM2-135M-Instruct"
        asyncio.run(stream_once(url, served, 8))  # warm-up
        return asyncio.run(stream_once(url, served, output_len))
    finally:
        stop(proc)


def run_llama_cpp(path: str, output_len: int, prompt_len: int, context: int = 0) -> dict[str, float] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    threads = len(os.sched_getaffinity(0))
    llm = Llama(model_path=path, n_ctx=max(2048, prompt_len + 64, context + output_len + 16), n_threads=threads,
                n_threads_batch=threads,
                n_batch=512, verbose=False)
    eos = llm.token_eos()
    messages = [{"role": "user", "content": QUESTION}]
    llm.create_chat_completion(messages, max_tokens=4, temperature=0)  # warm-up
    stamps: list[float] = []
    start = time.perf_counter()
    for chunk in llm.create_chat_completion(messages, max_tokens=output_len, temperature=0, stream=True,
                                            logit_bias={eos: -1e9}):
        if chunk["choices"][0]["delta"].get("content"):
            stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    llm.reset()
    t = time.perf_counter()
    llm.create_completion(random_prompt(prompt_len, llm.n_vocab()), max_tokens=1, temperature=0)
    ttft = time.perf_counter() - t
    result = dict(tok_s=len(stamps) / (stamps[-1] - start), itl_p50=pct(gaps, 50), itl_p99=pct(gaps, 99),
                  ttft=ttft, tokens=len(stamps))
    if context:
        llm.reset()
        stamps.clear()
        for chunk in llm.create_completion(random_prompt(context, llm.n_vocab(), seed=1), max_tokens=output_len,
                                           temperature=0, stream=True, logit_bias={eos: -1e9}):
            if chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]  # after the first token (the prefill)
        result.update(ctx_tok_s=len(gaps) / sum(gaps), ctx_itl_p50=pct(gaps, 50), ctx_itl_p99=pct(gaps, 99))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or model directory (default: the embedded model)")
    parser.add_argument("--quantization", nargs="+", default=["auto", "none"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=1000, help="prompt tokens for the TTFT figure")
    parser.add_argument("--context", type=int, default=0,
                        help="also decode --output-len tokens after a prompt of this many tokens (a long chat)")
    parser.add_argument("--serve", action="store_true", help="also stream through loom serve (OpenAI client)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="an extra flag for loom serve, e.g. --serve-arg=--no-async-scheduling (repeatable)")
    parser.add_argument("--runs", type=int, default=1,
                        help="repeat the whole table this many times (the machine's speed drifts: each run's "
                             "ratio to llama.cpp compares figures measured minutes apart) and summarize the ratios")
    args = parser.parse_args()
    if args.context and args.output_len < 2:
        parser.error("--context measures the decode steps after the first token: --output-len must be 2 or more")
    from loom.transformers_utils.config import resolve_model_path

    path, fmt = resolve_model_path(args.model)
    print(f"# single stream, {time.strftime('%Y-%m-%d %H:%M')}: {path}\n\n{len(os.sched_getaffinity(0))} cores; "
          f"{args.output_len} tokens, greedy, EOS suppressed; TTFT on a {args.prompt_len}-token prompt; the bound: "
          "the bytes a decode step reads over the read bandwidth of a 1 GiB torch sum measured at the start of "
          "each run\n")
    print("| run | engine | weights | tok/s | ITL p50 / p99 (ms) | TTFT (s) | bytes read per token | bound tok/s | "
          "of bound |\n|---|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {}
    gap_ratios: dict[str, list[float]] = {}  # llama.cpp's ITL p50 over loom's: the goal's measure
    with tempfile.TemporaryDirectory() as root:
        for run in range(1, args.runs + 1):
            bandwidth = read_bandwidth()
            tok_s: dict[str, float] = {}
            itl: dict[str, float] = {}
            for q in args.quantization:
                r = run_loom(args.model, q, args.dtype, args.output_len, args.prompt_len, args.context)
                bound = bandwidth / r["weight_bytes"]
                tok_s[f"loom offline, {q}"] = r["tok_s"]
                itl[f"loom offline, {q}"] = r["itl_p50"]
                print(f"| {run} | loom offline | {q} | {r['tok_s']:.1f} | {r['itl_p50'] * 1e3:.1f} / "
                      f"{r['itl_p99'] * 1e3:.1f} | {r['ttft']:.2f} | {r['weight_bytes'] / 1e6:.0f} MB | "
                      f"{bound:.0f} ({bandwidth / 1e9:.0f} GB/s) | {r['tok_s'] / bound:.0%} |", flush=True)
                if args.context:
                    tok_s[f"loom offline, {q}, {args.context} tokens of context"] = r["ctx_tok_s"]
                    print(f"| {run} | loom offline, {args.context} context | {q} | {r['ctx_tok_s']:.1f} | "
                          f"{r['ctx_itl_p50'] * 1e3:.1f} / {r['ctx_itl_p99'] * 1e3:.1f} | | | | |", flush=True)
                if args.serve:
                    s = run_served(args.model, q, args.dtype, args.output_len, root, args.serve_arg)
                    tok_s[f"loom serve, {q}"] = s["tok_s"]
                    itl[f"loom serve, {q}"] = s["itl_p50"]
                    print(f"| {run} | loom serve (client) | {q} | {s['tok_s']:.1f} | {s['itl_p50'] * 1e3:.1f} / "
                          f"{s['itl_p99'] * 1e3:.1f} | {s['ttft']:.2f} (chat prompt) | | | "
                          f"{1 / s['itl_p50'] / bound:.0%} (p50) |", flush=True)
            peer = run_llama_cpp(path, args.output_len, args.prompt_len, args.context) if fmt == "gguf" else None
            if peer is None:
                print(f"| {run} | llama.cpp | not run: llama_cpp does not import (or the model is not GGUF) "
                      "| | | | | | |")
                continue
            print(f"| {run} | llama.cpp | as stored | {peer['tok_s']:.1f} | {peer['itl_p50'] * 1e3:.1f} / "
                  f"{peer['itl_p99'] * 1e3:.1f} | {peer['ttft']:.2f} | | | |", flush=True)
            if args.context:
                print(f"| {run} | llama.cpp, {args.context} context | as stored | {peer['ctx_tok_s']:.1f} | "
                      f"{peer['ctx_itl_p50'] * 1e3:.1f} / {peer['ctx_itl_p99'] * 1e3:.1f} | | | | |", flush=True)
            for name, value in tok_s.items():
                ratios.setdefault(name, []).append(value / peer["ctx_tok_s" if "context" in name else "tok_s"])
            for name, value in itl.items():
                gap_ratios.setdefault(name, []).append(peer["itl_p50"] / value)
    for title, table in (("loom / llama.cpp, tok/s in the same run", ratios),
                         ("llama.cpp / loom, ITL p50 in the same run (a token's median gap)", gap_ratios)):
        if not table:
            continue
        print(f"\n| {title} | each run | min | median | max |\n|---|---|---|---|---|")
        for name, values in table.items():
            print(f"| {name} | {' '.join(f'{v:.2f}x' for v in values)} | {min(values):.2f}x | "
                  f"{statistics.median(values):.2f}x | {max(values):.2f}x |")


if __name__ == "__main__":
    main()
