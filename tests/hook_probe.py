"""An out-of-tree platform that records every platform hook call, then lets the CPU platform answer.

Each call appends one JSON line ``{"pid", "role", "hook", "detail"}`` to the file named by
``$LOOM_HOOK_PROBE_LOG``. ``role`` is the process's part in a serve, from the variables the
supervisor sets in each child (``LOOM_ROLE``, ``LOOM_RANK``): ``frontend``, ``engine_core``,
``worker:<rank>``, or ``cli`` for the process that ran ``loom serve``.

test_platform_hooks.py installs this module as a fake distribution (entry point
``hook_probe`` in ``loom.platform_plugins``) on a temporary PYTHONPATH.
"""

from __future__ import annotations

import json
import os
from typing import Any

from loom.platforms.cpu import CpuPlatform
from loom_plugin_api import CPUWorker, PlatformEnum

PROBE_LOG = "LOOM_HOOK_PROBE_LOG"

# Every hook of loom_plugin_api.Platform; the test checks that this list is complete.
HOOKS = (
    "pre_register_and_update",
    "apply_config_platform_defaults",
    "check_and_update_config",
    "validate_environ",
    "update_block_size_for_backend",
    "register_triton_kernel_overrides",
    "get_attn_backend_cls",
    "get_device_communicator_cls",
    "get_device_total_memory",
    "get_device_available_memory",
    "set_device",
    "seed_everything",
)


def process_role() -> str:
    role = os.environ.get("LOOM_ROLE")
    if role is None:
        return "cli"
    return f"worker:{os.environ['LOOM_RANK']}" if role == "worker" else role


def record(hook: str, detail: Any = None) -> None:
    line = json.dumps({"pid": os.getpid(), "role": process_role(), "hook": hook, "detail": detail})
    with open(os.environ[PROBE_LOG], "a") as f:  # one short O_APPEND write per line: lines never interleave
        f.write(line + "\n")


def _detail(hook: str, args: tuple[Any, ...]) -> Any:
    if hook == "pre_register_and_update":
        return "parser" if args and args[0] is not None else "none"
    if hook == "seed_everything":
        return args[0] if args else None
    if hook == "set_device":
        return str(args[0])
    return None


# The worker lifecycle that the runtime drives (loom_plugin_api.worker), recorded as "worker.<name>".
WORKER_LIFECYCLE = (
    "init_device", "load_model", "determine_available_memory", "get_kv_cache_block_bytes", "initialize_cache",
    "execute_model", "shutdown",
)


def _recording_method(name: str) -> Any:
    def call(self: CPUWorker, *args: Any, **kwargs: Any) -> Any:
        record(f"worker.{name}")
        return getattr(super(ProbeWorker, self), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


class ProbeWorker(CPUWorker):
    """The contract's CPU worker with every lifecycle call recorded."""


for _name in WORKER_LIFECYCLE:
    setattr(ProbeWorker, _name, _recording_method(_name))


def _recording(hook: str) -> classmethod:
    def call(cls: type, *args: Any, **kwargs: Any) -> Any:
        record(hook, _detail(hook, args))
        if hook == "check_and_update_config" and args[0].parallel_config.worker_cls == "auto":
            args[0].parallel_config.worker_cls = f"{__name__}.ProbeWorker"
        return getattr(super(HookProbePlatform, cls), hook)(*args, **kwargs)

    call.__name__ = call.__qualname__ = hook
    return classmethod(call)


class HookProbePlatform(CpuPlatform):
    """The CPU platform under another name, with every hook recorded."""

    _enum = PlatformEnum.OOT
    device_name = "hook_probe"


for _hook in HOOKS:
    setattr(HookProbePlatform, _hook, _recording(_hook))


def hook_probe_platform() -> str:
    """The detector: always present."""
    record("detector")
    return f"{__name__}.HookProbePlatform"
