"""The public surface of loom-plugin-api, and the check that it changes only with a version bump.

``python scripts/api_surface.py --write`` records the surface in ``packages/plugin-api/api-surface.json``:
every public name of ``loom_plugin_api`` and of its public submodules (``__all__`` where a module has
one, else the names without a leading underscore that the module defines), the public members of each
class (special methods such as ``__init__`` included), each function's full signature, and the
package version. griffe reads the source; nothing is imported.

``python scripts/api_surface.py --check`` (run by ``nox -s lint``) compares the source with that
snapshot and fails when the surface changed and the version does not cover it: a breaking change
(a name removed, a parameter removed, renamed, moved, made required or given another default, a new
required parameter, as ``griffe.find_breaking_changes`` classifies them; a base class dropped) needs
a MAJOR bump, any other change a MINOR one.
The bump is counted from the snapshot's version, or, while the CHANGELOG marks that version
unreleased, from the last released version before it. When the version covers the change, the check
still fails until the snapshot is rewritten (``--write``, which refuses a change the version does not
cover). The CHANGELOG must have a section for the current version.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import griffe
import tomllib
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROJECT = ROOT / "packages" / "plugin-api"
SNAPSHOT = "api-surface.json"
CHANGELOG = "CHANGELOG.md"
WRITE_COMMAND = "python scripts/api_surface.py --write"
# "## [1.1.0] - 2026-12-01", "## 1.1.0 (unreleased)", "## [v2.0.0]"
_SECTION = re.compile(r"^##\s+\[?v?(?P<version>\d+(?:\.\d+)*\S*?)\]?(?:\s+(?P<rest>.*))?$")


@dataclass(frozen=True, slots=True)
class Project:
    """A distribution laid out as packages/plugin-api is: pyproject.toml, src/<module>/, CHANGELOG.md."""

    root: Path

    @property
    def pyproject(self) -> dict:
        return tomllib.loads((self.root / "pyproject.toml").read_text())["project"]

    @property
    def distribution(self) -> str:
        return self.pyproject["name"]

    @property
    def module(self) -> str:
        return self.distribution.replace("-", "_")

    @property
    def version(self) -> str:
        return self.pyproject["version"]

    def path(self, name: str) -> str:
        """``name`` relative to the repository when it lies inside it (for messages)."""
        full = self.root / name
        return str(full.relative_to(ROOT)) if full.is_relative_to(ROOT) else str(full)


# -- reading the surface -------------------------------------------------------------------------


def _text(expr: object) -> str | None:
    return None if expr is None else str(expr)


def _describe(obj: griffe.Object) -> dict:
    if obj.is_class:
        members = {name: _describe(m) for name, m in sorted(obj.members.items()) if _public_member(m)}
        return {"kind": "class", "bases": [str(b) for b in obj.bases], "members": members}
    if obj.is_function:
        params = [{"name": p.name, "kind": p.kind.value, "default": _text(p.default),
                   "annotation": _text(p.annotation)} for p in obj.parameters]
        return {"kind": "function", "labels": sorted(obj.labels), "parameters": params,
                "returns": _text(obj.returns)}
    if obj.is_attribute:
        return {"kind": "attribute", "labels": sorted(obj.labels), "annotation": _text(obj.annotation),
                "value": _text(obj.value)}
    return {"kind": obj.kind.value}


def _public_member(member: griffe.Object | griffe.Alias) -> bool:
    # griffe counts special names public; special attributes (__slots__, __match_args__) are not API.
    if member.is_alias or not member.is_public:
        return False
    return not (member.is_special and member.is_attribute)


def read_surface(project: Project) -> dict:
    """The public surface of ``project``'s module, read statically from its src/ folder."""
    logging.getLogger("griffe").setLevel(logging.ERROR)
    package = griffe.load(project.module, search_paths=[project.root / "src"], try_relative_path=False,
                          allow_inspection=False, docstring_parser=None, resolve_aliases=True,
                          resolve_external=False)
    modules: list[griffe.Module] = []
    pending = [package]
    while pending:
        module = pending.pop()
        modules.append(module)
        # test_* modules (the conformance kit's checks) are tests that pytest collects, not API
        pending.extend(m for m in module.modules.values()
                       if not m.is_alias and m.is_public and not m.name.startswith("test_"))
    listed = {m.path for m in modules}
    surface: dict[str, dict] = {}
    for module in sorted(modules, key=lambda m: m.path):
        names = {}
        for name, member in sorted(module.members.items()):
            if not member.is_public or (not member.is_alias and member.is_module):
                continue  # submodules are listed under their own path
            names[name] = _describe_exported(member, listed)
        surface[module.path] = names
    return {"distribution": project.distribution, "version": project.version, "modules": surface}


