from __future__ import annotations

import logging

import pytest
from loom_plugin_api import (
    ENDPOINT_PLUGINS_GROUP,
    STAT_LOGGER_PLUGINS_GROUP,
    PluginError,
    load_general_plugins,
    load_plugins_by_group,
    load_plugins_strict,
    plugin_records,
)
from loom_plugin_api.loader import general_plugins_loaded, set_loom_plugins_reader
from loom_plugin_api.validation import installed_contract_version
from plugin_dists import make_dist

GROUP = "loom.general_plugins"

MODULE = """
calls = []
def first():
    calls.append("first")
def second():
    calls.append("second")
def boom():
    raise RuntimeError("kaput")
NOT_CALLABLE = 3
"""


@pytest.fixture(autouse=True)
def no_ambient_loom_plugins(monkeypatch):
    """Unset unless a test sets it: CI may run with LOOM_PLUGINS set."""
    monkeypatch.delenv("LOOM_PLUGINS", raising=False)


def test_loads_group_with_distribution(fake_site):
    make_dist(fake_site, "fake-a", {GROUP: {"p_first": "fakeplug_a:first"}}, {"fakeplug_a": MODULE})
    plugins = load_plugins_by_group(GROUP)
    assert "p_first" in plugins and callable(plugins["p_first"])
    record = next(r for r in plugin_records(GROUP) if r.name == "p_first")
    assert (record.distribution, record.version, record.status) == ("fake-a", "0.1", "loaded")
    assert load_plugins_by_group(GROUP) is plugins  # cached per process


def test_loom_plugins_filters_and_warns_on_unknown(fake_site, monkeypatch, caplog):
    make_dist(fake_site, "fake-a", {GROUP: {"p_first": "fakeplug_a:first", "p_second": "fakeplug_a:second"}},
              {"fakeplug_a": MODULE})
    monkeypatch.setenv("LOOM_PLUGINS", " p_second , nosuch")
    with caplog.at_level(logging.WARNING, logger="loom.plugins"):
        plugins = load_plugins_by_group(GROUP)
    assert list(plugins) == ["p_second"]
    statuses = {r.name: r.status for r in plugin_records(GROUP)}
    assert statuses["p_first"] == "filtered"
    warning = next(r.getMessage() for r in caplog.records if "nosuch" in r.getMessage())
    assert "p_first" in warning and "p_second" in warning


def test_empty_loom_plugins_loads_none(fake_site, monkeypatch):
    make_dist(fake_site, "fake-a", {GROUP: {"p_first": "fakeplug_a:first"}}, {"fakeplug_a": MODULE})
    monkeypatch.setenv("LOOM_PLUGINS", "")
    assert load_plugins_by_group(GROUP) == {}


def test_import_failure_is_reported_not_skipped(fake_site, caplog):
    make_dist(fake_site, "fake-b", {GROUP: {"broken": "fakeplug_missing:func"}})
    with caplog.at_level(logging.ERROR, logger="loom.plugins"):
        plugins = load_plugins_by_group(GROUP)
    assert "broken" not in plugins
    record = next(r for r in plugin_records(GROUP) if r.name == "broken")
    assert record.status == "failed" and "fakeplug_missing" in record.error
    message = caplog.records[-1].getMessage()
    assert "broken" in message and GROUP in message and "ModuleNotFoundError" in message
    with pytest.raises(PluginError, match="broken"):
        load_general_plugins()


def test_non_callable_entry_point_fails(fake_site):
    make_dist(fake_site, "fake-a", {GROUP: {"nc": "fakeplug_a:NOT_CALLABLE"}}, {"fakeplug_a": MODULE})
    assert "nc" not in load_plugins_by_group(GROUP)
    record = next(r for r in plugin_records(GROUP) if r.name == "nc")
    assert record.status == "failed" and "not a callable" in record.error


def test_general_plugins_run_once_in_order(fake_site, monkeypatch):
    make_dist(fake_site, "fake-a", {GROUP: {"p_first": "fakeplug_a:first", "p_second": "fakeplug_a:second"}},
              {"fakeplug_a": MODULE})
    monkeypatch.setenv("LOOM_PLUGINS", "p_first,p_second")
    load_general_plugins()
    load_general_plugins()
    import fakeplug_a

    assert fakeplug_a.calls == ["first", "second"]
    assert general_plugins_loaded()


def test_raising_general_plugin_names_itself(fake_site, monkeypatch):
    make_dist(fake_site, "fake-a", {GROUP: {"p_boom": "fakeplug_a:boom"}}, {"fakeplug_a": MODULE})
    monkeypatch.setenv("LOOM_PLUGINS", "p_boom")
    with pytest.raises(PluginError, match=r"'p_boom'.*fake-a.*RuntimeError: kaput.*LOOM_PLUGINS"):
        load_general_plugins()
    # later callers in the same process get the same error, not a half-set-up process
    with pytest.raises(PluginError, match="p_boom"):
        load_general_plugins()


