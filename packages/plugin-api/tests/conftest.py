from __future__ import annotations

import sys

import pytest
from loom_plugin_api import context, loader


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A fresh directory on sys.path for fake distributions; plugin state is reset around it."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    # LOOM_PLUGINS straight from os.environ (monkeypatched by the tests), even when the engine
    # installed its cached reader earlier in this process.
    monkeypatch.setattr(loader, "_loom_plugins_reader", loader._read_loom_plugins_from_environ)
    loader._reset_for_tests()
    yield site
    loader._reset_for_tests()
    for mod in [m for m in sys.modules if m.startswith("fakeplug")]:
        del sys.modules[mod]


@pytest.fixture
def fake_platform():
    """Install a resolver returning a chosen platform instance for CustomOp dispatch."""
    previous = context._platform_resolver
    holder = {}

    def use(platform):
        holder["p"] = platform
        context.set_platform_resolver(lambda: holder["p"])

    yield use
    context._platform_resolver = previous
