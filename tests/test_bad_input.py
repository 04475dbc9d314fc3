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


def test_bad_chat_template_cli(tmp_path):
    missing = tmp_path / "missing.jinja"
    for command in (["serve"], ["generate", "hi"]):  # checked before the model loads or anything is spawned
        proc = cli(*command, "--chat-template", str(missing))
        assert proc.returncode == 1, proc.stderr
        assert last_line(proc).startswith(f"loom: error: --chat-template: file '{missing}' not found")
        assert "Traceback" not in proc.stderr
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }}")
    proc = cli("serve", "--chat-template", str(broken))
    assert proc.returncode == 1
    line = last_line(proc)
    assert line.startswith(f"loom: error: --chat-template: file '{broken}' does not parse as a Jinja template: line 1")
    assert "endfor" in line and "Traceback" not in proc.stderr


def test_bad_flag_cli():
    proc = cli("generate", "hi", "--tensor-parallel-size", "many")
    assert proc.returncode == 2 and "invalid int value: 'many'" in proc.stderr
    proc = cli("generate", "hi", "--hf-overrides", "{not json")
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr
    proc = cli("serve", "--stream-interval", "0")
    assert proc.returncode == 2 and "--stream-interval: expected a positive integer, got 0" in proc.stderr


def test_ray_backend_without_ray_says_what_to_install(tiny_llama):
    # the matrix's test sessions do not install Ray (only `nox -s ray` does)
    for command in (["serve", str(tiny_llama)], ["generate", "hi", "--model", str(tiny_llama)]):
        proc = cli(*command, "--distributed-executor-backend", "ray")
        assert proc.returncode == 1, proc.stderr
        assert last_line(proc) == ("loom: error: --distributed-executor-backend ray needs Ray, which is not installed "
                                   "here: pip install 'loom-engine[ray]'")
    proc = cli("generate", "hi", "--ray-placement-strategy", "ANYWHERE")
    assert proc.returncode == 2 and "invalid choice: 'ANYWHERE'" in proc.stderr


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
    for bad, message in (({"temperature": -1}, "temperature must be >= 0"), ({"top_p": 0}, "top_p must be in"),
                         ({"top_k": -5}, "top_k must be"), ({"max_tokens": 0}, "max_tokens must be >= 1"),
                         ({"n": 0}, "n must be >= 1"), ({"logprobs": 100}, "logprobs must be in"),
                         ({"min_tokens": 5, "max_tokens": 2}, "must not exceed"),
                         ({"temperature": "0.5"}, "temperature must be a number"), ({"n": True}, "n must be an integer"),
                         ({"seed": 2**64}, "seed must be in"), ({"stop_token_ids": [True]}, "stop_token_ids")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)
    # the engine keeps working after rejected requests
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 3


def test_max_model_len_over_model_limit(tiny_llama):
    with pytest.raises(ValueError, match="exceeds the model's context length 512; lower --max-model-len"):
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


def test_failed_step_leaves_llm_usable(tiny_llama, monkeypatch):
    from loom.engine.llm_engine import EngineStepError

    llm = LLM(str(tiny_llama), max_model_len=64)
    runner = llm.llm_engine.executor.worker.model_runner
    original = runner.execute_model
    monkeypatch.setattr(runner, "execute_model", lambda so: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(EngineStepError, match="boom") as failed:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [1, 2, 4]}], SamplingParams(max_tokens=2))
    assert isinstance(failed.value.__cause__, RuntimeError)  # the model's own error and traceback, kept
    monkeypatch.setattr(runner, "execute_model", original)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 3


def test_llm_shutdown_frees_the_model(tiny_llama):
    import gc
    import weakref

    llm = LLM(str(tiny_llama), max_model_len=64)
    model = weakref.ref(llm.llm_engine.executor.worker.model_runner.model)
    llm.shutdown()
    gc.collect()
    assert model() is None, "the model (and its KV cache) outlived LLM.shutdown()"