def test_records_describe_each_entry_point_of_their_group(fake_site, monkeypatch):
    make_dist(fake_site, "fake-a", {GROUP: {"p_a": "fakeplug_a:first", "p_nc": "fakeplug_a:NOT_CALLABLE",
                                            "p_b": "fakeplug_missing:x", "p_c": "fakeplug_a:second"},
                                    "loom.platform_plugins": {"p_plat": "fakeplug_a:first"}},
              {"fakeplug_a": MODULE})
    monkeypatch.setenv("LOOM_PLUGINS", "p_nc,p_b,p_c,p_plat")
    assert list(load_plugins_by_group(GROUP)) == ["p_c"]  # after a filtered, an invalid and a failed one
    load_plugins_by_group("loom.platform_plugins")
    assert {r.group for r in plugin_records(GROUP)} == {GROUP}
    records = {r.name: r for r in plugin_records(GROUP) if r.name.startswith("p_")}  # not installed ones
    assert list(records) == ["p_a", "p_nc", "p_b", "p_c"]
    assert records["p_c"].value == "fakeplug_a:second" and records["p_c"].status == "loaded"
    assert 0 <= records["p_c"].load_seconds < 60
    assert records["p_nc"].error == "entry point value 'fakeplug_a:NOT_CALLABLE' is a int, not a callable"
    assert [r.name for r in plugin_records("loom.platform_plugins") if r.name.startswith("p_")] == ["p_plat"]


def test_a_group_outside_loom_s_own_is_scanned_too(fake_site):
    make_dist(fake_site, "fake-a", {"loom.test_extra_group": {"p_x": "fakeplug_a:first"}}, {"fakeplug_a": MODULE})
    assert list(load_plugins_by_group("loom.test_extra_group")) == ["p_x"]


def test_unknown_loom_plugins_names_warn_once_per_process(fake_site, monkeypatch, caplog):
    make_dist(fake_site, "fake-a", {GROUP: {"p_first": "fakeplug_a:first"}}, {"fakeplug_a": MODULE})
    monkeypatch.setenv("LOOM_PLUGINS", "nosuch")
    with caplog.at_level(logging.WARNING, logger="loom.plugins"):
        load_plugins_by_group(GROUP)
        load_plugins_by_group("loom.platform_plugins")
    assert sum("nosuch" in r.getMessage() for r in caplog.records) == 1


def test_general_plugin_records_its_run_and_its_failure(fake_site, monkeypatch):
    make_dist(fake_site, "fake-a", {GROUP: {"p_first": "fakeplug_a:first", "p_boom": "fakeplug_a:boom"},
                                    "loom.platform_plugins": {"p_broken": "fakeplug_missing:x"}},
              {"fakeplug_a": MODULE})
    monkeypatch.setenv("LOOM_PLUGINS", "p_first,p_boom,p_broken")
    load_plugins_by_group("loom.platform_plugins")  # a failed plugin of another group does not matter here
    with pytest.raises(PluginError, match="p_boom"):
        load_general_plugins()
    records = {r.name: r for r in plugin_records(GROUP)}
    (call,) = records["p_first"].calls
    assert call.startswith("ran in ") and 0 <= float(call.split()[2]) < 60
    assert records["p_boom"].status == "failed" and records["p_boom"].error == "RuntimeError: kaput"


def test_strict_load_names_the_first_failed_plugin_of_its_group(fake_site, monkeypatch):
    make_dist(fake_site, "fake-a", {STAT_LOGGER_PLUGINS_GROUP: {"p_ok": "fakeplug_a:first",
                                                                "p_nc": "fakeplug_a:NOT_CALLABLE",
                                                                "p_b": "fakeplug_missing:x"},
                                    ENDPOINT_PLUGINS_GROUP: {"p_routes": "fakeplug_a:second"},
                                    GROUP: {"p_broken": "fakeplug_missing:y"}},
              {"fakeplug_a": MODULE})
    monkeypatch.setenv("LOOM_PLUGINS", "p_ok,p_nc,p_b,p_routes,p_broken")
    expected = ("stat-logger plugin 'p_nc' (fakeplug_a:NOT_CALLABLE, from fake-a) failed to load: entry "
                "point value 'fakeplug_a:NOT_CALLABLE' is a int, not a callable. Fix or uninstall it, or leave "
                "it out with LOOM_PLUGINS.")
    with pytest.raises(PluginError) as excinfo:
        load_plugins_strict(STAT_LOGGER_PLUGINS_GROUP, kind="stat-logger")
    assert str(excinfo.value) == expected
    with pytest.raises(PluginError) as again:  # cached: a later call raises the same way
        load_plugins_strict(STAT_LOGGER_PLUGINS_GROUP, kind="stat-logger")
    assert str(again.value) == expected
    assert list(load_plugins_by_group(STAT_LOGGER_PLUGINS_GROUP)) == ["p_ok"]  # the lenient call
    # a failed plugin of another group does not matter; a group without one gives the lenient call's dict
    routes = load_plugins_strict(ENDPOINT_PLUGINS_GROUP, kind="endpoint")
    assert list(routes) == ["p_routes"] and routes is load_plugins_by_group(ENDPOINT_PLUGINS_GROUP)
    with pytest.raises(PluginError) as general:
        load_plugins_strict(GROUP, kind="general")
    assert str(general.value) == (
        "general plugin 'p_broken' (fakeplug_missing:y, from fake-a) failed to load: ModuleNotFoundError: No "
        "module named 'fakeplug_missing'. Fix or uninstall it, or leave it out with LOOM_PLUGINS."
    )


