"""Load a ``loom serve`` with the official OpenAI client and print throughput and latency.

    python bench/serve_throughput.py --model default --num-prompts 64 --input-len 128 --output-len 64
    python bench/serve_throughput.py --url http://127.0.0.1:8000 --served-model-name M ...
    python bench/serve_throughput.py --model opt-2m --request-rate 20 --compare-offline

Prompts are random token ids (fixed seed), sent as token-id prompts so every request has
exactly ``--input-len`` prompt tokens; EOS is ignored so each makes ``--output-len``.
``--request-rate inf`` (default) sends everything at once; otherwise Poisson arrivals.
``--compare-offline`` also runs the same workload through ``loom.LLM`` in this process.
``--client-ceiling`` also runs it against ``_sse_replay.py``, a server that only writes
pre-serialized chunks: the streamed tokens a second the official client alone can take here,
the ceiling of any served figure this script measures on a machine it shares with the server.
``--curl`` also sends the same load through one ``curl`` process per request (all at once) to a
server launched afresh and warmed up the same way: a client whose per-chunk cost is C's, so the
figure shows what the server delivers when the client takes little of the machine's CPU.
On a server it launched, the script also prints the CPU seconds each process of the serve and
the client (this process) used during the load, beside the CPU time the machine had.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from _serve import free_port, pct, start, stop, tree_cpu_seconds, wait_healthy  # noqa: E402
from offline_throughput import SHAPES, VOCAB, build_random_model, run_loom, workload  # noqa: E402


async def run_load(url: str, model: str, prompts: list[list[int]], output_len: int, rate: float,
                   seed: int) -> dict[str, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    rng = random.Random(seed)
    ttft: list[float] = []
    tpot: list[float] = []
    e2e: list[float] = []
    tokens = 0

    async def one(prompt: list[int]) -> None:
        nonlocal tokens
        start = time.perf_counter()
        first = None
        n = 0  # this request's tokens (from its usage)
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=output_len, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter()
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
                tokens += n
        end = time.perf_counter()
        if first is not None:
            ttft.append(first - start)
            if n > 1:
                tpot.append((end - first) / (n - 1))
        e2e.append(end - start)

    begin = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(one(prompt)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - begin
    await client.close()  # on this loop: left to the garbage collector it closes after the loop is gone
    return {
        "elapsed": elapsed, "req_s": len(prompts) / elapsed, "tok_s": tokens / elapsed,
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
        "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99), "tokens": tokens,
    }


def curl_load(url: str, model: str, prompts: list[list[int]], output_len: int, root: str) -> dict[str, float]:
    """The load through one ``curl`` process per request, started together: wall time from the
    first start to the last exit, and the completion tokens the streams' usage chunks report."""
    bodies = []
    for i, prompt in enumerate(prompts):
        path = os.path.join(root, f"curl-{i}.json")
        with open(path, "w") as f:
            json.dump({"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}, f)
        bodies.append(path)
    command = ["curl", "-sSN", "--fail-with-body", "-H", "Content-Type: application/json", f"{url}/v1/completions",
               "--data-binary"]
    begin = time.perf_counter()
    procs = [subprocess.Popen([*command, f"@{body}", "-o", f"{body}.out"]) for body in bodies]
    codes = [proc.wait() for proc in procs]
    elapsed = time.perf_counter() - begin
    tokens = 0
    for body, code in zip(bodies, codes):
        with open(f"{body}.out") as f:
            out = f.read()
        if code:
            raise RuntimeError(f"curl exited {code}: {out[-500:]}")
        events = [json.loads(line[len("data: "):]) for line in out.splitlines() if line.startswith("data: {")]
        usage = [e["usage"] for e in events if e.get("usage")]
        if not usage:
            raise RuntimeError(f"a stream ended without a usage chunk: {out[-500:]}")
        tokens += usage[-1]["completion_tokens"]
    return {"elapsed": elapsed, "tok_s": tokens / elapsed, "tokens": tokens}


def client_ceiling(prompts: list[list[int]], output_len: int, seed: int) -> float:
    """Output tok/s of the same load against a server that only writes pre-serialized chunks."""
    port = free_port()
    server = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "_sse_replay.py"), str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        return asyncio.run(run_load(f"http://127.0.0.1:{port}", "replay", prompts, output_len, float("inf"),
                                    seed))["tok_s"]
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="an already running server; else one is launched")
    parser.add_argument("--model", default="default", help="default, opt-125m, opt-2m, or a model path")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compare-offline", action="store_true")
    parser.add_argument("--client-ceiling", action="store_true",
                        help="also load a do-nothing SSE server (_sse_replay.py) with the same client and workload")
    parser.add_argument("--curl", action="store_true",
                        help="also send the load through one curl process per request (needs curl on PATH)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="an extra flag for loom serve, e.g. --serve-arg=--stream-interval=8 (repeatable)")
    args = parser.parse_args()
    if args.curl and (args.url is not None or args.request_rate != float("inf")):
        parser.error("--curl starts its own server (a second load on one server hits the prefix cache) "
                     "and sends every request at once: drop --url and --request-rate")
    with tempfile.TemporaryDirectory() as root:
        if args.model in SHAPES:
            model_path: str | None = build_random_model(args.model, root)
        elif args.model == "default":
            model_path = None
        else:
            model_path = args.model
        vocab = 49152 if model_path is None else VOCAB.get(args.model, 50272)
        prompts = workload(args.num_prompts, args.input_len, vocab, args.seed)
        served = args.served_model_name or (model_path or "SmolLM2-135M-Instruct")
        serve_args = ([model_path] if model_path else []) + [
            "--dtype", args.dtype, "-tp", str(args.tp),
            "--max-model-len", str(max(512, args.input_len + args.output_len)), *args.serve_arg]

        def measure(load: str) -> dict[str, float]:
            """``load`` ("openai" or "curl") on the server at --url, else on a fresh one, warmed up."""
            proc, url = None, args.url
            if url is None:
                proc, url, _ = start(serve_args, os.path.join(root, f"serve-{load}.log"))
                wait_healthy(proc, url)
            try:
                asyncio.run(run_load(url, served, prompts[:2], 2, float("inf"), args.seed))  # warm-up
                if load == "curl":
                    return curl_load(url, served, prompts, args.output_len, root)
                before, client = tree_cpu_seconds(proc.pid) if proc else {}, time.process_time()
                r = asyncio.run(run_load(url, served, prompts, args.output_len, args.request_rate, args.seed))
                if proc is not None:
                    after = tree_cpu_seconds(proc.pid)
                    r["cpu"] = {"client": time.process_time() - client,
                                **{k: v - before.get(k, 0.0) for k, v in after.items()}}
                return r
            finally:
                if proc is not None:
                    stop(proc)

        r = measure("openai")
        curl = measure("curl") if args.curl else None
        print(f"workload: {args.num_prompts} prompts x ({args.input_len} in, {args.output_len} out), "
              f"rate {args.request_rate}, TP {args.tp}, {args.dtype} {' '.join(args.serve_arg)}")
        print(f"serve: {r['req_s']:.2f} req/s, {r['tok_s']:,.0f} output tok/s in {r['elapsed']:.1f} s")
        print(f"TTFT p50 {r['ttft_p50'] * 1e3:.0f} ms, p99 {r['ttft_p99'] * 1e3:.0f} ms; "
              f"TPOT p50 {r['tpot_p50'] * 1e3:.1f} ms, p99 {r['tpot_p99'] * 1e3:.1f} ms; "
              f"e2e p50 {r['e2e_p50']:.2f} s, p99 {r['e2e_p99']:.2f} s")
        if "cpu" in r:
            cores = len(os.sched_getaffinity(0))
            print(f"CPU seconds during the load ({cores} cores x {r['elapsed']:.1f} s = "
                  f"{cores * r['elapsed']:.1f} s): " + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu"].items()))
        if curl is not None:
            print(f"curl: {curl['tok_s']:,.0f} output tok/s in {curl['elapsed']:.1f} s ({curl['tokens']} tokens, "
                  f"one curl process per request)")
        if args.client_ceiling:
            c = client_ceiling(prompts, args.output_len, args.seed)
            print(f"client ceiling (the official client against _sse_replay.py): {c:,.0f} output tok/s; "
                  f"serve / ceiling = {r['tok_s'] / c:.2f}")
        if args.compare_offline:
            elapsed, tokens = run_loom(model_path, prompts, args.output_len, args.dtype)
            offline = tokens / elapsed
            print(f"offline loom.LLM: {offline:,.0f} output tok/s; serve / offline = {r['tok_s'] / offline:.2f}"
                  + (f", curl / offline = {curl['tok_s'] / offline:.2f}" if curl is not None else ""))


if __name__ == "__main__":
    main()
