"""The kit's pytest plugin (entry point group ``pytest11``): options, markers, report.

It is installed with loom-plugin-api's ``testing`` extra and stays inert in any other test
run: its options are prefixed ``--loom-``, its fixtures (``_fixtures``, none autouse) load
only with ``--loom-platform``, and without that option the kit's own tests are deselected (a
run of only those is a usage error that says what to pass).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ._platform import inspect_platform, known_names
from .tiers import TIERS

_KIT_PACKAGE = Path(__file__).resolve().parent
_report_key = pytest.StashKey[dict]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("loom-conformance", "loom platform conformance kit (loom_plugin_api.testing)")
    group.addoption(
        "--loom-platform",
        default=None,
        metavar="NAME",
        help="run the conformance kit against the platform whose detector is NAME (as `loom plugins` "
        "lists it; the name LOOM_PLATFORM takes)",
    )
    group.addoption(
        "--loom-platform-class",
        default=None,
        metavar="QUALNAME",
        help="the Platform class to check when its detector answers None here (device absent): "
        "checks that need the device skip",
    )
    group.addoption(
        "--loom-report",
        default=None,
        metavar="PATH",
        help="write the kit's JSON report (each check: tier, name, outcome, message) to PATH",
    )


def pytest_configure(config: pytest.Config) -> None:
    for tier, what in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: loom conformance kit tier: {what}")
    name = config.getoption("--loom-platform")
    if name:
        if name not in known_names():
            raise pytest.UsageError(
                f"--loom-platform {name}: no platform detector of that name is installed; installed: "
                f"{', '.join(known_names()) or '(none)'} "
                "(the names `loom plugins` lists under [platform detectors])"
            )
        # Everything the engine resolves in this process and in the serves the kit starts.
        os.environ["LOOM_PLATFORM"] = name
        config.stash[_report_key] = {}
        # The kit's fixtures: a plugin, not a conftest.py, so that they load wherever pytest's
        # rootdir is (conftest files outside it are not read).
        config.pluginmanager.import_plugin("loom_plugin_api.testing._fixtures")


def _is_kit_item(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve().is_relative_to(_KIT_PACKAGE)


def _tier(item: pytest.Item) -> str:
    return next((m.name for m in item.iter_markers() if m.name in TIERS), "unknown")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kit = [item for item in items if _is_kit_item(item)]
    if not kit or config.getoption("--loom-platform"):
        return
    if len(kit) == len(items):
        raise pytest.UsageError(
            "the loom conformance kit needs the platform to check: pytest --pyargs loom_plugin_api.testing "
            "--loom-platform NAME (NAME as `loom plugins` lists it under [platform detectors])"
        )
    config.hook.pytest_deselected(items=kit)
    items[:] = [item for item in items if not _is_kit_item(item)]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    checks = item.config.stash.get(_report_key, None)
    if checks is None or not _is_kit_item(item):
        return report
    entry = checks.setdefault(
        item.nodeid, {"tier": _tier(item), "name": item.name, "outcome": "pass", "message": ""}
    )
    if report.skipped:
        entry["outcome"] = "skip"
        longrepr = report.longrepr
        message = str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)
        entry["message"] = message.removeprefix("Skipped: ")
    elif report.failed:
        entry["outcome"] = "fail"
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)[-2000:]
        entry["message"] = message.removeprefix("Failed: ")
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    checks = config.stash.get(_report_key, None)
    path = config.getoption("--loom-report")
    if checks is None or not path:
        return
    put = _platform_summary(config)
    summary = {
        outcome: sum(c["outcome"] == outcome for c in checks.values()) for outcome in ("pass", "fail", "skip")
    }
    Path(path).write_text(
        json.dumps({"platform": put, "summary": summary, "checks": list(checks.values())}, indent=2) + "\n"
    )


def _platform_summary(config: pytest.Config) -> dict[str, object]:
    name = config.getoption("--loom-platform")
    try:
        put = inspect_platform(name, config.getoption("--loom-platform-class"))
    except LookupError as e:
        return {"name": name, "error": str(e)}
    return {
        "name": name,
        "class": put.qualname,
        "distribution": put.distribution,
        "version": put.version,
        "contract_range": put.contract_range,
        "device_present": put.device_present,
        "error": put.error,
    }
