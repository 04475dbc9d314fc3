from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from loom_plugin_api import context, loader


def make_dist(root: Path, name: str, entry_points: dict[str, dict[str, str]],
              modules: dict[str, str] | None = None) -> Path:
    """Write a minimal installed distribution (dist-info + modules) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for mod, source in (modules or {}).items():
        (root / f"{mod}.py").write_text(textwrap.dedent(source))
    return root


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A fresh directory on sys.path for fake distributions; plugin state is reset around it."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
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
