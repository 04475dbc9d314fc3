from __future__ import annotations

import logging

import pytest
from loom_plugin_api import PluginError, load_general_plugins, load_plugins_by_group, plugin_records
from loom_plugin_api.loader import general_plugins_loaded
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
