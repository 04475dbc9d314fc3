"""The built-in ``cuda`` detector: answers only with the wheel, a GPU and a CUDA torch, and
never imports torch to find out."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from loom import platforms


@pytest.fixture
def wheel_installed(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "loom_platform_cuda":
            return object()
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_without_the_wheel(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "loom_platform_cuda" else real(name, *a, **k))
    with pytest.raises(platforms._NotAvailable, match="loom-platform-cuda is not installed"):
        platforms.cuda_platform_plugin()


@pytest.mark.parametrize("value", ["", "-1"])
def test_cuda_visible_devices_hides_the_gpus(wheel_installed, monkeypatch, value):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    with pytest.raises(platforms._NotAvailable, match="hides every GPU"):
        platforms.cuda_platform_plugin()


def test_answers_with_a_gpu_and_a_cuda_torch(wheel_installed, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(platforms, "_nvml_device_count", lambda: 2)
    monkeypatch.setattr(platforms, "_torch_cuda_version", lambda: "12.8")
    assert platforms.cuda_platform_plugin() == "loom_platform_cuda.platform.CudaPlatform"
    monkeypatch.setattr(platforms, "_torch_cuda_version", lambda: None)
    with pytest.raises(platforms._NotAvailable, match="CPU-only build"):
        platforms.cuda_platform_plugin()
    monkeypatch.setattr(platforms, "_nvml_device_count", lambda: 0)
    with pytest.raises(platforms._NotAvailable, match="reports 0 GPUs"):
        platforms.cuda_platform_plugin()


def test_torch_version_file_is_parsed(tmp_path, monkeypatch):
    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('the detector must not import torch')\n")
    (pkg / "version.py").write_text("__version__ = '2.13.0'\ncuda: Optional[str] = '12.8'\n")
    code = "from loom import platforms; print(platforms._torch_cuda_version())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}"})
    assert out.stdout.strip() == "12.8"


def test_the_detector_does_not_import_torch():
    code = ("import sys; from loom import platforms\n"
            "try:\n    platforms.cuda_platform_plugin()\nexcept platforms._NotAvailable:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
