"""``loom plugins``: every plugin group, entry point and platform verdict in this process."""

from __future__ import annotations

import argparse
import os

from loom_plugin_api import load_general_plugins, load_plugins_by_group, plugin_records
from loom_plugin_api._groups import ALL_GROUPS, PLATFORM_PLUGINS_GROUP
from loom_plugin_api.errors import PlatformError, PluginError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return subparsers.add_parser("plugins", help="show every plugin group, entry point and platform verdict")


def print_groups() -> None:
    for group in ALL_GROUPS:
        load_plugins_by_group(group)
        records = plugin_records(group)
        print(f"[{group}]" + ("" if records else " (none installed)"))
        for r in records:
            origin = f"{r.distribution} {r.version}" if r.distribution else "unknown distribution"
            status = r.status + (f": {r.error}" if r.error else "")
            if r.calls:
                status += f" ({'; '.join(r.calls)})"
            print(f"  {r.name} = {r.value}  [{origin}]  {status}")


def run(args: argparse.Namespace) -> int:
    raw = os.environ.get("LOOM_PLUGINS")
    print("LOOM_PLUGINS: " + ("unset (all plugins load)" if raw is None else repr(raw)))
    general_error = None
    try:
        load_general_plugins()
    except PluginError as e:
        general_error = str(e)
    print_groups()
    if general_error:
        print(f"general plugins: FAILED: {general_error}")
    from ... import platforms

    print(f"[platform detectors] (built-in first, then {PLATFORM_PLUGINS_GROUP})")
    try:
        platform = platforms.current_platform
    except PlatformError as e:
        platform = None
        error = str(e)
    for v in platforms.detector_verdicts():
        kind = "built-in" if v.builtin else "out-of-tree"
        print(f"  {v.name} ({kind}): {v.describe()}")
    if platform is None:
        print(f"platform: FAILED: {error}")
        return 1
    print(f"platform: {type(platform).__module__}.{type(platform).__qualname__} "
          f"(device_name={platform.device_name}, device_type={platform.device_type})")
    return 1 if general_error else 0
