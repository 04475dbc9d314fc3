"""scripts/api_surface.py: the lint check that the plugin contract's public surface changes only
with the semantic-version bump it needs, and with a CHANGELOG section for the version.

Each test builds a small package (``toy-api``, module ``toy_api``) laid out as packages/plugin-api
is, records its snapshot, edits the source, version or CHANGELOG, and runs the checker on it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("api_surface", ROOT / "scripts" / "api_surface.py")
api_surface = importlib.util.module_from_spec(_spec)
sys.modules["api_surface"] = api_surface
_spec.loader.exec_module(api_surface)

INIT = '''
from .hooks import Platform, register
from .hooks import helper_not_exported

__all__ = ["Platform", "register"]
'''
HOOKS = '''
class Platform:
    device_name: str = "toy"

    def check_and_update_config(self, config: dict, block_size: int, *, strict: bool = False) -> None:
        """A hook."""


def register(name: str, priority: int = 0) -> str | None:
    return name


def helper_not_exported() -> None:
    pass


def _private() -> None:
    pass
'''
RELEASED = "# Changelog\n\n## [1.0.0] - 2026-11-29\n\nThe first contract.\n"


def _write_toy(root: Path, *, version: str, changelog: str, hooks: str = HOOKS) -> api_surface.Project:
    (root / "src" / "toy_api").mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(f'[project]\nname = "toy-api"\nversion = "{version}"\n')
    (root / "CHANGELOG.md").write_text(changelog)
    (root / "src" / "toy_api" / "__init__.py").write_text(INIT)
    (root / "src" / "toy_api" / "hooks.py").write_text(hooks)
    return api_surface.Project(root)


@pytest.fixture
def toy(tmp_path) -> api_surface.Project:
    """toy-api 1.0.0, released, with its snapshot written."""
    project = _write_toy(tmp_path / "toy", version="1.0.0", changelog=RELEASED)
    assert api_surface.write(project) == []
    return project


def _release(project, version: str, hooks: str = HOOKS, unreleased: bool = False) -> None:
    heading = f"## [{version}] - {'unreleased' if unreleased else '2026-12-01'}\n\n"
    _write_toy(project.root, version=version, hooks=hooks, changelog=RELEASED.replace("## [1.0.0]", heading + "## [1.0.0]"))


def _only_problem(project) -> str:
    problems = api_surface.check(project)
    assert len(problems) == 1, problems
    return problems[0]


def test_the_snapshot_lists_public_names_with_signatures(toy):
    surface = api_surface.read_surface(toy)
    assert surface["version"] == "1.0.0"
    assert set(surface["modules"]) == {"toy_api", "toy_api.hooks"}
    assert set(surface["modules"]["toy_api"]) == {"Platform", "register"}  # __all__, not every import
    assert surface["modules"]["toy_api"]["register"] == {"kind": "alias", "target": "toy_api.hooks.register"}
    hooks = surface["modules"]["toy_api.hooks"]
    assert set(hooks) == {"Platform", "register", "helper_not_exported"}  # no __all__: no underscore
    assert hooks["register"]["parameters"][1] == {
        "name": "priority", "kind": "positional or keyword", "default": "0", "annotation": "int"}
    assert hooks["register"]["returns"] == "str | None"
    hook = hooks["Platform"]["members"]["check_and_update_config"]
    assert [(p["name"], p["kind"]) for p in hook["parameters"]] == [
        ("self", "positional or keyword"), ("config", "positional or keyword"),
        ("block_size", "positional or keyword"), ("strict", "keyword-only")]


def test_an_unchanged_surface_passes_and_private_edits_do_not_count(toy):
    assert api_surface.check(toy) == []
    _write_toy(toy.root, version="1.0.0", changelog=RELEASED,
               hooks=HOOKS + "\n\ndef _another_private(x, y):\n    pass\n")
    assert api_surface.check(toy) == []


def test_a_change_without_a_version_bump_fails_and_lists_it(toy):
    _write_toy(toy.root, version="1.0.0", changelog=RELEASED,
               hooks=HOOKS + "\n\ndef unregister(name: str) -> None:\n    pass\n")
    problem = _only_problem(toy)
    assert "toy_api.hooks.unregister" in problem
    assert "need a MINOR version bump" in problem and 'set version = "1.1.0"' in problem


BREAKING = {
    "removed name": (HOOKS.replace("def register(", "def register_platform("), "toy_api.hooks.register"),
    "removed parameter": (HOOKS.replace(", priority: int = 0", ""), "toy_api.hooks.register(priority)"),
    "new required parameter": (HOOKS.replace("priority: int = 0", "priority: int = 0, *, dtype: str"),
                               "toy_api.hooks.register(dtype)"),
    "renamed parameter": (HOOKS.replace("block_size: int", "size: int"),
                          "toy_api.hooks.Platform.check_and_update_config(block_size)"),
    "reordered positionals": (HOOKS.replace("config: dict, block_size: int", "block_size: int, config: dict"),
                              "toy_api.hooks.Platform.check_and_update_config(config)"),
}


@pytest.mark.parametrize("edit", BREAKING, ids=list(BREAKING))
def test_a_breaking_change_with_a_minor_bump_fails(toy, edit):
    hooks, culprit = BREAKING[edit]
    _release(toy, "1.1.0", hooks)
    problem = _only_problem(toy)
    assert "need a MAJOR version bump" in problem and 'set version = "2.0.0"' in problem
    assert culprit in problem
    _release(toy, "2.0.0", hooks)  # the right bump: only the snapshot is left to rewrite
    assert "covers these changes" in _only_problem(toy)


def test_an_addition_with_a_minor_bump_passes_once_the_snapshot_is_rewritten(toy):
    added = HOOKS + "\n\ndef unregister(name: str) -> None:\n    pass\n"
    _release(toy, "1.1.0", added)
    problem = _only_problem(toy)
    assert "version 1.1.0 covers these changes" in problem
    assert "python scripts/api_surface.py --write" in problem and "CHANGELOG" in problem
    assert api_surface.write(toy) == []
    assert api_surface.check(toy) == []


def test_a_missing_changelog_section_fails(toy):
    _write_toy(toy.root, version="1.0.0", changelog="# Changelog\n\n## [0.9.0] - 2026-11-01\n")
    assert "CHANGELOG.md has no section for toy-api 1.0.0" in _only_problem(toy)


def test_write_refuses_a_change_the_version_does_not_cover(toy):
    snapshot = (toy.root / "api-surface.json").read_text()
    _write_toy(toy.root, version="1.0.0", changelog=RELEASED, hooks=BREAKING["removed name"][0])
    (problem,) = api_surface.write(toy)
    assert "not writing" in problem and "need a MAJOR version bump" in problem
    assert (toy.root / "api-surface.json").read_text() == snapshot


def test_an_unreleased_version_accumulates_changes_counted_from_the_last_release(toy):
    first = HOOKS + "\n\ndef unregister(name: str) -> None:\n    pass\n"
    _release(toy, "1.1.0", first, unreleased=True)
    assert api_surface.write(toy) == []
    _release(toy, "1.1.0", first + "\n\ndef describe() -> str:\n    return ''\n", unreleased=True)
    assert "version 1.1.0 covers these changes" in _only_problem(toy)
    _release(toy, "1.1.0", BREAKING["removed name"][0], unreleased=True)
    problem = _only_problem(toy)
    assert "need a MAJOR version bump" in problem and "(counted from 1.0.0)" in problem


def test_the_real_contract_is_read_without_importing_it():
    surface = api_surface.read_surface(api_surface.Project(api_surface.DEFAULT_PROJECT))
    assert surface["distribution"] == "loom-plugin-api"
    platform = surface["modules"]["loom_plugin_api.platform"]["Platform"]
    assert "check_and_update_config" in platform["members"]
