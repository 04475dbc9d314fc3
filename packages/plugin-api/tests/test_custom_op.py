from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from loom_plugin_api import CustomOp, CustomOpError, Platform, PlatformEnum, set_current_config
from loom_plugin_api import custom_op as custom_op_module


class _Cpu(Platform):
    _enum = PlatformEnum.CPU


class _Oot(Platform):
    _enum = PlatformEnum.OOT


class _Cuda(Platform):
    _enum = PlatformEnum.CUDA


@pytest.fixture
def registries():
    saved = (dict(custom_op_module.op_registry), dict(custom_op_module.op_registry_oot),
             set(custom_op_module._oot_covers_subclasses))
    yield
    custom_op_module.op_registry.clear()
    custom_op_module.op_registry.update(saved[0])
    custom_op_module.op_registry_oot.clear()
    custom_op_module.op_registry_oot.update(saved[1])
    custom_op_module._oot_covers_subclasses.clear()
    custom_op_module._oot_covers_subclasses.update(saved[2])


def _config(custom_ops):
    return SimpleNamespace(compilation_config=SimpleNamespace(custom_ops=custom_ops))


def _make_ops():
    @CustomOp.register("test_scale")
    class Scale(CustomOp):
        def forward_native(self, x):
            return x * 2

        def forward_cpu(self, x):
            return x * 3

        def forward_oot(self, x):
            return x * 5

    class MScale(Scale):
        """A subclass with its own name (like MRotaryEmbedding)."""

    return Scale, MScale


@pytest.mark.parametrize(
    ("platform", "custom_ops", "method"),
    [
        (_Cpu(), ["all"], "forward_cpu"),
        (_Oot(), ["all"], "forward_oot"),
        (_Cuda(), ["all"], "forward_cuda"),
        (_Oot(), ["none"], "forward_native"),
        (_Oot(), ["none", "+test_scale"], "forward_oot"),
        (_Oot(), ["all", "-test_scale"], "forward_native"),
    ],
)
def test_dispatch_by_platform_and_custom_ops(registries, fake_platform, platform, custom_ops, method):
    Scale, _ = _make_ops()
    fake_platform(platform)
    with set_current_config(_config(custom_ops)):
        op = Scale()
    assert op.forward_method_name == method
    expected = {"forward_cpu": 3, "forward_oot": 5, "forward_native": 2, "forward_cuda": 2}[method]
    assert torch.equal(op(torch.ones(2)), torch.full((2,), float(expected)))


def test_plus_and_minus_same_op_is_an_error(registries, fake_platform):
    Scale, _ = _make_ops()
    fake_platform(_Cpu())
    with set_current_config(_config(["all", "+test_scale", "-test_scale"])), \
            pytest.raises(CustomOpError, match="both enables and disables test_scale"):
        Scale()


def test_register_oot_swaps_exact_name_only(registries, fake_platform):
    Scale, MScale = _make_ops()
    fake_platform(_Oot())

    @Scale.register_oot
    class VendorScale(Scale):
        def forward_oot(self, x):
            return x * 7

    with set_current_config(_config(["all"])):
        op, sub = Scale(), MScale()
    assert type(op) is VendorScale and op(torch.ones(1)).item() == 7
    assert type(sub) is MScale  # the exact-name rule: a subclass is not replaced
    assert custom_op_module.op_registry_oot["Scale"] is VendorScale


def test_register_oot_include_subclasses_opt_in(registries, fake_platform):
    Scale, MScale = _make_ops()
    fake_platform(_Oot())

    @Scale.register_oot(include_subclasses=True)
    class VendorScale(Scale):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.initialized = True

    sub = MScale()
    assert type(sub) is VendorScale and sub.initialized


def test_register_oot_with_name_and_duplicates(registries):
    Scale, _ = _make_ops()

    @CustomOp.register_oot(name="Scale")
    class A(Scale):
        pass

    CustomOp.register_oot(name="Scale")(A)  # the same class again is a no-op

    class B(Scale):
        pass

    with pytest.raises(CustomOpError, match="already replaced by .*A; cannot also register .*B"):
        Scale.register_oot(B)


def test_replacement_must_subclass(registries):
    Scale, _ = _make_ops()

    class Unrelated(CustomOp):
        pass

    with pytest.raises(CustomOpError, match="must subclass"):
        Scale.register_oot(Unrelated)


def test_bad_custom_ops_entry():
    with pytest.raises(CustomOpError, match="'rms_norm' is not"):
        custom_op_module.resolve_custom_ops(["rms_norm"])


@pytest.mark.parametrize("platform", [_Cpu(), _Cuda(), _Oot()])
def test_platform_methods_default_to_forward_native_with_all_arguments(registries, fake_platform, platform):
    @CustomOp.register("test_affine")
    class Affine(CustomOp):
        def forward_native(self, x, *, scale=1.0, shift=0.0):
            return x * scale + shift

    fake_platform(platform)
    with set_current_config(_config(["all"])):
        op = Affine()
    assert op.forward_method_name != "forward_native"  # the platform's method, inherited
    assert op(torch.ones(2), scale=3.0, shift=1.0).tolist() == [4.0, 4.0]


def test_an_op_without_forward_native_says_which(registries, fake_platform):
    @CustomOp.register("test_empty")
    class Empty(CustomOp):
        pass

    fake_platform(_Cpu())
    with set_current_config(_config(["none"])), pytest.raises(NotImplementedError, match="^Empty has no forward_native$"):
        Empty()(torch.ones(1))


def test_platform_without_a_table_entry_runs_forward_native(registries, fake_platform):
    Scale, _ = _make_ops()
    fake_platform(SimpleNamespace(_enum=PlatformEnum.UNSPECIFIED))
    with set_current_config(_config(["all"])):
        op = Scale()
    assert op.forward_method_name == "forward_native" and op(torch.ones(1)).item() == 2


def test_an_op_without_a_name_follows_the_base_switch(registries, fake_platform):
    class Unnamed(CustomOp):
        def forward_native(self, x):
            return x

    fake_platform(_Cpu())
    for custom_ops, method in ((["all"], "forward_cpu"), (["none"], "forward_native")):
        with set_current_config(_config(custom_ops)):
            assert Unnamed().forward_method_name == method


def test_register_names_the_op_and_refuses_a_taken_name(registries):
    Scale, _ = _make_ops()
    assert Scale.name == "test_scale" and custom_op_module.op_registry["test_scale"] is Scale
    assert CustomOp.register("test_scale")(Scale) is Scale  # the same class again is a no-op

    class Other(CustomOp):
        pass

    with pytest.raises(CustomOpError, match="^custom op name 'test_scale' is already registered by .*Scale$"):
        CustomOp.register("test_scale")(Other)
    assert custom_op_module.op_registry["test_scale"] is Scale


def test_register_oot_from_the_base_needs_a_name(registries):
    class Vendor(CustomOp):
        pass

    with pytest.raises(CustomOpError) as e:
        CustomOp.register_oot(Vendor)
    assert str(e.value) == "CustomOp.register_oot needs name=<in-tree class name>"
    assert "Vendor" not in custom_op_module.op_registry_oot
