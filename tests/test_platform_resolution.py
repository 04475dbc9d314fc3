"""Platform resolution rules, each in a fresh interpreter with fake platform plugins (the same rules
in-process, with fake detectors: packages/engine-core/tests/test_platforms.py)."""

from __future__ import annotations

import importlib.metadata

import pytest
from fake_dist import run_python, write_fake_dist

GROUP = "loom.platform_plugins"
SOURCE = """
def answers():
    return "loom.platforms.cpu.CpuPlatform"
def not_a_platform():
    return "collections.OrderedDict"
def absent():
    return None
def raises():
    raise OSError("driver missing")
"""


@pytest.fixture(autouse=True)
def no_ambient_platform_choice(monkeypatch):
    """The fresh interpreters inherit this environment: unset unless a test sets them."""
    monkeypatch.delenv("LOOM_PLATFORM", raising=False)
    monkeypatch.delenv("LOOM_PLUGINS", raising=False)


RESOLVE = "from loom.platforms import current_platform; print('PLATFORM', type(current_platform).__name__)"


def test_two_out_of_tree_platforms_is_an_error(tmp_path):
    write_fake_dist(tmp_path, "fake-two", {GROUP: {"oot_one": "fakeplat:answers", "oot_two": "fakeplat:answers"}},
                    "fakeplat", SOURCE)
    proc = run_python(RESOLVE, tmp_path, env={"LOOM_PLATFORM": ""})
    assert proc.returncode != 0
    assert "Only one platform plugin can be activated" in proc.stderr
    assert "oot_one" in proc.stderr and "oot_two" in proc.stderr


def test_a_raising_out_of_tree_detector_stops_resolution_with_its_reason(tmp_path):
    """A vendor's detector that raises is a broken platform: no quiet fallback to the CPU."""
    write_fake_dist(tmp_path, "fake-bad", {GROUP: {"oot_raises": "fakeplat:raises", "oot_absent": "fakeplat:absent"}},
                    "fakeplat", SOURCE)
    proc = run_python(RESOLVE, tmp_path, env={"LOOM_PLUGINS": "oot_raises,oot_absent"})
    assert proc.returncode != 0 and "PLATFORM" not in proc.stdout
    assert ("out-of-tree platform plugin oot_raises raised: OSError: driver missing. Fix or uninstall it, leave it "
            "out with LOOM_PLUGINS, or choose a platform with LOOM_PLATFORM=<name>") in proc.stderr
    assert "oot_raises failed during detection: OSError: driver missing" in proc.stderr
    assert "Platform detector oot_absent: None" in proc.stderr
    # the user's own choice of platform still serves
    proc = run_python(RESOLVE, tmp_path, env={"LOOM_PLUGINS": "oot_raises,oot_absent", "LOOM_PLATFORM": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert "PLATFORM CpuPlatform" in proc.stdout


def test_loom_platform_forces_a_detector(tmp_path):
    write_fake_dist(tmp_path, "fake-one", {GROUP: {"oot_one": "fakeplat:answers"}}, "fakeplat", SOURCE)
    proc = run_python(RESOLVE, tmp_path, env={"LOOM_PLATFORM": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert "PLATFORM CpuPlatform" in proc.stdout
    assert "Platform plugin oot_one is activated" not in proc.stderr
    proc = run_python(RESOLVE, tmp_path, env={"LOOM_PLATFORM": "nosuch"})
    assert proc.returncode != 0 and "LOOM_PLATFORM='nosuch' is not installed" in proc.stderr


def test_loom_plugins_empty_loads_no_platform_plugin(tmp_path):
    write_fake_dist(tmp_path, "fake-two", {GROUP: {"oot_one": "fakeplat:answers", "oot_two": "fakeplat:answers"}},
                    "fakeplat", SOURCE)
    proc = run_python(RESOLVE, tmp_path, env={"LOOM_PLUGINS": ""})
    assert proc.returncode == 0, proc.stderr
    assert "PLATFORM CpuPlatform" in proc.stdout


def test_loom_plugins_command_shows_everything(tmp_path):
    write_fake_dist(tmp_path, "fake-bad", {GROUP: {"oot_raises": "fakeplat:raises"}}, "fakeplat", SOURCE)
    proc = run_python("from loom.entrypoints.cli.main import main; raise SystemExit(main(['plugins']))", tmp_path)
    assert proc.returncode == 1, proc.stderr  # every group and verdict is shown, and the failed resolution
    out = proc.stdout
    for text in ("LOOM_PLUGINS: unset", "[loom.platform_plugins]", "oot_raises = fakeplat:raises  [fake-bad 0.1; loom-plugin-api range not declared]",
                 "oot_raises (out-of-tree): raised: OSError: driver missing", "cpu (built-in): answered",
                 "[loom.general_plugins]", "[loom.stat_logger_plugins]", "[loom.endpoint_plugins]",
                 "platform: FAILED: out-of-tree platform plugin oot_raises raised: OSError: driver missing"):
        assert text in out, text


def test_collect_env_prints_versions_and_platform(expected_platform):
    proc = run_python("from loom.entrypoints.cli.main import main; raise SystemExit(main(['collect-env']))")
    assert proc.returncode == 0, proc.stderr
    contract = importlib.metadata.version("loom-plugin-api")
    for text in ("Python: 3.", "loom-engine: 0.1.0", f"loom-plugin-api: {contract}", "torch: 2.13.0", "Platform: ",
                 "detector cpu: answered loom.platforms.cpu.CpuPlatform"):
        assert text in proc.stdout, text
    platform = "DummyPlatform" if expected_platform == "dummy" else "CpuPlatform"
    assert f"Platform: {platform}" in proc.stdout


def test_detector_naming_a_non_platform_class(tmp_path):
    write_fake_dist(tmp_path, "fake-odd", {GROUP: {"oot_odd": "fakeplat:not_a_platform"}}, "fakeplat", SOURCE)
    proc = run_python("from loom.entrypoints.cli.main import main; raise SystemExit(main(['generate', 'hi']))",
                      tmp_path, env={"LOOM_PLUGINS": "oot_odd"})
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("loom: error: platform plugin oot_odd named 'collections.OrderedDict'")
    assert "not a loom_plugin_api.Platform subclass" in last
    assert proc.stderr.count("Platform detector oot_odd:") == 1  # resolution ran once


def test_out_of_tree_platform_wins_over_an_answering_cuda_detector(tmp_path):
    """On a GPU host with loom-platform-cuda, an installed out-of-tree platform still wins."""
    write_fake_dist(tmp_path, "fake-oot", {GROUP: {"oot_one": "fakeplat:answers"}}, "fakeplat", SOURCE)
    code = ("import loom.platforms as p\n"
            "p.builtin_platform_plugins['cuda'] = lambda: 'loom.platforms.cpu.CpuPlatform'  # a GPU 'is there'\n"
            "p.current_platform\n"
            "print('ANSWERED', sorted(v.name for v in p.detector_verdicts() if v.answer))\n"
            "print('WON', [v.name for v in p.detector_verdicts() if v.won])")
    proc = run_python(code, tmp_path, env={"LOOM_PLUGINS": "oot_one"})
    assert proc.returncode == 0, proc.stderr
    assert "ANSWERED ['cpu', 'cuda', 'oot_one']" in proc.stdout
    assert "WON ['oot_one']" in proc.stdout
