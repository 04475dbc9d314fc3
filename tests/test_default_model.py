"""The embedded default model (SmolLM2-135M-Instruct, GGUF) answers a real question."""

from __future__ import annotations

import subprocess
import sys

from loom import LLM, SamplingParams


def test_default_model_knows_paris():
    llm = LLM()
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))
    text = out[0].outputs[0].text
    assert "Paris" in text, text
    assert out[0].outputs[0].finish_reason in ("stop", "length")


def test_cli_generate_with_default_model():
    proc = subprocess.run(
        [sys.executable, "-m", "loom.entrypoints.cli.main", "generate", "What is the capital of France?",
         "--max-tokens", "24"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout
