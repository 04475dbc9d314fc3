"""Mutation testing of loom's core with mutmut: every module, one table, non-zero below 90%.

    python scripts/mutation.py                   # every module
    python scripts/mutation.py plugin-api        # one package's modules (engine-core, plugin-api)
    python scripts/mutation.py loom.layers.sampler  # one module

For each package the script builds ``build/mutation/<package>/`` (git-ignored): a fresh copy
of the package's ``src/`` and a ``setup.cfg`` naming the modules to mutate and the fast tests
that exercise them (run from the repo, by absolute path). mutmut copies ``src/`` to
``mutants/src``, puts it first on ``sys.path`` (ahead of the editable install), learns which
tests call which function, and runs those tests once per mutant in a forked child.

Not mutated, by configuration: logging calls (``do_not_mutate_patterns``): their only effect
is the text of a log message. Surviving mutants that are equivalent to the original (no test
can tell them apart) are listed in ``tests/mutation/equivalent.toml``, keyed by module,
function and the mutated line's text, each with its reason; they are left out of the score
and reported. A mutant counts as killed when a test failed, timed out or crashed; one that no
test reaches ("no tests") counts as a survivor.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "mutation"
EQUIVALENT = ROOT / "tests" / "mutation" / "equivalent.toml"
THRESHOLD = 90.0

# package -> (module -> source path under the package), and the fast tests of those modules, by
# folder: mutmut runs pytest with --rootdir=mutants, so the tests are copied in next to the code.
PACKAGES: dict[str, tuple[dict[str, str], dict[str, list[str]]]] = {
    "engine-core": (
        {
            "loom.engine.scheduler": "src/loom/engine/scheduler.py",
            "loom.engine.block_manager": "src/loom/engine/block_manager.py",
            "loom.layers.sampler": "src/loom/layers/sampler.py",
            "loom.platforms": "src/loom/platforms/__init__.py",
        },
        {"packages/engine-core/tests": ["test_scheduler.py", "test_block_manager.py", "test_sampler.py",
                                        "test_platforms.py", "test_cuda_detector.py"]},
    ),
    "plugin-api": (
        {
            "loom_plugin_api.custom_op": "src/loom_plugin_api/custom_op.py",
            "loom_plugin_api.loader": "src/loom_plugin_api/loader.py",
        },
        {"packages/plugin-api/tests": ["test_custom_op.py", "test_loader.py"],
         "tests": ["test_custom_op_switches.py"]},
    ),
}

KILLED = {1, 3, 36, 37, 24, -24, 152, 255, -11, -9}  # failed, pytest error, timeout, type check, crash
SURVIVED = {0, 5, 33, 35}  # passed, no tests, suspicious
LOG_CALL = r"^\s*(logger|log)\.(debug|info|warning|error|exception|critical)\("


@dataclass
class Row:
    module: str
    killed: int = 0
    survived: list[str] = field(default_factory=list)
    equivalent: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.killed + len(self.survived) + len(self.equivalent)

    @property
    def score(self) -> float:
        scored = self.killed + len(self.survived)
        return 100.0 * self.killed / scored if scored else 100.0


def _setup_cfg(modules: dict[str, str], tests: list[str]) -> str:
    def lines(values) -> str:
        return "".join(f"\n    {v}" for v in values)

    return ("[mutmut]\nsource_paths = src\n"
            f"only_mutate ={lines(modules.values())}\n"
            f"do_not_mutate_patterns ={lines([LOG_CALL])}\n"
            "pytest_add_cli_args =\n    -p\n    no:cacheprovider\n"  # mutmut adds -x -q -p no:randomly
            f"pytest_add_cli_args_test_selection ={lines(tests)}\n")


def _copy_tests(folders: dict[str, list[str]], work: Path) -> list[str]:
    """Each folder's chosen tests, with its conftest and helper modules, into work/tests/<n>/."""
    selection = []
    for n, (folder, names) in enumerate(folders.items()):
        target = work / "tests" / str(n)
        target.mkdir(parents=True)
        for path in (ROOT / folder).glob("*.py"):
            if not path.name.startswith("test_") or path.name in names:
                shutil.copy2(path, target / path.name)
        selection += [f"tests/{n}/{name}" for name in names]
    return selection


def _run_package(package: str, modules: dict[str, str], env: dict[str, str]) -> Path:
    work = WORK / package
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copytree(ROOT / "packages" / package / "src", work / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    tests = _copy_tests(PACKAGES[package][1], work)
    (work / "setup.cfg").write_text(_setup_cfg(modules, tests))
    mutmut = Path(sys.executable).with_name("mutmut")
    cmd = [str(mutmut) if mutmut.exists() else "mutmut", "run", "--max-children", str(os.cpu_count() or 2)]
    print(f"== {package}: {' '.join(cmd)} in {work.relative_to(ROOT)}", flush=True)
    proc = subprocess.run(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (work / "mutmut-run.log").write_text(proc.stdout)
    if proc.returncode != 0:
        print(proc.stdout[-4000:])
        raise SystemExit(f"mutmut failed for {package} (exit {proc.returncode}); log: {work / 'mutmut-run.log'}")
    return work


def _function(module: str, name: str) -> str:
    """'loom.x.xǁClassǁmethod__mutmut_3' -> 'Class.method'; 'loom.x.x_func__mutmut_3' -> 'func'."""
    local = re.sub(r"__mutmut_\d+$", "", name[len(module) + 1:])
    return local[1:].strip("ǁ").replace("ǁ", ".") if local.startswith("xǁ") else local[2:]


def _mutated_line(work: Path, name: str, env: dict[str, str]) -> str:
    """The mutant's changed line, whitespace-normalised: its identity across unrelated edits."""
    mutmut = Path(sys.executable).with_name("mutmut")
    proc = subprocess.run([str(mutmut) if mutmut.exists() else "mutmut", "show", name], cwd=work, env=env,
                          capture_output=True, text=True)
    added = [ln[1:] for ln in proc.stdout.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return " ".join(" ".join(added).split())


def _load_equivalent() -> list[dict[str, str]]:
    if not EQUIVALENT.exists():
        return []
    entries = tomllib.loads(EQUIVALENT.read_text()).get("equivalent", [])
    for entry in entries:
        entry["line"] = " ".join(entry["line"].split())
        if not entry.get("reason"):
            raise SystemExit(f"{EQUIVALENT}: an entry has no reason: {entry}")
    return entries


def _collect(modules: dict[str, str], work: Path, env: dict[str, str], equivalent: list[dict[str, str]],
             used: set[int]) -> list[Row]:
    rows = {m: Row(m) for m in modules}
    for module, rel in modules.items():
        meta = json.loads((work / "mutants" / (rel + ".meta")).read_text())
        for name, code in sorted(meta["exit_code_by_key"].items()):
            row = rows[module]
            if code in KILLED:
                row.killed += 1
                continue
            if code not in SURVIVED:
                raise SystemExit(f"{name}: unexpected mutmut exit code {code!r} (not checked?)")
            function, line = _function(module, name), _mutated_line(work, name, env)
            label = f"{name}  [{function}]  {line}"
            match = next((i for i, e in enumerate(equivalent) if e["module"] == module
                          and e["function"] == function and e["line"] == line), None)
            if match is None:
                row.survived.append(label + ("  (no test reaches it)" if code in (5, 33) else ""))
            else:
                used.add(match)
                row.equivalent.append(f"{label}\n        reason: {equivalent[match]['reason']}")
    return list(rows.values())


def _select(names: list[str]) -> dict[str, dict[str, str]]:
    """Package and module names from the command line -> {package: {module: path}}; none = all."""
    selected: dict[str, dict[str, str]] = {}
    for name in names or list(PACKAGES):
        if name in PACKAGES:
            selected.setdefault(name, {}).update(PACKAGES[name][0])
            continue
        package = next((p for p, (modules, _) in PACKAGES.items() if name in modules), None)
        if package is None:
            known = [*PACKAGES, *(m for modules, _ in PACKAGES.values() for m in modules)]
            raise SystemExit(f"unknown package or module {name!r}; choose from: {', '.join(known)}")
        selected.setdefault(package, {})[name] = PACKAGES[package][0][name]
    return selected


def main(argv: list[str]) -> int:
    selected = _select(argv)
    # One OpenMP thread: mutmut forks a child per mutant from a process that has run torch, and a
    # forked child of a process with an OpenMP thread pool hangs in its first parallel region.
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    equivalent = _load_equivalent()
    used: set[int] = set()
    start = time.monotonic()
    rows: list[Row] = []
    for package, modules in selected.items():
        work = _run_package(package, modules, env)
        rows += _collect(modules, work, env, equivalent, used)
    elapsed = time.monotonic() - start

    for row in rows:
        for label in row.survived:
            print(f"SURVIVED    {label}")
        for label in row.equivalent:
            print(f"EQUIVALENT  {label}")
    scope = {m for modules in selected.values() for m in modules}
    for i, entry in enumerate(equivalent):
        if i not in used and entry["module"] in scope:
            print(f"STALE equivalent entry (no such surviving mutant): {entry['module']} {entry['function']}: "
                  f"{entry['line']}")
    print(f"\n{'module':<28} {'mutants':>8} {'killed':>7} {'survived':>9} {'equivalent':>11} {'% killed':>9}")
    for row in rows:
        print(f"{row.module:<28} {row.total:>8} {row.killed:>7} {len(row.survived):>9} {len(row.equivalent):>11} "
              f"{row.score:>8.1f}%")
    print(f"\nwall time: {elapsed / 60:.1f} min; threshold {THRESHOLD:.0f}% killed per module "
          "(equivalent mutants left out)")
    failing = [r.module for r in rows if r.score < THRESHOLD]
    if failing:
        print(f"under {THRESHOLD:.0f}%: {', '.join(failing)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