# ---- the contract range each distribution asks for ------------------------------------------
IMPORT_MARKER = """
import sys
sys.modules[__name__].imported = True
def run():
    pass
"""


def test_plugin_whose_range_excludes_the_contract_is_refused_before_import(fake_site, monkeypatch, caplog):
    installed = installed_contract_version()
    make_dist(fake_site, "fake-old", {GROUP: {"p_old": "fakeplug_old:run"}}, {"fakeplug_old": IMPORT_MARKER},
              requires=[f"loom-plugin-api>{installed}", "torch>=2"], version="0.3")
    monkeypatch.setenv("LOOM_PLUGINS", "p_old")
    with caplog.at_level(logging.ERROR, logger="loom.plugins"):
        assert load_plugins_by_group(GROUP) == {}
    import sys

    assert "fakeplug_old" not in sys.modules  # refused before its code ran
    record = next(r for r in plugin_records(GROUP) if r.name == "p_old")
    assert (record.status, record.contract_range, record.compatible) == ("failed", f">{installed}", False)
    assert record.error == (
        f"plugin 'p_old' of group {GROUP} (fake-old 0.3) requires loom-plugin-api>{installed}, but "
        f'loom-plugin-api {installed} is installed: pip install "loom-plugin-api>{installed}", or upgrade '
        f"fake-old to a release built for loom-plugin-api {installed}"
    )
    assert record.error in caplog.text
    with pytest.raises(PluginError) as excinfo:  # a general plugin that cannot load stops start-up
        load_general_plugins()
    assert record.error in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_plugin_whose_range_includes_the_contract_loads(fake_site, monkeypatch):
    make_dist(fake_site, "fake-new", {GROUP: {"p_new": "fakeplug_new:run"}}, {"fakeplug_new": IMPORT_MARKER},
              requires=["loom-plugin-api >=1, <2", "Loom_Plugin.API!=1.0.5 ; python_version >= '3'"])
    monkeypatch.setenv("LOOM_PLUGINS", "p_new")
    assert list(load_plugins_by_group(GROUP)) == ["p_new"]
    record = next(r for r in plugin_records(GROUP) if r.name == "p_new")
    assert (record.status, record.contract_range, record.compatible) == ("loaded", "!=1.0.5,<2,>=1", True)


def test_plugin_without_a_declared_range_loads_with_a_warning(fake_site, monkeypatch, caplog):
    # A requirement of an extra is not the plugin's: it declares no range.
    make_dist(fake_site, "fake-free", {GROUP: {"p_free": "fakeplug_free:run"}}, {"fakeplug_free": IMPORT_MARKER},
              requires=['loom-plugin-api<1; extra == "docs"'])
    monkeypatch.setenv("LOOM_PLUGINS", "p_free")
    with caplog.at_level(logging.WARNING, logger="loom.plugins"):
        assert list(load_plugins_by_group(GROUP)) == ["p_free"]
    record = next(r for r in plugin_records(GROUP) if r.name == "p_free")
    assert (record.status, record.contract_range, record.compatible) == ("loaded", None, None)
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert "'p_free'" in message and GROUP in message and "fake-free 0.1" in message
    assert "does not declare which loom-plugin-api" in message and "loading it anyway" in message


def test_loom_plugins_is_read_through_the_installed_reader(fake_site, monkeypatch):
    make_dist(fake_site, "fake-a", {GROUP: {"p_first": "fakeplug_a:first", "p_second": "fakeplug_a:second"}},
              {"fakeplug_a": MODULE})
    monkeypatch.setenv("LOOM_PLUGINS", "p_first")
    set_loom_plugins_reader(lambda: "p_second")  # the fixture puts the environ reader back
    assert list(load_plugins_by_group(GROUP)) == ["p_second"]