def _describe_exported(member: griffe.Object | griffe.Alias, listed: set[str]) -> dict:
    """A re-export of a name described in another public module is recorded as that name."""
    if not member.is_alias:
        return _describe(member)
    try:
        target = member.final_target
    except griffe.AliasResolutionError:
        return {"kind": "alias", "target": member.target_path}  # an external object (torch, typing)
    if target.parent is not None and target.parent.path in listed and target.is_public:
        return {"kind": "alias", "target": target.path}
    return _describe(target)


# -- comparing two surfaces ----------------------------------------------------------------------


def _flatten(surface: dict) -> dict[str, dict]:
    flat: dict[str, dict] = {}

    def walk(path: str, entry: dict) -> None:
        flat[path] = {k: v for k, v in entry.items() if k != "members"}
        for name, member in entry.get("members", {}).items():
            walk(f"{path}.{name}", member)

    for module, names in surface["modules"].items():
        flat[module] = {"kind": "module"}
        for name, entry in names.items():
            walk(f"{module}.{name}", entry)
    return flat


def _build(name: str, entry: dict) -> griffe.Object:
    """A griffe object for ``entry``, so that griffe's own rules classify the change."""
    if entry["kind"] == "alias":  # its target is compared where it is described (or is external)
        return griffe.Attribute(name, value=entry["target"])
    if entry["kind"] == "class":
        cls = griffe.Class(name)
        for member_name, member in entry["members"].items():
            cls.set_member(member_name, _build(member_name, member))
        return cls
    if entry["kind"] == "function":
        params = griffe.Parameters(*(
            griffe.Parameter(p["name"], kind=griffe.ParameterKind(p["kind"]), default=p["default"],
                             annotation=p["annotation"]) for p in entry["parameters"]))
        return griffe.Function(name, parameters=params, returns=entry["returns"])
    return griffe.Attribute(name, value=entry.get("value"), annotation=entry.get("annotation"))


def _tree(surface: dict) -> griffe.Module:
    modules: dict[str, griffe.Module] = {}
    for path in sorted(surface["modules"], key=lambda p: p.count(".")):
        parent, _, name = path.rpartition(".")
        module = griffe.Module(name)
        if parent:
            modules[parent].set_member(name, module)
        modules[path] = module
        for member_name, entry in surface["modules"][path].items():
            module.set_member(member_name, _build(member_name, entry))
    return modules[min(modules, key=len)]


def _breakage_text(breakage: griffe.Breakage) -> str:
    values = (breakage.old_value, breakage.new_value)
    param = next((v.name for v in values if isinstance(v, griffe.Parameter)), None)
    what = f"{breakage.obj.path}({param})" if param else breakage.obj.path
    details = f" ({breakage.details})" if breakage.details else ""
    return f"{what}: {breakage.kind.value}{details}"


