"""loom serve start-up failures: a report naming the process and phase, non-zero exit, nothing left."""

from __future__ import annotations

import shutil
import subprocess
import sys

import loom_supervisor  # noqa: F401  (a missing supervisor wheel is an error, not a skip)
import pytest
from fake_dist import write_fake_dist
from serve_utils import alive, free_port

pytestmark = pytest.mark.usefixtures("every_installed_plugin")


def run_serve(args: list[str], env: dict[str, str] | None = None, extra_path=None, timeout: float = 180):
    import os

    full_env = {**os.environ, **(env or {})}
    if extra_path is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), full_env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "loom.entrypoints.cli.main", "serve", *args, "--port", str(free_port()),
           "--startup-timeout", "120"]
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)


def reported_pids(output: str) -> list[int]:
    import re

    return [int(p) for p in re.findall(r"\(pid (\d+)\)", output)]


def test_config_error_is_one_line_before_anything_spawns():
    proc = run_serve(["/nonexistent/model"])
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("loom: error: model path '/nonexistent/model'")
    assert "loom-supervisor" not in proc.stderr


def test_corrupt_weights_name_the_worker_and_phase(tiny_llama, tmp_path):
    model = tmp_path / "corrupt"
    shutil.copytree(tiny_llama, model)
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    proc = run_serve([str(model), "--max-model-len", "128"])
    out = proc.stderr + proc.stdout
    assert proc.returncode != 0
    assert "worker:0 (pid" in out and "in start-up phase" in out
    assert "cannot read weights file" in out
    assert not [p for p in reported_pids(out) if alive(p)]


def test_worker_cls_that_does_not_resolve(tiny_llama):
    """Checked where the config is finished: one line, before anything is spawned."""
    proc = run_serve([str(tiny_llama), "--max-model-len", "128", "--worker-cls", "no_such_module.Worker"])
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("loom: error: --worker-cls (parallel_config.worker_cls) must name a subclass of "
                           "loom_plugin_api.WorkerBase, found 'no_such_module.Worker', which does not import")
    assert "loom-supervisor" not in proc.stderr and "Traceback" not in proc.stderr


PLATFORM = """
from loom.platforms.cpu import CpuPlatform

class FailingPlatform(CpuPlatform):
    device_name = "failing"

    @classmethod
    def register_triton_kernel_overrides(cls):
        raise RuntimeError("kernel override table is corrupt")

def detect():
    return "fakefailplat.FailingPlatform"
"""


def test_platform_hook_raising_in_a_worker(tiny_llama, tmp_path):
    write_fake_dist(tmp_path, "fake-failplat", {"loom.platform_plugins": {"failing": "fakefailplat:detect"}},
                    "fakefailplat", PLATFORM)
    proc = run_serve([str(tiny_llama), "--max-model-len", "128"], env={"LOOM_PLUGINS": "failing"},
                     extra_path=tmp_path)
    out = proc.stderr + proc.stdout
    assert proc.returncode != 0
    assert "worker:0 (pid" in out and "kernel override table is corrupt" in out


def test_tensor_parallel_size_that_does_not_divide_the_heads(tiny_llama):
    proc = run_serve([str(tiny_llama), "--tensor-parallel-size", "3"])
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("loom: error: the model has 4 attention heads, which --tensor-parallel-size 3")
    assert "loom-supervisor" not in proc.stderr
