"""``loom bench offline``: the workload through ``loom.LLM`` in this process, every prompt at once.

Measures output and total (prompt + output) tokens a second over ``runs`` timed calls of
``LLM.generate`` (each on its own prompts: no prefix-cache hits between runs), after one short
warm-up call. TTFT and TPOT are not measured: every prompt is
submitted at once, so a request's first token waits for the whole batch's prefill
(``loom bench serve`` measures them per request).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from loom_plugin_api import SamplingParams

from .report import format_table
from .workloads import WARMUP_ROUND, Workload

NOT_MEASURED = ("TTFT and TPOT are not measured offline (every prompt is submitted at once); "
                "`loom bench serve` measures them per request.")


def run(model: str | None, workload: Workload, engine_kwargs: dict[str, Any], runs: int = 1) -> dict[str, Any]:
    """Load the model, warm up, then time ``runs`` calls of ``generate`` on the workload."""
    from ..entrypoints.llm import LLM  # lazy: it loads torch, which `loom bench --help` does not need

    begin = time.perf_counter()
    llm = LLM(model, **engine_kwargs)
    load_s = time.perf_counter() - begin
    try:
        model_config = llm.config.model_config
        if workload.input_len + workload.output_len > model_config.max_model_len:  # else outputs come out short
            raise ValueError(f"--input-len {workload.input_len} + --output-len {workload.output_len} is over the "
                             f"model's max_model_len {model_config.max_model_len}; shorten them or raise "
                             "--max-model-len")
        vocab = model_config.get_vocab_size()
        params = SamplingParams(temperature=0, max_tokens=workload.output_len, ignore_eos=True)
        warmup = workload.prompts(WARMUP_ROUND, vocab)[0]
        llm.generate({"prompt_token_ids": warmup}, SamplingParams(temperature=0, max_tokens=2))  # first-call costs
        records = [_timed(llm, [{"prompt_token_ids": p} for p in workload.prompts(i, vocab)], params, workload)
                   for i in range(runs)]
    finally:
        llm.shutdown()
    return {
        "model": model_config.model,
        "served_model_name": model_config.served_model_name,
        "dtype": str(model_config.dtype),
        "quantization": model_config.quantization,
        "load_s": load_s,
        "runs": records,
        "median": {key: statistics.median(r[key] for r in records)
                   for key in ("elapsed_s", "output_tok_s", "total_tok_s", "requests_s")},
    }


def _timed(llm: Any, prompts: list[dict[str, Any]], params: SamplingParams, workload: Workload) -> dict[str, Any]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    per_request = [len(o.outputs[0].token_ids) for o in outs]
    output_tokens = sum(per_request)
    prompt_tokens = len(prompts) * workload.input_len
    return {
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (output_tokens + prompt_tokens) / elapsed,
        "requests_s": len(prompts) / elapsed,
        "output_tokens_per_request": per_request,
    }


def table(results: dict[str, Any]) -> str:
    rows: list[list[Any]] = [[str(i + 1), r["elapsed_s"], r["output_tok_s"], r["total_tok_s"], r["requests_s"]]
                             for i, r in enumerate(results["runs"])]
    if len(rows) > 1:
        m = results["median"]
        rows.append(["median", m["elapsed_s"], m["output_tok_s"], m["total_tok_s"], m["requests_s"]])
    return "\n".join([format_table(["run", "time s", "output tok/s", "total tok/s", "req/s"], rows), NOT_MEASURED])