@dataclass(slots=True)
class Changes:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    breaking: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    @property
    def needed(self) -> str:
        return "major" if self.breaking or self.removed else "minor"

    def lines(self) -> list[str]:
        out = []
        for title, items in (("breaking", self.breaking), ("removed", self.removed),
                             ("added", self.added), ("changed", self.changed)):
            if items:
                out.append(f"  {title}:")
                out.extend(f"    {item}" for item in items)
        return out


def _render(entry: dict) -> str:
    """An entry as a reader would write it: a signature, ``name: type = value``, ``class(bases)``."""
    kind = entry["kind"]
    if kind == "function":
        parts, star_done = [], False
        params = entry["parameters"]
        for index, p in enumerate(params):
            text = p["name"] + (f": {p['annotation']}" if p["annotation"] else "")
            text += f" = {p['default']}" if p["default"] is not None else ""
            if p["kind"] == "variadic positional":
                text, star_done = "*" + text, True
            elif p["kind"] == "variadic keyword":
                text = "**" + text
            elif p["kind"] == "keyword-only" and not star_done:
                parts.append("*")
                star_done = True
            parts.append(text)
            following = params[index + 1]["kind"] if index + 1 < len(params) else None
            if p["kind"] == "positional-only" and following != "positional-only":
                parts.append("/")
        labels = "".join(f"@{label} " for label in entry["labels"])
        return f"{labels}({', '.join(parts)}) -> {entry['returns']}"
    if kind == "attribute":
        text = " = ".join(str(v) for v in (entry["annotation"], entry["value"]) if v is not None)
        return (text or "attribute") + (f" [{', '.join(entry['labels'])}]" if entry["labels"] else "")
    if kind == "class":
        return f"class({', '.join(entry['bases'])})"
    if kind == "alias":
        return f"alias of {entry['target']}"
    return kind


def _outermost(paths: set[str]) -> list[str]:
    """The paths whose parent is not among them: a new class, not each of its members too."""
    return sorted(p for p in paths if p.rpartition(".")[0] not in paths)


def compare(old: dict, new: dict) -> Changes:
    before, after = _flatten(old), _flatten(new)
    changes = Changes(added=_outermost(after.keys() - before.keys()), removed=_outermost(before.keys() - after.keys()))
    changes.changed = [f"{path}: {_render(before[path])} -> {_render(after[path])}"
                       for path in sorted(before.keys() & after.keys()) if before[path] != after[path]]
    changes.breaking = sorted({_breakage_text(b) for b in griffe.find_breaking_changes(_tree(old), _tree(new))})
    # griffe compares classes by their members only (the snapshot's bases are strings): a dropped
    # base class breaks a plugin's isinstance checks and inherited members too.
    for path in sorted(before.keys() & after.keys()):
        if before[path]["kind"] == after[path]["kind"] == "class":
            dropped = sorted(set(before[path]["bases"]) - set(after[path]["bases"]))
            if dropped:
                changes.breaking.append(f"{path}: base class removed ({', '.join(dropped)})")
    return changes


# -- versions and the CHANGELOG ------------------------------------------------------------------


def changelog_sections(project: Project) -> dict[str, bool]:
    """Version -> released (False when its heading says unreleased), from CHANGELOG.md."""
    path = project.root / CHANGELOG
    sections: dict[str, bool] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        match = _SECTION.match(line.strip())
        if match:
            sections[match["version"]] = "unreleased" not in (match["rest"] or "").lower()
    return sections


def _bump(base: Version | None, current: Version) -> str:
    if base is None:  # nothing released yet: nothing to stay compatible with
        return "major"
    for kind, index in (("major", 0), ("minor", 1), ("patch", 2)):
        b, c = (base.release + (0, 0, 0))[index], (current.release + (0, 0, 0))[index]
        if c != b:
            return kind if c > b else "downgrade"
    return "none"


def _baseline(snapshot_version: str, sections: dict[str, bool]) -> Version | None:
    """The version a change is counted from: the snapshot's, or the last release before it."""
    if sections.get(snapshot_version, True):
        return Version(snapshot_version)
    released = [Version(v) for v, done in sections.items() if done and Version(v) < Version(snapshot_version)]
    return max(released, default=None)


