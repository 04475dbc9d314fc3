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
from loom_plugin_api import PlatformEnum

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


def _recording(hook: str) -> classmethod:
    def call(cls: type, *args: Any, **kwargs: Any) -> Any:
        record(hook, _detail(hook, args))
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
