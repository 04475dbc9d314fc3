"""``loom plugins new``: the skeletons install, ``loom plugins`` finds them, and the platform skeleton
passes the conformance kit's static, config, ops and attention tiers as generated.

The platform skeleton is really built and installed (``uv pip install --no-deps
--no-build-isolation --target``: setuptools from this environment, nothing downloaded); the
model and general skeletons go on PYTHONPATH with a dist-info written from their pyproject.toml.
Every subprocess selects its plugins with LOOM_PLUGINS, so the test runs the same whatever other
platform is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import setuptools  # noqa: F401  (the skeletons' build backend: a missing one is an error, not a skip)
import tomllib
from loom.entrypoints.cli import plugins_new

LOOM_IMPORT = re.compile(r"^\s*(from|import)\s+loom(\.|\s|$)", re.MULTILINE)


def new(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="loom plugins")
    plugins_new.add_subcommand(parser)
    return plugins_new.run(parser.parse_args(["new", *argv]))


def env_with(path: list[Path], plugins: str) -> dict[str, str]:
    # LOOM_STRICT_SKIPS: the kit's skips are the platform's declared capabilities, not this repo's rule
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_PLATFORM", "PYTHONPATH", "LOOM_STRICT_SKIPS")}
    extra = [str(p) for p in path] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return {**env, "PYTHONPATH": os.pathsep.join(extra), "LOOM_PLUGINS": plugins,
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def run(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def loom_plugins(env: dict[str, str]) -> str:
    result = run([sys.executable, "-m", "loom.entrypoints.cli.main", "plugins"], env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def listed(out: str, entry_point: str, value: str, dist: str) -> str:
    """The line of ``loom plugins`` that lists an entry point, which must have loaded."""
    line = next((x for x in out.splitlines() if x.startswith(f"  {entry_point} = {value}  [{dist} 0.1.0")), None)
    assert line is not None, out
    assert line.endswith("loaded") or "  loaded (" in line, line
    assert "INCOMPATIBLE" not in line, line
    return line


def fake_install(project: Path, site: Path) -> Path:
    """A dist-info for ``project``'s pyproject (name, version, requirements, entry points) in ``site``."""
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    info = site / f"{meta['name'].replace('-', '_').replace('.', '_')}-{meta['version']}.dist-info"
    info.mkdir(parents=True)
    requires = "".join(f"Requires-Dist: {r}\n" for r in meta.get("dependencies", []))
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n"
                                   + requires)
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
        for group, eps in meta["entry-points"].items()))
    return site


@pytest.mark.parametrize(("name", "package", "prefix"), [
    ("loom-platform-acme", "loom_platform_acme", "LoomPlatformAcme"),
    ("Acme.NPU", "acme_npu", "AcmeNpu"),
    ("acme", "acme", "Acme"),
])
def test_names_of_a_plugin(name, package, prefix):
    names = plugins_new.plugin_names(name)
    assert (names.dist, names.package, names.prefix) == (name, package, prefix)


