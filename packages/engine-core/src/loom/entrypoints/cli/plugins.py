"""``loom plugins``: every plugin group, entry point and platform verdict in this process."""

from __future__ import annotations

import argparse

from loom_plugin_api import load_general_plugins, load_plugins_by_group, plugin_records
from loom_plugin_api._groups import ALL_GROUPS, PLATFORM_PLUGINS_GROUP
from loom_plugin_api.errors import PlatformError, PluginError
from loom_plugin_api.loader import PluginRecord
from loom_plugin_api.validation import installed_contract_version

from ... import envs, platforms
from . import plugins_check, plugins_new


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plugins", help="show every plugin group, entry point and platform verdict; check or create a plugin")
    plugins_check.add_subcommand(p)
    plugins_new.add_subcommand(p)
    return p


def _contract(r: PluginRecord) -> str:
    """The range of loom-plugin-api the plugin's distribution asks for, and the verdict."""
    if r.distribution is None:
        return "no distribution"
    if r.contract_range is None:
        return "loom-plugin-api range not declared"
    verdict = "compatible" if r.compatible else f"INCOMPATIBLE with {installed_contract_version()}"
    return f"loom-plugin-api{r.contract_range or ' (any)'}: {verdict}"


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
            print(f"  {r.name} = {r.value}  [{origin}; {_contract(r)}]  {status}")


def run(args: argparse.Namespace) -> int:
    command = getattr(args, "plugins_command", None)
    if command == "check":
        return plugins_check.run(args)
    if command == "new":
        return plugins_new.run(args)
    raw = envs.LOOM_PLUGINS
    print("LOOM_PLUGINS: " + ("unset (all plugins load)" if raw is None else repr(raw)))
    print(f"installed contract: loom-plugin-api {installed_contract_version()}")
    # The order of `loom serve`: the platform is resolved before any general plugin runs.
    try:
        platform = platforms.current_platform
        platform_error = None
    except PlatformError as e:
        platform, platform_error = None, str(e)
    general_error = None
    try:
        load_general_plugins()
    except PluginError as e:
        general_error = str(e)
    print_groups()
    if general_error:
        print(f"general plugins: FAILED: {general_error}")
    print(f"[platform detectors] (built-in first, then {PLATFORM_PLUGINS_GROUP})")
    for v in platforms.detector_verdicts():
        kind = "built-in" if v.builtin else "out-of-tree"
        print(f"  {v.name} ({kind}): {v.describe()}")
    if platform is None:
        print(f"platform: FAILED: {platform_error}")
        return 1
    print(f"platform: {type(platform).__module__}.{type(platform).__qualname__} "
          f"(device_name={platform.device_name}, device_type={platform.device_type}; "
          f"from {platforms.platform_plugin()})")
    return 1 if general_error else 0
