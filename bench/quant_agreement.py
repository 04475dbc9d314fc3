"""How often the default model's greedy answers through its GGUF codes (``--quantization gguf``)
equal those of the same file dequantized (``none``), over a fixed set of chat prompts.

    python bench/quant_agreement.py                       # bfloat16 (auto on AVX512-BF16 CPUs)
    python bench/quant_agreement.py --dtype float32 --tokens 64
    LOOM_CPU_INT8_ACTIVATIONS=0 python bench/quant_agreement.py   # x kept exact in the decode matmuls
    python bench/quant_agreement.py --kv-cache-dtype int8           # the 8-bit KV cache against the dense one

Both run the same weights; they differ in how a step multiplies: decode steps of a few rows go
through the C kernels on the codes (on AVX512-VNNI CPUs with x rounded to 8 bits per group of
32), prefill through the dense copy, and the dense model through oneDNN in ``--dtype``. Greedy
decoding amplifies any difference at a near tie, so the figure printed is how many prompts agree
token for token over ``--tokens``, and where the others first part. With ``--kv-cache-dtype int8``
the two runs are instead the default quantization with the 8-bit KV cache and with the dense one.
"""

from __future__ import annotations

import argparse

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colors.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning to program.",
    "What does a CPU do?",
    "Name a planet in our solar system and one fact about it.",
    "Why is the sky blue?",
    "Suggest a name for a pet turtle.",
]


def answers(quantization: str, dtype: str, tokens: int, kv_cache_dtype: str = "auto") -> list[list[int]]:
    from loom import LLM, SamplingParams

    llm = LLM(dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": list(tok(tok.apply_chat_template(
        [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True))["input_ids"])} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    # one prompt at a time: the decode steps are single rows, the path a chat stream takes
    out = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm.shutdown()
    return [list(o) for o in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--kv-cache-dtype", default=None, choices=["int8"],
                        help="compare this KV cache with the dense one instead of gguf with none")
    args = parser.parse_args()
    if args.kv_cache_dtype:
        label = f"--kv-cache-dtype {args.kv_cache_dtype} vs auto (quantization auto)"
        codes = answers("auto", args.dtype, args.tokens, args.kv_cache_dtype)
        dense = answers("auto", args.dtype, args.tokens)
    else:
        label = "gguf vs none"
        codes, dense = answers("gguf", args.dtype, args.tokens), answers("none", args.dtype, args.tokens)
    parts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(codes, dense)]
    same = sum(p is None for p in parts)
    print(f"# {label}, {args.dtype}, {args.tokens} greedy tokens, {len(PROMPTS)} chat prompts, one at a time")
    print(f"identical: {same} of {len(PROMPTS)}")
    for prompt, p in zip(PROMPTS, parts):
        if p is not None:
            print(f"  parts at token {p}: {prompt!r}")


if __name__ == "__main__":
    main()
