"""Bad input gets a one-line error that says what and how to fix it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fake_dist import run_python, write_fake_dist
from loom import LLM, SamplingParams


def cli(*args: str, env: dict[str, str] | None = None, extra_path=None) -> subprocess.CompletedProcess[str]:
    code = f"from loom.entrypoints.cli.main import main; raise SystemExit(main({list(args)!r}))"
    return run_python(code, extra_path, env=env)


def last_line(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stderr.strip().splitlines()[-1]


def test_missing_model_path_cli():
    proc = cli("generate", "hi", "--model", "/nonexistent/model")
    assert proc.returncode == 1
    assert last_line(proc).startswith("loom: error: model path '/nonexistent/model' does not exist")
    assert "Traceback" not in proc.stderr


def test_bad_flag_cli():
    proc = cli("generate", "hi", "--tensor-parallel-size", "many")
    assert proc.returncode == 2 and "invalid int value: 'many'" in proc.stderr
    proc = cli("generate", "hi", "--hf-overrides", "{not json")
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr


def test_malformed_model_dirs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(empty))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{ this is not json")
    with pytest.raises(ValueError, match="cannot read the config"):
        LLM(str(broken))
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"xx")
    with pytest.raises(ValueError, match="not a .gguf file"):
        LLM(str(not_gguf))


def test_unknown_architecture_lists_registered(tiny_llama):
    with pytest.raises(ValueError) as info:
        LLM(str(tiny_llama), hf_overrides={"architectures": ["NoSuchForCausalLM"]})
    message = str(info.value)
    assert "NoSuchForCausalLM" in message and "LlamaForCausalLM" in message and "OPTForCausalLM" in message
    assert "General plugins loaded:" in message


def test_prompt_over_max_model_len_and_bad_sampling(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=32)
    with pytest.raises(ValueError, match="exceeds max_model_len 32"):
        llm.generate({"prompt_token_ids": list(range(40))})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [10**9]})
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_k": -5}, {"max_tokens": 0}, {"n": 0},
                {"logprobs": 100}, {"min_tokens": 5, "max_tokens": 2}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    # the engine keeps working after rejected requests
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 3


def test_max_model_len_over_model_limit(tiny_llama):
    with pytest.raises(ValueError, match="exceeds the model's context length 512"):
        LLM(str(tiny_llama), max_model_len=100000)


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="unknown engine arguments \\['nonsense'\\]"):
        LLM(nonsense=1)


def test_raising_general_plugin_is_one_line(tmp_path, tiny_llama):
    write_fake_dist(tmp_path, "fake-raiser", {"loom.general_plugins": {"raiser": "fakeraiser:register"}},
                    "fakeraiser", "def register():\n    raise RuntimeError('cannot register')\n")
    proc = cli("generate", "hi", "--model", str(tiny_llama), extra_path=tmp_path)
    assert proc.returncode == 1
    line = last_line(proc)
    assert line.startswith("loom: error: general plugin 'raiser'") and "cannot register" in line
    assert "LOOM_PLUGINS" in line and "Traceback" not in proc.stderr


def test_python_m_entrypoint_exists():
    proc = subprocess.run([sys.executable, "-m", "loom.entrypoints.cli.main", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "generate" in proc.stdout and "plugins" in proc.stdout
