"""A plugin is checked against the contract when it loads, before anything is spawned: a platform
with a wrong hook or a wrong class name stops ``loom serve`` with one line, and ``loom plugins``
shows each plugin's contract range, resolving the platform before the general plugins run.

Each subprocess selects its plugins with LOOM_PLUGINS, so the tests run the same in the cpu and
dummy sessions. Every detector call is appended to a file with its pid: every loom process runs
the detectors, so one pid there means that nothing was spawned.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_dist import write_fake_dist
from loom_plugin_api.validation import installed_contract_version, validate_platform_cls
from serve_utils import free_port

PLATFORMS = """
import os
from loom_plugin_api import HostPlatform

def note(event):
    with open(os.environ["FAKE_EVENTS"], "a") as f:
        f.write(f"{event} {os.getpid()}\\n")

class Base(HostPlatform):
    device_name = "fakeplat"

    @classmethod
    def check_and_update_config(cls, config):
        if config.parallel_config.worker_cls == "auto":
            config.parallel_config.worker_cls = "loom_plugin_api.cpu_worker.CPUWorker"

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        return "loom.attention.backends.torch_sdpa.TorchSDPABackend"

class BadSignature(Base):
    @classmethod
    def check_and_update_config(cls, config, device):
        super().check_and_update_config(config)

class BadWorker(Base):
    @classmethod
    def check_and_update_config(cls, config):
        config.parallel_config.worker_cls = "collections.OrderedDict"

def bad_signature():
    note("detector")
    return "fakeplat.BadSignature"

def bad_worker():
    note("detector")
    return "fakeplat.BadWorker"

def general():
    note("general")
"""

GROUPS = {
    "loom.platform_plugins": {"bad_signature": "fakeplat:bad_signature", "bad_worker": "fakeplat:bad_worker"},
    "loom.general_plugins": {"fake_general": "fakeplat:general"},
}
PLUGIN = "'{name}' (fake-plat 0.1)"


@pytest.fixture
def fake_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    write_fake_dist(site, "fake-plat", GROUPS, "fakeplat", PLATFORMS)
    return site


def loom(args: list[str], site: Path, plugins: str, *more_sites: Path) -> tuple[subprocess.CompletedProcess[str],
                                                                                 list[str]]:
    events = site / "events.txt"
    env = {k: v for k, v in os.environ.items() if k != "LOOM_PLATFORM"}
    path = [str(p) for p in (site, *more_sites)] + [env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(filter(None, path)), LOOM_PLUGINS=plugins, FAKE_EVENTS=str(events))
    proc = subprocess.run([sys.executable, "-m", "loom.entrypoints.cli.main", *args], capture_output=True,
                          text=True, env=env, timeout=240)
    return proc, events.read_text().splitlines() if events.exists() else []


def serve(model: Path, site: Path, plugins: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    return loom(["serve", str(model), "--max-model-len", "128", "--port", str(free_port()),
                 "--startup-timeout", "120"], site, plugins)


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "loom-supervisor" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("loom: error: ")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr[-3000:]
    return errors[0].removeprefix("loom: error: ")


def test_a_hook_with_the_wrong_signature_stops_serve_before_anything_spawns(tiny_llama, fake_site):
    proc, events = serve(tiny_llama, fake_site, "bad_signature")
    assert one_error_line(proc) == (
        f"platform plugin {PLUGIN.format(name='bad_signature')}: BadSignature.check_and_update_config(config, "
        "device) does not accept the specification's Platform.check_and_update_config(config): it requires "
        "'device', which the engine never passes"
    )
    assert len({line.split()[1] for line in events}) == 1, events  # the CLI process only


def test_a_worker_cls_of_the_wrong_base_stops_serve_before_anything_spawns(tiny_llama, fake_site):
    proc, events = serve(tiny_llama, fake_site, "bad_worker")
    assert one_error_line(proc) == (
        f"platform plugin {PLUGIN.format(name='bad_worker')}: BadWorker.check_and_update_config(config) "
        "(parallel_config.worker_cls) must name a subclass of loom_plugin_api.WorkerBase, found "
        "'collections.OrderedDict' (OrderedDict, based on builtins.dict)"
    )
    assert len({line.split()[1] for line in events}) == 1, events


def test_loom_plugins_resolves_the_platform_first_and_shows_contract_ranges(fake_site, tmp_path):
    excluded = f">{installed_contract_version()}"
    old = tmp_path / "old"
    write_fake_dist(old, "fake-old", {"loom.stat_logger_plugins": {"old_logger": "fakeold:run"}}, "fakeold",
                    "def run():\n    pass\n")
    metadata = next(old.glob("*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text() + f"Requires-Dist: loom-plugin-api{excluded}\n")
    proc, events = loom(["plugins"], fake_site, "bad_signature,fake_general,old_logger", old)
    out = proc.stdout
    assert proc.returncode == 1, proc.stderr[-3000:]
    kinds = [line.split()[0] for line in events]
    assert kinds[-1] == "general" and set(kinds[:-1]) == {"detector"}, kinds  # the order of `loom serve`
    assert f"installed contract: loom-plugin-api {installed_contract_version()}" in out
    assert "bad_signature = fakeplat:bad_signature  [fake-plat 0.1; loom-plugin-api range not declared]  " \
           "loaded" in out
    assert "fake_general = fakeplat:general  [fake-plat 0.1; loom-plugin-api range not declared]  loaded (ran in" \
        in out
    assert (f"old_logger = fakeold:run  [fake-old 0.1; loom-plugin-api{excluded}: INCOMPATIBLE with "
            f"{installed_contract_version()}]  failed: plugin 'old_logger' of group loom.stat_logger_plugins "
            f"(fake-old 0.1) requires loom-plugin-api{excluded}") in out
    assert "platform: FAILED: platform plugin 'bad_signature' (fake-plat 0.1): BadSignature." in out


def test_loom_plugins_says_where_a_good_platform_comes_from(fake_site):
    proc, _ = loom(["plugins"], fake_site, "bad_worker")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "platform: fakeplat.BadWorker (device_name=fakeplat, device_type=cpu; from 'bad_worker' " \
           "(fake-plat 0.1))" in proc.stdout


def test_the_installed_platforms_pass_with_no_warning(expected_platform):
    from loom.platforms.cpu import CpuPlatform

    assert validate_platform_cls(CpuPlatform, "'cpu'") == []
    if expected_platform == "dummy":
        from loom_plugin_api._qualname import resolve_obj_by_qualname

        dummy = resolve_obj_by_qualname("loom_platform_dummy.dummy_platform.DummyPlatform")
        assert validate_platform_cls(dummy, "'dummy_platform_plugin'") == []


def test_loom_plugins_goes_through_the_environment_cache(monkeypatch):
    from loom import envs
    from loom_plugin_api.loader import allowed_plugin_names

    monkeypatch.setenv("LOOM_PLUGINS", "first")
    envs.enable_envs_cache()
    try:
        monkeypatch.setenv("LOOM_PLUGINS", "second")
        assert allowed_plugin_names() == {"first"}  # frozen with every LOOM_* variable
    finally:
        envs._disable_envs_cache_for_tests()
    assert allowed_plugin_names() == {"second"}
