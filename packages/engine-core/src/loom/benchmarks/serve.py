"""``loom bench serve``: stream the workload from ``/v1/completions`` at each concurrency level.

A real ``loom serve`` is launched on a free port (or ``url`` names one already running). After
one short warm-up request, each level sends every prompt of the workload (each level its own
prompts: no prefix-cache hits between levels) with at most
``concurrency`` requests in flight and records, per request:

* TTFT: from sending the request to the first event that carries text;
* TPOT: the rest of the request's time over its remaining tokens, ``(e2e - TTFT) / (n - 1)``
  with ``n`` from the stream's usage (an event may carry several tokens when the reader lags);
* ITL: the gaps between successive text events;
* e2e: the whole request.

A level's output tok/s is every output token over the level's wall time; the process tree's RSS
is read at ready and after each level (launched servers only). The client is httpx in this
process: it shares the machine with the server, as any client on the same host does.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from . import server
from .report import format_table, summarize
from .workloads import WARMUP_ROUND, Workload

MIB = 2**20


@dataclass(slots=True)
class RequestRecord:
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    output_tokens: int
    itl_s: list[float] = field(default_factory=list)


def run(workload: Workload, concurrency: list[int], *, serve_args: list[str] | None = None, url: str | None = None,
        api_key: str | None = None, log_dir: str) -> dict[str, Any]:
    """Launch ``loom serve SERVE_ARGS`` (unless ``url`` is given), measure every level, stop it."""
    proc = None
    results: dict[str, Any] = {"launched": url is None, "serve_args": serve_args, "time_to_ready_s": None,
                               "tree_rss_bytes_ready": None}
    if url is None:
        log_path = os.path.join(log_dir, "serve.log")
        proc, url, launched = server.start(serve_args or [], log_path)
    try:
        if proc is not None:
            results["time_to_ready_s"] = server.wait_healthy(proc, url, log_path=log_path) - launched
            results["tree_rss_bytes_ready"] = server.tree_rss_bytes(proc.pid)
        elif server.health(url) != 200:
            raise RuntimeError(f"no loom server answers 200 at {url}/health; start one or leave out --url")
        results["url"] = url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        results["levels"] = asyncio.run(_levels(url, headers, workload, concurrency, proc))
    finally:
        if proc is not None:
            server.stop(proc)
    return results


async def _levels(url: str, headers: dict[str, str], workload: Workload, concurrency: list[int],
                  proc: subprocess.Popen | None) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(None), trust_env=False,
                                 limits=httpx.Limits(max_connections=max(concurrency))) as client:
        await _request(client, workload.prompts(WARMUP_ROUND)[0], 2)  # warm-up, not counted
        levels = []
        for i, c in enumerate(concurrency):
            level = await _level(client, workload.prompts(i), workload.output_len, c)
            level["tree_rss_bytes"] = server.tree_rss_bytes(proc.pid) if proc is not None else None
            levels.append(level)
    return levels


async def _level(client: httpx.AsyncClient, prompts: list[list[int]], output_len: int,
                 concurrency: int) -> dict[str, Any]:
    slots = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(prompts), desc=f"concurrency {concurrency}", unit="req", dynamic_ncols=True)

    async def bounded(prompt: list[int]) -> RequestRecord:
        async with slots:
            record = await _request(client, prompt, output_len)
        bar.update(1)
        return record

    begin = time.perf_counter()
    tasks = [asyncio.ensure_future(bounded(p)) for p in prompts]
    try:
        records = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # one request failed: end the others before the error goes up
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        bar.close()
    elapsed = time.perf_counter() - begin
    output_tokens = sum(r.output_tokens for r in records)
    # One entry per request, in prompt order (None: a request that streamed no text); ITL: every gap.
    series = {
        "ttft_s": [r.ttft_s for r in records],
        "tpot_s": [r.tpot_s for r in records],
        "e2e_s": [r.e2e_s for r in records],
        "itl_s": [gap for r in records for gap in r.itl_s],
    }
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / elapsed,
        "requests_s": len(records) / elapsed,
        "output_tokens_per_request": [r.output_tokens for r in records],
        **series,
        "summary": {name.removesuffix("_s"): summarize([v for v in values if v is not None])
                    for name, values in series.items()},
    }


async def _request(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> RequestRecord:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"/v1/completions answered {response.status_code}: "
                                   f"{_message((await response.aread()).decode(errors='replace'))}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise RuntimeError(f"/v1/completions sent an error event: {_message(line[6:])}")
                now = time.perf_counter()
                if any(choice.get("text") for choice in event.get("choices") or []):
                    if last is not None:
                        gaps.append(now - last)
                    first = now if first is None else first
                    last = now
                if event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
    except httpx.HTTPError as e:
        raise RuntimeError(f"request to {client.base_url}/v1/completions failed: {e!r}") from None
    end = time.perf_counter()
    ttft = first - start if first is not None else None
    tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return RequestRecord(ttft_s=ttft, tpot_s=tpot, e2e_s=end - start, output_tokens=tokens, itl_s=gaps)


def _message(body: str) -> str:
    """The message of an OpenAI-shaped error body, else the body itself (shortened)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.strip()[:300]


def table(results: dict[str, Any]) -> str:
    rows = []
    for level in results["levels"]:
        ttft, tpot = level["summary"]["ttft"], level["summary"]["tpot"]
        rss = level["tree_rss_bytes"]
        rows.append([level["concurrency"], level["requests"], level["output_tok_s"], level["requests_s"],
                     *(ttft[p] * 1e3 for p in ("p50", "p90", "p99")), *(tpot[p] * 1e3 for p in ("p50", "p90", "p99")),
                     rss / MIB if rss is not None else None])
    headers = ["concurrency", "requests", "output tok/s", "req/s", "TTFT p50 ms", "p90", "p99", "TPOT p50 ms", "p90",
               "p99", "tree RSS MiB"]
    if results["launched"]:
        server_line = (f"server: ready in {results['time_to_ready_s']:.2f} s, process tree "
                       f"{results['tree_rss_bytes_ready'] / MIB:,.0f} MiB at ready")
    else:
        server_line = f"server: {results['url']} (not launched by loom bench: its memory is not measured)"
    return "\n".join([format_table(headers, rows), server_line])
