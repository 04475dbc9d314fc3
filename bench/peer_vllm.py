"""The same offline workload through vLLM's CPU build, run by vLLM's own interpreter.

    /tmp/vllm/bin/python bench/peer_vllm.py MODEL_DIR PROMPTS.json OUTPUT_LEN DTYPE

``bench/roofline.py --peer-python /tmp/vllm/bin/python`` writes the prompts (token ids) and
calls this for each random-shape model, so both engines decode the same tokens from the same
weights in the same run (``../shared/TOOLCHAIN.md`` has the venv recipe; never install vLLM
into loom's environment). Greedy, EOS ignored, one warm-up request first, as ``run_loom``.
Prints ``peer-result {"tok_s": ..., "elapsed": ..., "tokens": ...}`` (vLLM logs to stdout too).
``PROMPTS.json`` may instead hold ``{"workloads": [[[prompt token ids, max_tokens], ...], ...]}``
(``mixed_lengths.py``): each workload runs in turn on the one engine, each request with its own
output length (OUTPUT_LEN is then unused), and each prints a ``peer-result`` line. Unless the caller
set them, vLLM gets both cores (``VLLM_CPU_OMP_THREADS_BIND=0-<n-1>``; its default keeps one
core off the model) and a 1 GiB KV cache.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    model, prompts_path, output_len, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{len(os.sched_getaffinity(0)) - 1}")
    from vllm import LLM, SamplingParams  # vLLM's interpreter only: loom's never imports it
    from vllm.inputs import TokensPrompt

    with open(prompts_path) as f:
        loaded = json.load(f)
    if isinstance(loaded, dict):  # several workloads of (prompt, max_tokens) requests
        workloads = loaded["workloads"]
    else:
        workloads = [[(p, output_len) for p in loaded]]
    longest = max(len(p) + n for w in workloads for p, n in w)
    llm = LLM(model=model, dtype=dtype, max_model_len=max(longest, 512), seed=0)
    llm.generate([TokensPrompt(prompt_token_ids=workloads[0][0][0][:8])], SamplingParams(max_tokens=2),
                 use_tqdm=False)
    for requests in workloads:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in requests], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print("peer-result " + json.dumps({"tok_s": tokens / elapsed, "elapsed": elapsed, "tokens": tokens}),
              flush=True)


if __name__ == "__main__":
    main()
