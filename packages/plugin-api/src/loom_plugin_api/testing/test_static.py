"""Static tier: the entry point, the detector, hook signatures, the names the platform returns."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest
import torch

from .._groups import PLATFORM_PLUGINS_GROUP
from ..attention import AttentionBackend, AttentionSelectorConfig
from ..communicator import DeviceCommunicatorBase
from ..errors import PlatformError
from ..platform import Platform
from ..validation import CONTRACT_DISTRIBUTION, contract_mismatch, validate_platform_cls
from ._names import resolve_subclass
from ._platform import PlatformUnderTest

pytestmark = pytest.mark.static

_DETECT = """
import json, sys
from loom_plugin_api.testing._platform import _is_not_available, find_detector
func, value, ep = find_detector(sys.argv[1])
if func is None:
    ep.load()
try:
    answer = func()
except Exception as e:
    if not _is_not_available(e):
        raise
    answer = None
print(json.dumps({"answer": answer}))
"""


def test_entry_point_loads(loom_platform_under_test: PlatformUnderTest) -> None:
    put = loom_platform_under_test
    if put.detector is None:
        pytest.fail(
            f"{put.error}. Fix the import, or the entry point's value in your pyproject.toml "
            f'[project.entry-points."{PLATFORM_PLUGINS_GROUP}"]'
        )


def test_detector_answers_a_qualified_name_or_none(loom_platform_under_test: PlatformUnderTest) -> None:
    put = loom_platform_under_test
    if put.detector is None:
        pytest.fail(put.error or "the entry point did not load")
    if put.answer is None and put.error and "answered None" not in put.error:
        pytest.fail(
            f"{put.error}. A detector must return the Platform's qualified name, or None when the "
            "device is absent, and never raise"
        )
    if put.answer is None:
        pytest.skip(f"the detector answered None here (device absent); checking {put.qualname}")


def test_detector_is_idempotent(loom_platform_under_test: PlatformUnderTest) -> None:
    put = loom_platform_under_test
    if put.detector is None or put.answer is None:
        pytest.skip("no answer to compare (see test_detector_answers_a_qualified_name_or_none)")
    again = put.detector()
    if again != put.answer:
        pytest.fail(
            f"detector {put.name} answered {put.answer!r}, then {again!r}: every process calls it, "
            "sometimes twice; it must answer the same each time"
        )


def test_detector_in_a_fresh_interpreter(loom_platform_under_test: PlatformUnderTest) -> None:
    put = loom_platform_under_test
    proc = subprocess.run(
        [sys.executable, "-c", _DETECT, put.name], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        pytest.fail(
            f"detector {put.name} fails in a fresh interpreter (every serve process runs it there):\n"
            f"{proc.stderr[-2000:]}"
        )
    answer = json.loads(proc.stdout.strip().splitlines()[-1])["answer"]
    if answer != put.answer:
        pytest.fail(
            f"detector {put.name} answered {answer!r} in a fresh interpreter but {put.answer!r} here: "
            "it must not depend on what the process imported before"
        )


def test_platform_class_resolves(loom_platform_under_test: PlatformUnderTest) -> None:
    put = loom_platform_under_test
    if put.platform_cls is None:
        pytest.fail(put.error or "no class")


def test_contract_range_includes_installed_contract(loom_platform_under_test: PlatformUnderTest) -> None:
    put = loom_platform_under_test
    if put.distribution is None:
        pytest.fail(
            f"{put.qualname} belongs to no installed distribution: install your platform as a package "
            f"that depends on {CONTRACT_DISTRIBUTION}"
        )
    if put.contract_range is None:
        pytest.fail(
            f"{put.distribution} {put.version} does not declare a requirement on {CONTRACT_DISTRIBUTION}: "
            f'add "{CONTRACT_DISTRIBUTION}>=1,<2" to its dependencies'
        )
    mismatch = contract_mismatch(put.name, importlib.metadata.distribution(put.distribution))
    if mismatch is not None:
        pytest.fail(mismatch)


def test_hook_signatures(platform_cls: type[Platform], loom_platform_under_test: PlatformUnderTest) -> None:
    try:
        validate_platform_cls(platform_cls, loom_platform_under_test.name, resolve_names=False)
    except PlatformError as e:
        pytest.fail(str(e))


def test_no_misspelled_hooks(platform_cls: type[Platform],
                             loom_platform_under_test: PlatformUnderTest) -> None:
    try:
        warnings = validate_platform_cls(platform_cls, loom_platform_under_test.name, resolve_names=False)
    except PlatformError:
        pytest.skip("the hook signatures are wrong (see test_hook_signatures)")
    if warnings:
        pytest.fail("; ".join(warnings))


def test_attention_backend_resolves(platform_cls: type[Platform]) -> None:
    selector = AttentionSelectorConfig(head_size=64, dtype=torch.float32, block_size=16)
    qualname = platform_cls.get_attn_backend_cls(None, selector, 4)
    resolve_subclass(qualname, AttentionBackend, f"{platform_cls.__qualname__}.get_attn_backend_cls()")


def test_communicator_resolves(platform_cls: type[Platform]) -> None:
    if not platform_cls.supports_tensor_parallel:
        pytest.skip(f"{platform_cls.__qualname__}.supports_tensor_parallel is False")
    qualname = platform_cls.get_device_communicator_cls()
    resolve_subclass(
        qualname, DeviceCommunicatorBase, f"{platform_cls.__qualname__}.get_device_communicator_cls()"
    )
