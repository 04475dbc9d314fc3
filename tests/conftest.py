"""Shared fixtures of the cross-package tests: tiny random-weight models and the platform."""

from __future__ import annotations

import importlib.util
import os
from importlib import metadata
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tiny_models import build_tiny_model  # noqa: E402


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="session")
def expected_platform() -> str:
    """The platform this nox session installs: 'dummy' when loom-platform-dummy is there."""
    expected = os.environ.get("LOOM_EXPECT_PLATFORM")
    installed = "dummy" if _installed("loom-platform-dummy") else "cpu"
    if expected and expected != installed:
        pytest.fail(f"session expects platform {expected!r} but the installed wheels give {installed!r}")
    return installed


@pytest.fixture(scope="session")
def has_model_plugin() -> bool:
    return importlib.util.find_spec("loom_add_dummy_model") is not None


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_llama(models_dir) -> Path:
    """Llama with GQA (4 query heads, 2 KV heads) and untied embeddings."""
    return build_tiny_model(models_dir / "llama", "llama", tie=False)


@pytest.fixture(scope="session")
def tiny_llama_tied(models_dir) -> Path:
    return build_tiny_model(models_dir / "llama_tied", "llama", tie=True)


@pytest.fixture(scope="session")
def tiny_opt(models_dir) -> Path:
    return build_tiny_model(models_dir / "opt", "opt", tie=True)


@pytest.fixture(scope="module")
def every_installed_plugin_no_key():
    """``every_installed_plugin``, and no ``LOOM_API_KEY``: for modules whose serves set their key themselves."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("LOOM_PLUGINS", "LOOM_PLATFORM", "LOOM_API_KEY"):
            mp.delenv(name, raising=False)
        yield


@pytest.fixture(scope="module")
def every_installed_plugin():
    """For modules whose child processes inherit this environment: they load every installed
    plugin and detect the platform, whatever LOOM_PLUGINS / LOOM_PLATFORM the caller has set."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("LOOM_PLUGINS", raising=False)
        mp.delenv("LOOM_PLATFORM", raising=False)
        yield
