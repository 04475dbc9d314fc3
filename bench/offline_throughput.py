"""Offline throughput: loom.LLM vs HF transformers `generate`, measured in the same run.

Fixed workload (defaults: 64 prompts, 128 input and 64 output tokens, greedy, fixed seed,
EOS ignored so every request makes exactly the output length). Models:

* ``default``   the embedded SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to fp32)
* ``opt-125m``  a random-weight model of OPT-125m's shape
* ``opt-2m``    a 2M-parameter random OPT (the shape of the vLLM CPU reference figure)
* ``smollm2-shape`` a random-weight Llama of SmolLM2-135M's shape (30 layers, 9/3 heads),
  for machines the 98 MB GGUF cannot reach (bench/gpu_check.sh)

    python bench/offline_throughput.py --models default opt-125m
    python bench/offline_throughput.py --models opt-2m --num-prompts 200 --skip-hf

Prints output tokens/s for each engine and the ratio loom / HF.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

SHAPES = {
    "opt-125m": dict(hidden_size=768, ffn_dim=3072, num_hidden_layers=12, num_attention_heads=12),
    "opt-2m": dict(hidden_size=32, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4),
    "smollm2-shape": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, tie_word_embeddings=True, rms_norm_eps=1e-5,
                          max_position_embeddings=8192),
}
VOCAB = {"smollm2-shape": 49152}  # its vocabulary; the GPT-2 tokenizer covers ids below 50257


def build_random_model(name: str, root: str) -> str:
    """A random-weight model of one of ``SHAPES`` with GPT-2's tokenizer, saved under ``root``."""
    from tiny_models import gpt2_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    path = os.path.join(root, name)
    torch.manual_seed(0)
    shape = SHAPES[name]
    if name.startswith("opt"):
        config = OPTConfig(vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=shape["hidden_size"],
                           **shape)
        OPTForCausalLM(config).save_pretrained(path)
    else:
        LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB[name], **shape)).save_pretrained(path)
    gpt2_tokenizer().save_pretrained(path)
    return path


def workload(num_prompts: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (num_prompts, input_len), generator=g).tolist()


def run_loom(model: str | None, prompts: list[list[int]], output_len: int, dtype: str,
             kv_cache_dtype: str = "auto") -> tuple[float, int]:
    from loom import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_model_len=max(len(prompts[0]) + output_len, 512), kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def load_hf(model: str | None, loom_model_path: str | None, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if model is not None:
        return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
    # The default model: the same weights loom converted from the GGUF file (its cache).
    assert loom_model_path is not None
    return AutoModelForCausalLM.from_pretrained(loom_model_path, dtype=dtype).eval()


def run_hf(hf_model, prompts: list[list[int]], output_len: int, batch_size: int) -> tuple[float, int]:
    tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i : i + batch_size])
            out = hf_model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=output_len,
                                    min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            tokens += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    return time.perf_counter() - start, tokens


def gguf_cache_dir() -> str:
    """The default model's conversion, with its fp32 weights (HF transformers loads it there)."""
    from loom.model_loader.gguf_loader import gguf_weights_file
    from loom.transformers_utils.config import default_model_path

    return os.path.dirname(gguf_weights_file(default_model_path()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["default", "opt-125m"], choices=["default", *SHAPES])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; workload: {args.num_prompts} prompts x "
          f"({args.input_len} in, {args.output_len} out), greedy, seed {args.seed}, {args.dtype}")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.models:
            model = None if name == "default" else build_random_model(name, root)
            vocab = 49152 if name == "default" else VOCAB.get(name, 50272)
            prompts = workload(args.num_prompts, args.input_len, vocab, args.seed)
            elapsed, tokens = run_loom(model, prompts, args.output_len, args.dtype)
            loom_tps = tokens / elapsed
            hf_tps = None
            if not args.skip_hf:
                hf_model = load_hf(model, gguf_cache_dir() if model is None else None, getattr(torch, args.dtype))
                run_hf(hf_model, prompts[:2], 2, 2)  # warm-up
                hf_elapsed, hf_tokens = run_hf(hf_model, prompts, args.output_len, args.hf_batch_size)
                hf_tps = hf_tokens / hf_elapsed
                del hf_model
            rows.append((name, loom_tps, hf_tps))
            print(f"{name}: loom {loom_tps:,.0f} output tok/s ({elapsed:.1f} s)"
                  + (f", HF generate {hf_tps:,.0f} tok/s, ratio {loom_tps / hf_tps:.2f}x" if hf_tps else ""),
                  flush=True)
    print("\n| model | loom tok/s | HF generate tok/s | loom / HF |\n|---|---|---|---|")
    for name, loom_tps, hf_tps in rows:
        hf = f"{hf_tps:,.0f}" if hf_tps else "-"
        ratio = f"{loom_tps / hf_tps:.2f}x" if hf_tps else "-"
        print(f"| {name} | {loom_tps:,.0f} | {hf} | {ratio} |")


if __name__ == "__main__":
    main()
