"""The start-up tour, stop by stop, in a fresh interpreter (see tour_probe.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("tour_probe.py")


@pytest.fixture(scope="module")
def tour(tiny_opt, tiny_llama):
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(tiny_opt), str(tiny_llama)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("TOUR-JSON "))
    data = json.loads(line.removeprefix("TOUR-JSON "))
    data["log"] = proc.stderr
    return data


def test_import_resolves_nothing(tour):
    assert tour["platform_resolved_at_import"] is False
    assert tour["general_loaded_at_import"] is False


def test_platform_is_fixed_before_general_plugins_run(tour, expected_platform):
    log = tour["log"]
    resolved = log.index("Resolved platform")
    assert "Platform detector cpu" in log[:resolved]
    if expected_platform == "dummy":  # the dummy wheel brings a general plugin
        assert resolved < log.index("General plugin dummy_custom_ops ran")


def test_detectors_and_winner(tour, expected_platform):
    verdicts = tour["verdicts"]
    assert verdicts["cpu"]["answer"] == "loom.platforms.cpu.CpuPlatform"
    assert verdicts["cuda"]["answer"] is None and not verdicts["cuda"]["raised"]
    if expected_platform == "dummy":
        assert tour["platform"] == "loom_platform_dummy.dummy_platform.DummyPlatform"
        assert verdicts["dummy_platform_plugin"]["won"] and not verdicts["cpu"]["won"]
        assert tour["is_out_of_tree"] is True
        assert "Platform plugin dummy_platform_plugin is activated" in tour["log"]
    else:
        assert tour["platform"] == "loom.platforms.cpu.CpuPlatform"
        assert verdicts["cpu"]["won"] and set(verdicts) == {"cpu", "cuda"}
    assert "Platform detector cpu: answered" in tour["log"]


def test_general_plugins_ran_once(tour, expected_platform, has_model_plugin):
    plugins = tour["general_plugins"]
    if expected_platform == "dummy":
        assert plugins["dummy_custom_ops"] == {"status": "loaded", "calls": 1}
        assert tour["op_registry_oot"] == {"RotaryEmbedding": "DummyRotaryEmbedding",
                                           "QuantizedLinear": "DummyQuantizedLinear"}
    else:
        assert tour["op_registry_oot"] == {}
    if has_model_plugin:
        assert plugins["register_dummy_model"] == {"status": "loaded", "calls": 1}


def test_pre_register_and_update_with_and_without_parser(tour):
    # two parsers built (hook with a parser each), then config creation (without), and
    # LLM() twice more without a parser.
    calls = tour["calls"]["pre_register"]
    assert calls[:3] == ["parser", "parser", "none"]
    assert set(calls[3:]) == {"none"}


def test_custom_ops_before_and_after_check(tour, expected_platform):
    first = tour["calls"]["check_and_update"][0]  # the config parsed with --custom-ops none
    assert first["before"] == ["none"]
    if expected_platform == "dummy":
        assert first["after"] == ["all"]  # the platform's last word turns its ops on
        assert first["worker_cls"] == "loom_platform_dummy.worker.DummyWorker"
    else:
        assert first["after"] == ["none"]
        assert first["worker_cls"] == "loom.worker.cpu_worker.CPUWorker"
    later = tour["calls"]["check_and_update"][1]  # LLM() with no custom_ops: the base entry is "all"
    assert later["before"] == ["all"]


def test_registry_eager_and_lazy(tour, has_model_plugin):
    registry = tour["registry"]
    assert registry["LlamaForCausalLM"]["eager_info"] is False  # in-tree models are lazy
    if has_model_plugin:
        assert registry["MyOPTForCausalLM"] == {"eager_info": True, "imported": True}
        assert registry["MyLlama"] == {"eager_info": False, "imported": False}
        assert tour["my_llama_module_loaded"] is False
        assert tour["my_llama_module_loaded_after_llm"] is True
        assert tour["opt_architecture"] == "MyOPTForCausalLM"
        assert tour["llama_model_cls"] == "MyLlama"
        assert "Resolved architecture: MyOPTForCausalLM" in tour["log"]


def test_attention_selector_asks_platform_once(tour):
    assert tour["num_attention_layers"] == 2
    assert tour["attn_backend_asks"] == 1


def test_op_replacement_and_dispatch(tour, expected_platform):
    if expected_platform == "dummy":
        assert tour["rope"] == [["DummyRotaryEmbedding", "forward_oot"]]
        assert tour["forward_oot_calls"] > 0
        assert tour["opt_norms"] == [["LayerNorm", "forward_oot"]]
    else:
        assert tour["rope"] == [["RotaryEmbedding", "forward_cpu"]]
        assert tour["opt_norms"] == [["LayerNorm", "forward_cpu"]]
    assert tour["generated"] == 4


def test_envs_cache_enabled_at_end_of_startup(tour):
    assert tour["envs_cache_enabled"] is True
