from __future__ import annotations

import sys

import pytest
import torch.nn as nn
from loom_plugin_api import ModelRegistryError, model_registry
from loom_plugin_api.model_registry import _ModelRegistry


class TinyModel(nn.Module):
    def compute_logits(self, hidden):
        return hidden


def test_eager_registration_has_info_now():
    registry = _ModelRegistry()
    registry.register_model("Tiny", TinyModel)
    entry = registry.models["Tiny"]
    assert entry.info.class_name == "TinyModel" and entry.info.is_text_generation
    info, arch = registry.inspect_model_cls(["Unknown", "Tiny"])
    assert arch == "Tiny" and info is entry.info


def _write_lazy_module(tmp_path, name="fakeplug_lazy_model"):
    (tmp_path / f"{name}.py").write_text(
        "import torch.nn as nn\nclass Lazy(nn.Module):\n    supports_tensor_parallel = False\n"
        "    def compute_logits(self, h):\n        return h\n"
    )


def test_lazy_registration_is_inspected_without_importing_it(tmp_path, monkeypatch):
    _write_lazy_module(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    registry = _ModelRegistry()
    registry.register_model("Lazy", "fakeplug_lazy_model:Lazy")
    assert not registry.models["Lazy"].is_imported
    info, arch = registry.inspect_model_cls("Lazy")
    assert info.class_name == "Lazy" and arch == "Lazy" and info.is_text_generation
    assert info.supports_tensor_parallel is False
    assert "fakeplug_lazy_model" not in sys.modules  # inspected in a subprocess
    cls, _ = registry.resolve_model_cls(["Lazy"])
    assert cls.__name__ == "Lazy" and "fakeplug_lazy_model" in sys.modules


def test_lazy_inspection_is_cached_by_module_file(tmp_path, monkeypatch):
    _write_lazy_module(tmp_path, "fakeplug_cached_model")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    first = _ModelRegistry()
    first.register_model("Lazy", "fakeplug_cached_model:Lazy")
    info, _ = first.inspect_model_cls("Lazy")
    assert len(list((tmp_path / "cache" / "modelinfos").iterdir())) == 1

    def no_subprocess(*args, **kwargs):
        raise AssertionError("the cached model info should have been used")

    monkeypatch.setattr(model_registry.subprocess, "run", no_subprocess)
    second = _ModelRegistry()
    second.register_model("Lazy", "fakeplug_cached_model:Lazy")
    assert second.inspect_model_cls("Lazy")[0] == info
    assert "fakeplug_cached_model" not in sys.modules


def test_lazy_inspection_of_a_broken_module_raises_its_error(tmp_path, monkeypatch):
    (tmp_path / "fakeplug_broken_model.py").write_text("raise RuntimeError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    registry = _ModelRegistry()
    registry.register_model("Broken", "fakeplug_broken_model:Broken")
    with pytest.raises(Exception, match="broken on purpose"):
        registry.inspect_model_cls("Broken")


@pytest.mark.parametrize(
    ("arch", "target", "match"),
    [
        ("", TinyModel, "non-empty"),
        ("X", "no_colon.Module", "pkg.module:Class"),
        ("X", 42, "registered with a class"),
        ("X", dict, "torch.nn.Module subclass"),
    ],
)
def test_bad_registrations(arch, target, match):
    with pytest.raises(ModelRegistryError, match=match):
        _ModelRegistry().register_model(arch, target)


def test_unknown_architecture_lists_registered():
    registry = _ModelRegistry()
    registry.register_model("Tiny", TinyModel)
    with pytest.raises(ModelRegistryError, match=r"\['Nope'\].*registered: Tiny"):
        registry.inspect_model_cls(["Nope"])