def _next(base: Version | None, needed: str) -> str:
    if base is None:
        return "any"
    major, minor = (base.release + (0, 0))[:2]
    return f"{major + 1}.0.0" if needed == "major" else f"{major}.{minor + 1}.0"


def uncovered(project: Project, snapshot: dict, changes: Changes) -> str | None:
    """Why the current version does not cover ``changes``, or None when it does."""
    base = _baseline(snapshot["version"], changelog_sections(project))
    bump = _bump(base, Version(project.version))
    if bump == "major" or (bump == "minor" and changes.needed == "minor"):
        return None
    return (f"these changes need a {changes.needed.upper()} version bump, but {project.distribution} is "
            f"{project.version} (counted from {base}): set version = \"{_next(base, changes.needed)}\" in "
            f"{project.path('pyproject.toml')}, then run `{WRITE_COMMAND}` and add the changes to "
            f"{project.path(CHANGELOG)}.")


# -- the two commands ----------------------------------------------------------------------------


def _load_snapshot(project: Project) -> dict | None:
    path = project.root / SNAPSHOT
    return json.loads(path.read_text()) if path.exists() else None


def check(project: Project) -> list[str]:
    """The problems with the current surface, version and CHANGELOG; empty when all is well."""
    problems = []
    if project.version not in changelog_sections(project):
        problems.append(f"{project.path(CHANGELOG)} has no section for {project.distribution} "
                        f"{project.version}: add '## [{project.version}] - unreleased' describing the changes.")
    snapshot = _load_snapshot(project)
    if snapshot is None:
        return [*problems, f"no API snapshot at {project.path(SNAPSHOT)}: run `{WRITE_COMMAND}`."]
    current = read_surface(project)
    changes = compare(snapshot, current)
    if not changes:
        if snapshot["version"] != project.version:
            problems.append(f"{project.path(SNAPSHOT)} records version {snapshot['version']}, the package is "
                            f"{project.version} (the surface is unchanged): run `{WRITE_COMMAND}`.")
        return problems
    header = (f"the public API of {project.distribution} changed since {project.path(SNAPSHOT)} "
              f"(version {snapshot['version']}):")
    reason = uncovered(project, snapshot, changes)
    if reason is None:
        reason = (f"version {project.version} covers these changes, but the snapshot was not rewritten: run "
                  f"`{WRITE_COMMAND}` and add a CHANGELOG entry for them under {project.version} in "
                  f"{project.path(CHANGELOG)}.")
    return [*problems, "\n".join([header, *changes.lines(), reason])]


def write(project: Project) -> list[str]:
    """Rewrite the snapshot; refused (with the reason) when the version does not cover the change."""
    snapshot, current = _load_snapshot(project), read_surface(project)
    if snapshot is not None:
        changes = compare(snapshot, current)
        reason = uncovered(project, snapshot, changes) if changes else None
        if reason is not None:
            return ["\n".join([f"not writing {project.path(SNAPSHOT)}: the public API changed:",
                               *changes.lines(), reason])]
    (project.root / SNAPSHOT).write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", action="store_true", help="fail when the API changed without a version bump")
    action.add_argument("--write", action="store_true", help=f"rewrite {SNAPSHOT} from the source")
    parser.add_argument("--project", type=Path, default=DEFAULT_PROJECT,
                        help="the distribution's folder (default: packages/plugin-api)")
    args = parser.parse_args(argv)
    project = Project(args.project.resolve())
    problems = check(project) if args.check else write(project)
    for problem in problems:
        print(f"api_surface: {problem}", file=sys.stderr)
    if not problems:
        print(f"api_surface: {project.distribution} {project.version}: "
              + ("surface matches the snapshot" if args.check else f"wrote {project.path(SNAPSHOT)}"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
