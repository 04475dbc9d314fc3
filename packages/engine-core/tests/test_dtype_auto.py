"""``dtype="auto"``: bf16 on host platforms whose CPU computes it natively, fp32 elsewhere on the
host, and the other devices' rule unchanged; the CPU's flags read from ``/proc/cpuinfo``.

Every branch runs on any machine: ``LOOM_CPU_BF16`` (or a patched ``cpu_flags``) stands for
the CPU. Caught when seen to fail: ``auto`` ignoring the CPU (the old rule gives fp32 for the
GGUF model and the checkpoint's dtype elsewhere), the CUDA branch following the CPU's flags,
and a parser that takes one processor's flags for all of them.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from loom import envs, platforms
from loom.config import ModelConfig
from loom.engine.arg_utils import EngineArgs
from loom.models import register_builtin_models
from loom.platforms import cpu_features

CPUINFO = """\
processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile
bugs\t\t: sysret_ss_attrs

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile
bugs\t\t: sysret_ss_attrs
"""

ARM_CPUINFO = """\
processor\t: 0
Features\t: fp asimd bf16 i8mm
CPU implementer\t: 0x41
"""


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    """Each test sets LOOM_CPU_BF16 itself; the caller's value never leaks in."""
    monkeypatch.delenv("LOOM_CPU_BF16", raising=False)
    envs._disable_envs_cache_for_tests()


def test_flags_are_those_every_processor_reports():
    flags = cpu_features.parse_cpu_flags(CPUINFO)
    assert {"avx512_bf16", "avx512f", "amx_tile"} <= flags
    assert "amx_bf16" not in flags  # processor 1 lacks it
    assert "sysret_ss_attrs" not in flags  # the bugs line is not a flags line
    assert cpu_features.parse_cpu_flags(ARM_CPUINFO) == frozenset()
    assert cpu_features.parse_cpu_flags("") == frozenset()


def test_this_machines_flags_are_read_once():
    assert isinstance(cpu_features.cpu_flags(), frozenset)
    assert cpu_features.cpu_flags() is cpu_features.cpu_flags()


@pytest.mark.parametrize(("text", "expected"), [
    (CPUINFO, (True, "the CPU reports avx512_bf16")),
    # no avx512_bf16, and amx_bf16 on one processor only
    (CPUINFO.replace("avx512_bf16 ", ""), (False, "the CPU reports neither avx512_bf16 nor amx_bf16")),
    (CPUINFO.replace("avx512_bf16 ", "amx_bf16 "), (True, "the CPU reports amx_bf16")),
    (ARM_CPUINFO, (False, "the CPU reports neither avx512_bf16 nor amx_bf16")),
])
def test_native_bf16_from_the_flags(monkeypatch, text, expected):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: cpu_features.parse_cpu_flags(text))
    assert cpu_features.native_bf16() == expected


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("true", True), ("0", False), ("no", False)])
def test_the_override_wins_over_the_flags(monkeypatch, value, expected):
    flags = "" if expected else "avx512_bf16"
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags.split()))
    monkeypatch.setenv("LOOM_CPU_BF16", value)
    assert cpu_features.native_bf16() == (expected, f"LOOM_CPU_BF16={value}")


def test_an_unknown_override_is_an_error(monkeypatch):
    monkeypatch.setenv("LOOM_CPU_BF16", "maybe")
    with pytest.raises(ValueError, match="LOOM_CPU_BF16='maybe' must be 1 or 0"):
        cpu_features.native_bf16()


def resolve(dtype: str, device_type: str | None, model_format: str = "hf", config_dtype: str | None = None,
            platform_dtypes: tuple[str, ...] | None = ("float32", "bfloat16")) -> str:
    """``ModelConfig``'s rule alone, on a config that names ``config_dtype`` (None: unset)."""
    config = object.__new__(ModelConfig)
    config.model_format = model_format
    config.hf_config = type("Cfg", (), {} if config_dtype is None else {"dtype": config_dtype})()
    return config._resolve_dtype(dtype, device_type, platform_dtypes)


HOST = "cpu"


