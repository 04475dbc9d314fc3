from __future__ import annotations

import sys

import pytest
import torch.nn as nn
from loom_plugin_api import ModelRegistryError
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


def test_lazy_registration_imports_only_when_inspected(tmp_path, monkeypatch):
    (tmp_path / "fakeplug_lazy_model.py").write_text(
        "import torch.nn as nn\nclass Lazy(nn.Module):\n    def compute_logits(self, h):\n        return h\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = _ModelRegistry()
    registry.register_model("Lazy", "fakeplug_lazy_model:Lazy")
    assert "fakeplug_lazy_model" not in sys.modules
    assert not registry.models["Lazy"].is_imported
    info, arch = registry.inspect_model_cls("Lazy")
    assert "fakeplug_lazy_model" in sys.modules and info.class_name == "Lazy" and arch == "Lazy"
    cls, _ = registry.resolve_model_cls(["Lazy"])
    assert cls.__name__ == "Lazy"


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
