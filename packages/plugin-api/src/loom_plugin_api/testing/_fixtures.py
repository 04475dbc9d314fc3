"""Fixtures of the kit's own tests (registered as a plugin only when ``--loom-platform`` is given)."""

from __future__ import annotations

import pytest

from ..context import set_platform_resolver
from ..platform import Platform
from ._platform import PlatformUnderTest, general_plugins_of, inspect_platform


@pytest.fixture(scope="session")
def loom_platform_under_test(request: pytest.FixtureRequest) -> PlatformUnderTest:
    """The platform the kit checks (``--loom-platform``), inspected once per session."""
    name = request.config.getoption("--loom-platform")
    try:
        return inspect_platform(name, request.config.getoption("--loom-platform-class"))
    except LookupError as e:
        raise pytest.UsageError(str(e)) from None


@pytest.fixture(scope="session")
def platform_cls(loom_platform_under_test: PlatformUnderTest) -> type[Platform]:
    """The class under test; every check that needs it fails with the static tier's reason."""
    put = loom_platform_under_test
    if put.platform_cls is None:
        pytest.fail(f"no platform class to check: {put.error}")
    return put.platform_cls


@pytest.fixture(scope="session")
def platform_in_this_process(
    platform_cls: type[Platform], loom_platform_under_test: PlatformUnderTest
) -> Platform:
    """Make the class under test this process's platform (what ``CustomOp`` dispatches on) and
    run the worker-side set-up a worker process runs: the general plugins of the platform's
    distribution (those of other distributions may need the engine), then
    ``register_triton_kernel_overrides``."""
    platform = platform_cls()
    set_platform_resolver(lambda: platform)
    for ep in general_plugins_of(loom_platform_under_test.distribution):
        try:
            ep.load()()
        except Exception as e:
            pytest.fail(
                f"general plugin {ep.name} ({ep.value}) of {loom_platform_under_test.distribution} raised "
                f"{type(e).__name__}: {e}"
            )
    platform_cls.register_triton_kernel_overrides()
    return platform
