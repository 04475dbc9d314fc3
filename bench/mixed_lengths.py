"""Offline throughput on requests of mixed lengths, loom and (optionally) vLLM in the same run.

The fixed workload of ``roofline.py`` (64 x (128 -> 64)) gives every step the same shapes: one
prefill length, one decode batch size, every context alike. Traffic is not like that. Here
each request draws its prompt length and its output length (uniform, fixed seed; EOS ignored so
each makes exactly its own), so the prefill chunks mix prompts of many lengths, decode batches
shrink as requests finish, and contexts differ within a batch. Two such workloads (different
prompts, so the prefix cache does not help the second) run in turn on one engine after a
warm-up request; both engines get the same requests.

    python bench/mixed_lengths.py --model smollm2-shape --dtype bfloat16
    python bench/mixed_lengths.py --model smollm2-shape --dtype bfloat16 --peer-python /tmp/vllm/bin/python

Prints each workload's seconds, output tok/s and total (prompt + output) tok/s, and loom / vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from offline_throughput import SHAPES, VOCAB, build_random_model  # noqa: E402

Request = tuple[list[int], int]  # prompt token ids, output tokens


def workload(n: int, seed: int, vocab: int, input_range: tuple[int, int], output_range: tuple[int, int]) -> list[Request]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab - 100) for _ in range(rng.randint(*input_range))], rng.randint(*output_range))
            for _ in range(n)]


def run_loom(model: str | None, workloads: list[list[Request]], dtype: str) -> list[tuple[float, int]]:
    from loom import LLM, SamplingParams

    longest = max(len(p) + n for w in workloads for p, n in w)
    llm = LLM(model, dtype=dtype, max_model_len=max(longest, 512))
    llm.generate([{"prompt_token_ids": workloads[0][0][0][:8]}], SamplingParams(max_tokens=2))  # warm-up
    results = []
    for requests in workloads:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params)
        results.append((time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)))
    llm.shutdown()
    return results


def run_peer(python: str, model: str, workloads: list[list[Request]], dtype: str, root: str,
             timeout: float) -> list[tuple[float, int]] | str:
    """vLLM's (seconds, output tokens) per workload, or why there are none."""
    path = os.path.join(root, "workloads.json")
    with open(path, "w") as f:
        json.dump({"workloads": workloads}, f)
    script = os.path.join(os.path.dirname(__file__), "peer_vllm.py")
    try:
        done = subprocess.run([python, script, model, path, "0", dtype], capture_output=True, text=True,
                              timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"not run to the end: {e}"
    lines = [json.loads(ln.split(" ", 1)[1]) for ln in done.stdout.splitlines() if ln.startswith("peer-result ")]
    if done.returncode != 0 or len(lines) != len(workloads):
        errors = [ln for ln in (done.stdout + done.stderr).splitlines() if "Error" in ln] or ["(no error line)"]
        return f"failed with {done.returncode}: {errors[-1].strip()[-200:]}"
    return [(r["elapsed"], r["tokens"]) for r in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-shape", choices=["default", *SHAPES])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, nargs=2, default=[16, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--peer-python", default=None, help="vLLM's interpreter (../shared/TOOLCHAIN.md)")
    parser.add_argument("--peer-timeout", type=float, default=1800, help="seconds vLLM's whole run may take")
    args = parser.parse_args()
    if args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")
    for flag, (low, high) in (("--input-len", args.input_len), ("--output-len", args.output_len)):
        if not 1 <= low <= high:
            parser.error(f"{flag} MIN MAX: need 1 <= MIN <= MAX, not {low} {high}")
    if args.peer_python and args.model == "default":
        parser.error("the peer runs the random-shape models (the default model is a GGUF file): --model smollm2-shape")
    with tempfile.TemporaryDirectory() as root:
        model = None if args.model == "default" else build_random_model(args.model, root)
        vocab = 49152 if model is None else VOCAB.get(args.model, 50272)
        workloads = [workload(args.num_prompts, args.seed + i, vocab, tuple(args.input_len), tuple(args.output_len))
                     for i in (1, 2)]
        engines = {"loom": run_loom(model, workloads, args.dtype)}
        peer = run_peer(args.peer_python, model, workloads, args.dtype, root, args.peer_timeout) if args.peer_python else None
    if isinstance(peer, list):
        engines["vLLM"] = peer
    prompt_tokens = [sum(len(p) for p, _ in w) for w in workloads]
    print(f"\n{args.model} ({args.dtype}), {args.num_prompts} requests a workload: prompts of "
          f"{args.input_len[0]}-{args.input_len[1]} tokens, outputs of {args.output_len[0]}-{args.output_len[1]}; "
          f"prompt tokens {prompt_tokens}\n\n| engine | workload | s | output tok/s | total tok/s |\n|---|---|---|---|---|")
    for name, results in engines.items():
        for i, (elapsed, tokens) in enumerate(results):
            print(f"| {name} | {i + 1} | {elapsed:.2f} | {tokens / elapsed:,.0f} | {(tokens + prompt_tokens[i]) / elapsed:,.0f} |")
    if "vLLM" in engines:
        ratios = [p[0] / lo[0] for lo, p in zip(engines["loom"], engines["vLLM"])]
        print(f"\nloom's speed over vLLM's (vLLM's seconds / loom's, per workload): {', '.join(f'{r:.2f}x' for r in ratios)}")
    elif isinstance(peer, str):
        print(f"\nvLLM: {peer}")


if __name__ == "__main__":
    main()