@pytest.mark.parametrize(("name", "why"), [
    ("", "not a valid distribution name"),
    ("-acme", "not a valid distribution name"),
    ("acme-", "not a valid distribution name"),
    ("acme npu", "not a valid distribution name"),
    ("acme/npu", "not a valid distribution name"),
    ("1acme", "not a Python identifier"),
    ("class", "not a Python identifier"),
])
def test_a_name_that_cannot_be_a_plugin_is_refused(tmp_path, name, why):
    with pytest.raises(ValueError, match=why):
        new("--kind", "general", "--dir", str(tmp_path), "--", name)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_folder_is_refused_and_left_alone(tmp_path):
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "mine.txt").write_text("keep")
    with pytest.raises(ValueError, match=r"acme already exists"):
        new("acme", "--kind", "platform", "--dir", str(tmp_path))
    assert [p.name for p in (tmp_path / "acme").iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("kind", list(plugins_new.KINDS))
def test_a_skeleton_depends_on_the_contract_only(tmp_path, kind):
    assert new("acme-plugin", "--kind", kind, "--dir", str(tmp_path)) == 0
    project = tmp_path / "acme-plugin"
    sources = list((project / "src" / "acme_plugin").glob("*.py"))
    assert sources and (project / "src" / "acme_plugin" / "py.typed").exists()
    for source in sources:
        text = source.read_text()
        assert "{{" not in text and not LOOM_IMPORT.search(text), source
        compile(text, str(source), "exec")
    deps = tomllib.loads((project / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "loom-plugin-api>=1.1,<2" in deps and not any(d.startswith("loom-engine") for d in deps)


def test_model_and_general_skeletons_are_found_and_register(tmp_path):
    new("acme-model", "--kind", "model", "--dir", str(tmp_path))
    new("acme-general", "--kind", "general", "--dir", str(tmp_path))
    site = fake_install(tmp_path / "acme-model", tmp_path / "site")
    fake_install(tmp_path / "acme-general", site)
    env = env_with([site, tmp_path / "acme-model" / "src", tmp_path / "acme-general" / "src"],
                   "acme_model,acme_general")
    out = loom_plugins(env)
    listed(out, "acme_model", "acme_model:register", "acme-model")
    listed(out, "acme_general", "acme_general:register", "acme-general")
    # the lazy registration resolves to a subclass of the in-tree Llama
    check = ("import loom\nfrom loom_plugin_api import ModelRegistry, load_general_plugins\nload_general_plugins()\n"
             "cls, _ = ModelRegistry.resolve_model_cls('AcmeModelForCausalLM')\n"
             "llama, _ = ModelRegistry.resolve_model_cls('LlamaForCausalLM')\n"
             "print(cls.__module__, issubclass(cls, llama))")
    result = run([sys.executable, "-c", check], env)
    assert result.stdout.split() == ["acme_model.model", "True"], result.stdout + result.stderr


def uv() -> str:
    path = shutil.which("uv")
    assert path is not None, "uv is needed to build and install packages"
    return path


def test_the_engine_wheel_ships_every_template(tmp_path):
    engine = Path(__file__).resolve().parents[1] / "packages" / "engine-core"  # the source, not the install
    shutil.copytree(engine, tmp_path / "engine", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    result = run([uv(), "build", "--offline", "--wheel", "--no-build-isolation", "--python", sys.executable,
                  "-o", str(tmp_path / "dist"), str(tmp_path / "engine")], os.environ.copy())
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".tmpl")}
    templates = engine / "src" / "loom" / "entrypoints" / "cli" / "templates"
    assert shipped == {f"loom/entrypoints/cli/templates/{p.relative_to(templates)}" for p in templates.rglob("*.tmpl")}


@pytest.fixture(scope="module")
def installed_platform(tmp_path_factory) -> Path:
    """The platform skeleton, generated and then built and installed into a site folder."""
    root = tmp_path_factory.mktemp("plugins_new")
    new("loom-platform-acme", "--kind", "platform", "--dir", str(root))
    site = root / "site"
    result = run([uv(), "pip", "install", "--offline", "--no-deps", "--no-build-isolation", "--python", sys.executable,
                  "--target", str(site), str(root / "loom-platform-acme")], os.environ.copy())
    assert result.returncode == 0, result.stdout + result.stderr
    return site


PLATFORM_PLUGINS = "loom_platform_acme,loom_platform_acme_ops"


def test_the_installed_platform_skeleton_is_detected_and_wins(installed_platform):
    out = loom_plugins(env_with([installed_platform], PLATFORM_PLUGINS))
    listed(out, "loom_platform_acme", "loom_platform_acme:detect", "loom-platform-acme")
    listed(out, "loom_platform_acme_ops", "loom_platform_acme:register_ops", "loom-platform-acme")
    assert "loom_platform_acme (out-of-tree): answered loom_platform_acme.platform.LoomPlatformAcmePlatform " \
           "[winner]" in out, out
    assert "platform: loom_platform_acme.platform.LoomPlatformAcmePlatform" in out, out


def test_the_installed_platform_skeleton_passes_the_kit(installed_platform, tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "report.json"
    result = run([sys.executable, "-m", "pytest", "--pyargs", "loom_plugin_api.testing", "-q", "-p", "no:cacheprovider",
                  "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), "--confcutdir", str(tmp_path),
                  "--loom-platform", "loom_platform_acme", "-m", "static or config or ops or attention",
                  "--loom-report", str(report)],
                 env_with([installed_platform], PLATFORM_PLUGINS), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    checks = json.loads(report.read_text())["checks"]
    passed = {(c["tier"], c["name"]) for c in checks if c["outcome"] == "pass"}
    assert {tier for tier, _ in passed} == {"static", "config", "ops", "attention"}
    # the replaced op was checked against forward_native, not skipped as absent
    assert ("ops", "test_replaced_class_matches_forward_native[rms_norm-float32]") in passed, sorted(passed)
