"""EngineArgs: the user-facing engine options, their CLI flags, and config creation.

Each option is declared once, as a field of :class:`EngineArgs`: its default, and for a field
made with :func:`_flag` the flag's type, choices and help. :meth:`EngineArgs.add_cli_args`
builds the parser from the fields, so a flag's default cannot drift from the field's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loom_plugin_api import load_general_plugins

from .. import envs, platforms
from ..config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    LoadConfig,
    LoomConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from ..logger import init_logger
from ..model_loader import load_format_choices

logger = init_logger(__name__)

_CLI = "cli"
"""Metadata key of a field that has a flag: what :func:`_flag` was given besides the default."""


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _custom_ops(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _flag(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
          flag: str | None = None, aliases: tuple[str, ...] = (),
          choices: list[str] | Callable[[], list[str]] | None = None, **options: Any) -> Any:
    """A field of :class:`EngineArgs` with a command-line flag; the field's default is the flag's.

    ``flag`` defaults to ``--field-name``; ``aliases`` are further option strings (``-tp``);
    ``choices`` may be a callable, called each time a parser is built (after the general
    plugins ran, so that they can add choices); ``options`` (``help``, ``type``, ``action``)
    go to ``add_argument`` as they are.
    """
    cli = {"flag": flag, "aliases": aliases, **options}
    if choices is not None:  # store_true and store_false actions take no choices
        cli["choices"] = choices
    return field(default=default, default_factory=default_factory, metadata={_CLI: cli})


@dataclass(kw_only=True)
class EngineArgs:
    model: str | None = None  # positional: the command adds it, add_cli_args does not
    tokenizer: str | None = _flag(None, help="tokenizer directory (default: the model's)")
    served_model_name: str | None = _flag(None)
    dtype: str = _flag("auto", choices=["auto", "float32", "bfloat16", "float16"])
    max_model_len: int | None = _flag(None, type=int)
    hf_overrides: dict[str, Any] = _flag(
        default_factory=dict, type=_json_object,
        help='JSON object set on the HF config, e.g. \'{"architectures": ["MyLlama"]}\'')
    seed: int | None = _flag(0, type=int)
    tensor_parallel_size: int = _flag(1, aliases=("-tp",), type=int)
    block_size: int | None = _flag(None, type=int)
    enable_prefix_caching: bool = _flag(True, flag="--no-enable-prefix-caching", action="store_false")
    kv_cache_memory_bytes: int | None = _flag(None, type=int)
    gpu_memory_utilization: float = _flag(
        0.9, type=float, help="share of GPU memory the model and its KV cache may use (GPU platforms)")
    enforce_eager: bool = _flag(
        False, action="store_true", help="do not record decode steps as CUDA graphs (GPU platforms)")
    max_num_seqs: int = _flag(256, type=int)
    max_num_batched_tokens: int | None = _flag(None, type=int)
    enable_chunked_prefill: bool = _flag(True, flag="--no-enable-chunked-prefill", action="store_false")
    custom_ops: list[str] = _flag(
        default_factory=list, type=_custom_ops, help="comma-separated: all, none, +name, -name")
    load_format: str = _flag(
        "auto", choices=load_format_choices, help="how to load weights; general plugins may add formats")
    worker_cls: str = _flag("auto", help="qualified name of the worker class")
    fail_on_environ_validation: bool = False  # no flag: set as a keyword of EngineArgs(...) or LLM(...)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags to ``parser``, one per field made with :func:`_flag`, in field order.

        The general plugins run first (once per process) so a plugin can extend what the
        flags accept; then the platform sees the parser (``pre_register_and_update``).
        """
        platform = platforms.current_platform  # resolved first: fixed before any general plugin runs
        load_general_plugins()
        g = parser.add_argument_group("engine")
        for f in dataclasses.fields(EngineArgs):
            cli = f.metadata.get(_CLI)
            if cli is None:
                continue  # model (positional, added by the command) and fail_on_environ_validation
            options = dict(cli)
            flag = options.pop("flag") or "--" + f.name.replace("_", "-")
            aliases = options.pop("aliases")
            if callable(options.get("choices")):
                options["choices"] = options["choices"]()  # now: the general plugins may have added some
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            g.add_argument(flag, *aliases, dest=f.name, default=default, **options)
        platform.pre_register_and_update(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def create_engine_config(self) -> LoomConfig:
        """Build the ``LoomConfig`` (start-up stops 5-7), in the process that parsed the args."""
        current_platform = platforms.current_platform  # resolved before the general plugins run
        load_general_plugins()
        current_platform.pre_register_and_update()
        device_config = DeviceConfig(device=current_platform.device_type)
        current_platform.validate_environ(self.fail_on_environ_validation)
        model_config = ModelConfig(
            model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
            max_model_len=self.max_model_len, hf_overrides=dict(self.hf_overrides), seed=self.seed,
            served_model_name=self.served_model_name,
        )
        max_len = model_config.max_model_len
        assert max_len is not None
        cache_config = CacheConfig(
            block_size=self.block_size or 16, user_block_size=self.block_size is not None,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_memory_bytes=_host_kv_cache_space(device_config.device_type) or self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 2048 if self.enable_chunked_prefill else max(2048, max_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )
        return LoomConfig(
            model_config=model_config,
            device_config=device_config,
            cache_config=cache_config,
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size, worker_cls=self.worker_cls,
            ),
            scheduler_config=scheduler_config,
            compilation_config=CompilationConfig(custom_ops=list(self.custom_ops), enforce_eager=self.enforce_eager),
            load_config=LoadConfig(load_format=self.load_format),
        )


def _host_kv_cache_space(device_type: str) -> int | None:
    """``LOOM_CPU_KVCACHE_SPACE`` (GiB) for platforms that compute in host memory; it wins
    over ``--kv-cache-memory-bytes``."""
    space = envs.LOOM_CPU_KVCACHE_SPACE
    if not space or device_type != "cpu":
        return None
    try:
        return int(float(space) * (1 << 30))
    except ValueError:
        raise ValueError(f"LOOM_CPU_KVCACHE_SPACE={space!r} is not a number of GiB (e.g. 4 or 0.5)") from None
