"""EngineArgs: the parser ``add_cli_args`` builds from the fields, and the order it builds it in."""

from __future__ import annotations

import argparse
import dataclasses
import os
from types import SimpleNamespace

import pytest
from loom import platforms
from loom.engine import arg_utils
from loom.engine.arg_utils import EngineArgs
from loom.model_loader import WEIGHT_LOADERS

# Every flag of today's CLI and its dest: a flag renamed, dropped or added by accident fails here.
FLAGS = {
    "--tokenizer": "tokenizer",
    "--served-model-name": "served_model_name",
    "--dtype": "dtype",
    "--max-model-len": "max_model_len",
    "--quantization": "quantization",
    "--quantization-group-size": "quantization_group_size",
    "--hf-overrides": "hf_overrides",
    "--seed": "seed",
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--block-size": "block_size",
    "--no-enable-prefix-caching": "enable_prefix_caching",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--kv-cache-memory-bytes": "kv_cache_memory_bytes",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--enforce-eager": "enforce_eager",
    "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--no-enable-chunked-prefill": "enable_chunked_prefill",
    "--async-scheduling": "async_scheduling",
    "--custom-ops": "custom_ops",
    "--load-format": "load_format",
    "--worker-cls": "worker_cls",
    "--distributed-executor-backend": "distributed_executor_backend",
    "--ray-address": "ray_address",
    "--ray-placement-strategy": "ray_placement_strategy",
    "--ray-placement-timeout": "ray_placement_timeout",
    "--enable-lora": "enable_lora",
    "--max-loras": "max_loras",
    "--max-lora-rank": "max_lora_rank",
    "--max-cpu-loras": "max_cpu_loras",
}
FLAGLESS = {"model", "fail_on_environ_validation"}  # model is the command's positional


def engine_parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser(exit_on_error=False))


def field_default(f: dataclasses.Field) -> object:
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def test_every_flag_defaults_to_its_field() -> None:
    args = engine_parser().parse_args([])
    parsed = vars(args)
    for f in dataclasses.fields(EngineArgs):
        if f.name in FLAGLESS:
            assert f.name not in parsed, f"{f.name} has no flag today"
        else:
            assert parsed[f.name] == field_default(f), f"--{f.name}: the parser's default is not the field's"
    assert EngineArgs.from_cli_args(args) == EngineArgs()


def test_the_parser_has_exactly_today_s_flags_in_field_order() -> None:
    group = next(g for g in engine_parser()._action_groups if g.title == "engine")
    actions = group._group_actions
    assert {opt: a.dest for a in actions for opt in a.option_strings} == FLAGS
    dests = [a.dest for a in actions]
    assert dests == [f.name for f in dataclasses.fields(EngineArgs) if f.name not in FLAGLESS]
    tp = next(a for a in actions if a.dest == "tensor_parallel_size")
    assert tp.option_strings == ["--tensor-parallel-size", "-tp"]
    helps = {a.dest: a.help for a in actions}
    assert helps["load_format"] == "how to load weights; general plugins may add formats"
    assert helps["seed"] is None


def test_explicit_flags_parse() -> None:
    args = engine_parser().parse_args([
        "-tp", "2", "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--enforce-eager",
        "--dtype", "float16", "--max-model-len", "128", "--gpu-memory-utilization", "0.5",
        "--hf-overrides", '{"architectures": ["MyLlama"]}', "--custom-ops", "+rms_norm, -silu_and_mul,",
        "--load-format", "dummy", "--worker-cls", "pkg.mod.Worker",
    ])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args == EngineArgs(
        tensor_parallel_size=2, enable_prefix_caching=False, enable_chunked_prefill=False, enforce_eager=True,
        dtype="float16", max_model_len=128, gpu_memory_utilization=0.5,
        hf_overrides={"architectures": ["MyLlama"]}, custom_ops=["+rms_norm", "-silu_and_mul"],
        load_format="dummy", worker_cls="pkg.mod.Worker",
    )
    assert engine_parser().parse_args(["--tensor-parallel-size", "4"]).tensor_parallel_size == 4


@pytest.mark.parametrize("argv", [["--dtype", "int8"], ["--hf-overrides", "[1]"], ["--hf-overrides", "{"],
                                  ["--max-num-seqs", "many"], ["--load-format", "nosuch"]])
def test_a_bad_value_is_refused(argv) -> None:
    with pytest.raises(argparse.ArgumentError):
        engine_parser().parse_args(argv)


def test_load_format_choices_are_read_when_the_parser_is_built(monkeypatch) -> None:
    monkeypatch.setitem(WEIGHT_LOADERS, "test_format", lambda model, config, show_progress: "test")
    assert engine_parser().parse_args(["--load-format", "test_format"]).load_format == "test_format"


def test_platform_then_general_plugins_then_flags_then_the_platform_sees_the_parser(monkeypatch) -> None:
    calls = []

    def pre_register_and_update(parser=None):
        calls.append(("pre_register_and_update", "--load-format" in parser._option_string_actions))

    platform = SimpleNamespace(pre_register_and_update=pre_register_and_update)
    monkeypatch.setattr(platforms, "_get_current_platform", lambda: calls.append(("platform",)) or platform)
    monkeypatch.setattr(arg_utils, "load_general_plugins", lambda: calls.append(("general plugins",)))
    engine_parser()
    assert calls == [("platform",), ("general plugins",), ("pre_register_and_update", True)]


def test_api_key_file_keeps_the_key_off_command_lines(tmp_path, capsys):
    import argparse

    from loom.config.server import ServerConfig

    key_file = tmp_path / "key"
    key_file.write_text("sk-from-a-file\nignored second line\n")
    parser = ServerConfig.add_cli_args(argparse.ArgumentParser())
    server = ServerConfig.from_cli_args(parser.parse_args(["--api-key-file", str(key_file)]))
    assert server.api_key == "sk-from-a-file"
    assert not any("sk-from-a-file" in a or "--api-key" in a for a in server.to_argv())
    for content, message in [(None, "cannot read the API key from"), ("\n", "is empty; its first line must be")]:
        path = tmp_path / "bad"
        if content is not None:
            path.write_text(content)
        with pytest.raises(SystemExit):
            parser.parse_args(["--api-key-file", str(path)])
        assert message in capsys.readouterr().err


def test_async_scheduling_auto_overlaps_steps_only_where_the_worker_leaves_cpu_time(monkeypatch) -> None:
    from loom.engine.arg_utils import _async_scheduling

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOOM_CPU_NUM_THREADS", raising=False)
    assert _async_scheduling("auto", "cuda") and _async_scheduling("on", "cpu")
    assert not _async_scheduling("auto", "cpu")  # the worker's threads take every core
    assert not _async_scheduling("off", "cuda")
    monkeypatch.setenv("LOOM_CPU_NUM_THREADS", str(cores))
    assert not _async_scheduling("auto", "cpu")
    monkeypatch.setenv("LOOM_CPU_NUM_THREADS", str(cores - 1))
    assert _async_scheduling("auto", "cpu") == (cores > 1)