@pytest.mark.parametrize(("bf16", "model_format", "config_dtype", "expected"), [
    ("1", "hf", "bfloat16", "bfloat16"),
    ("1", "hf", "float32", "bfloat16"),
    ("1", "hf", "float16", "bfloat16"),
    ("1", "hf", "torch.float32", "bfloat16"),
    ("1", "hf", None, "bfloat16"),  # unset: transformers' default, fp32
    ("1", "hf", "float64", "float32"),
    ("1", "hf", "int8", "float32"),
    ("1", "gguf", None, "bfloat16"),  # the default model
    ("1", "gguf", "float32", "bfloat16"),
    ("0", "hf", "bfloat16", "float32"),
    ("0", "hf", "float32", "float32"),
    ("0", "hf", None, "float32"),
    ("0", "gguf", None, "float32"),
])
def test_auto_on_the_host(monkeypatch, bf16, model_format, config_dtype, expected):
    monkeypatch.setenv("LOOM_CPU_BF16", bf16)
    assert resolve("auto", HOST, model_format, config_dtype) == expected


def test_auto_on_the_host_picks_only_what_the_platform_declares(monkeypatch):
    monkeypatch.setenv("LOOM_CPU_BF16", "1")
    assert resolve("auto", HOST, "hf", "bfloat16", platform_dtypes=("float32",)) == "float32"
    assert resolve("auto", HOST, "gguf", None, platform_dtypes=("float32",)) == "float32"


@pytest.mark.parametrize("bf16", ["1", "0"])
@pytest.mark.parametrize("device_type", ["cuda", None])
@pytest.mark.parametrize(("model_format", "config_dtype", "expected"), [
    ("hf", "bfloat16", "bfloat16"),
    ("hf", "float32", "float32"),
    ("hf", "float16", "float32"),
    ("hf", None, "float32"),
    ("gguf", None, "float32"),
])
def test_auto_elsewhere_keeps_its_rule_whatever_the_cpu(monkeypatch, bf16, device_type, model_format,
                                                        config_dtype, expected):
    monkeypatch.setenv("LOOM_CPU_BF16", bf16)
    assert resolve("auto", device_type, model_format, config_dtype) == expected


@pytest.mark.parametrize("device_type", [HOST, "cuda"])
@pytest.mark.parametrize(("asked", "expected"), [
    ("float32", "float32"), ("fp32", "float32"), ("bf16", "bfloat16"), ("half", "float16"),
])
def test_an_explicit_dtype_is_kept(monkeypatch, device_type, asked, expected):
    monkeypatch.setenv("LOOM_CPU_BF16", "1")
    assert resolve(asked, device_type, "gguf", "bfloat16") == expected


def test_auto_logs_its_choice_and_why(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="loom.config.model")
    monkeypatch.setenv("LOOM_CPU_BF16", "1")
    resolve("auto", HOST, "hf", "float32")
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.delenv("LOOM_CPU_BF16")
    resolve("auto", HOST, "gguf")
    resolve("auto", "cuda", "gguf")
    assert [r.getMessage() for r in caplog.records if r.name == "loom.config.model"] == [
        "dtype auto resolved to bfloat16: LOOM_CPU_BF16=1 and the checkpoint's dtype is float32",
        "dtype auto resolved to float32: the CPU reports neither avx512_bf16 nor amx_bf16",
        "dtype auto resolved to float32: the checkpoint is GGUF; on cuda, auto keeps an fp32 or bf16 "
        "checkpoint's dtype, else fp32",
    ]


@pytest.fixture
def tiny_llama_config(tmp_path):
    """A llama config.json (the config alone: nothing here loads weights)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "max_position_embeddings": 256, "torch_dtype": "float32",
    }))
    return str(tmp_path)


@pytest.mark.parametrize("bf16", ["1", "0"])
def test_engine_args_hand_the_platform_to_the_rule(monkeypatch, tiny_llama_config, bf16):
    register_builtin_models()  # idempotent; as model_utils.make_config
    monkeypatch.setenv("LOOM_CPU_BF16", bf16)
    config = EngineArgs(model=tiny_llama_config, max_model_len=128).create_engine_config()
    on_host = platforms.current_platform.device_type == "cpu"
    assert config.model_config.dtype == ("bfloat16" if on_host and bf16 == "1" else "float32")
    assert config.model_config.torch_dtype is getattr(torch, config.model_config.dtype)
