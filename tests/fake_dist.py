"""Install-free fake distributions: a dist-info folder with entry points on PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def write_fake_dist(root: Path, name: str, entry_points: dict[str, dict[str, str]], module: str,
                    source: str) -> Path:
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    text = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for g, eps in entry_points.items())
    (info / "entry_points.txt").write_text(text)
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root


def run_python(code: str, extra_path: Path | None = None, env: dict[str, str] | None = None,
               timeout: float = 240) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    if extra_path is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), full_env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
