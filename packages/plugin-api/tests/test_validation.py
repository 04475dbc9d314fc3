"""loom_plugin_api.validation: a Platform subclass checked against the specification."""

from __future__ import annotations

import pytest
from loom_plugin_api import Platform, PlatformError
from loom_plugin_api.validation import hook_names, validate_platform_cls, validate_worker_cls

PLUGIN = "'acme' (loom-platform-acme 0.2)"

# Names the platforms below return: written to the fake site, imported by qualified name.
NAMES = """
from loom_plugin_api import AttentionBackend, DeviceCommunicatorBase

class Backend(AttentionBackend):
    @staticmethod
    def get_impl_cls():
        raise NotImplementedError

class Communicator(DeviceCommunicatorBase):
    def all_reduce(self, x):
        return x
    def all_gather(self, x, dim=-1):
        return x
    def broadcast(self, x, src=0):
        return x

class NotABackend:
    pass
"""


@pytest.fixture
def names(fake_site):
    (fake_site / "fakeplug_names.py").write_text(NAMES)


class Good(Platform):
    """Overrides hooks in every accepted way: same parameters, *args / **kwargs, a staticmethod."""

    @classmethod
    def check_and_update_config(cls, config, *, extra=None):
        pass

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, *args, **kwargs):
        return "fakeplug_names.Backend"

    @classmethod
    def get_device_communicator_cls(cls):
        return "fakeplug_names:Communicator"

    @staticmethod
    def validate_environ(fail):
        pass

    @classmethod
    def describe_device(cls):  # a helper of the platform's own, named unlike any hook
        return "acme"


def subclass(**attrs):
    return type("Acme", (Good,), attrs)


def error_of(cls, **kwargs) -> str:
    with pytest.raises(PlatformError) as excinfo:
        validate_platform_cls(cls, PLUGIN, **kwargs)
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith(f"platform plugin {PLUGIN}: ")
    return message


def test_hooks_are_the_public_methods_of_platform():
    assert {"check_and_update_config", "get_attn_backend_cls", "get_device_communicator_cls",
            "pre_register_and_update", "update_block_size_for_backend", "is_cpu"} <= set(hook_names())
    assert not {"device_name", "supported_dtypes", "__repr__"} & set(hook_names())


def test_a_platform_that_follows_the_specification_passes(names):
    assert validate_platform_cls(Good, PLUGIN) == []


def test_a_hook_that_lacks_a_parameter_of_the_specification():
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config):
        return "fakeplug_names.Backend"

    message = error_of(subclass(get_attn_backend_cls=classmethod(get_attn_backend_cls)), resolve_names=False)
    assert message == (
        f"platform plugin {PLUGIN}: Acme.get_attn_backend_cls(selected_backend, attn_selector_config) does "
        "not accept the specification's Platform.get_attn_backend_cls(selected_backend, attn_selector_config, "
        "num_heads=None): it takes no parameter at position 2 ('num_heads')"
    )


def test_a_hook_that_requires_a_parameter_the_engine_never_passes():
    def check_and_update_config(cls, config, device):
        pass

    message = error_of(subclass(check_and_update_config=classmethod(check_and_update_config)))
    assert "Acme.check_and_update_config(config, device) does not accept" in message
    assert "Platform.check_and_update_config(config): it requires 'device', which the engine never passes" in message


def test_a_hook_whose_parameter_is_renamed():
    def check_and_update_config(cls, cfg):
        pass

    message = error_of(subclass(check_and_update_config=classmethod(check_and_update_config)))
    assert message.endswith("Platform.check_and_update_config(config): parameter 0 is 'cfg', "
                            "the specification's is 'config'")


def test_a_hook_that_drops_a_default():
    def get_device_total_memory(cls, device_id):
        return 0

    message = error_of(subclass(get_device_total_memory=classmethod(get_device_total_memory)))
    assert "Acme.get_device_total_memory(device_id) does not accept" in message
    assert message.endswith("Platform.get_device_total_memory(device_id=0): parameter 'device_id' needs a "
                            "default: the engine may leave it out")


def test_a_keyword_only_parameter_where_the_engine_passes_by_position():
    def check_and_update_config(cls, *, config):
        pass

    message = error_of(subclass(check_and_update_config=classmethod(check_and_update_config)))
    assert "Acme.check_and_update_config(config)" in message
    assert message.endswith("it takes no parameter at position 0 ('config')")


def test_a_hook_that_is_not_a_classmethod():
    def check_and_update_config(self, config):
        pass

    message = error_of(subclass(check_and_update_config=check_and_update_config))
    assert message == (
        f"platform plugin {PLUGIN}: Acme.check_and_update_config must be a @classmethod like "
        "Platform.check_and_update_config (the engine calls it on the class), found a plain method"
    )


def test_a_hook_replaced_by_something_not_callable():
    message = error_of(subclass(set_device="cuda:0"))
    assert message == (f"platform plugin {PLUGIN}: Acme.set_device must be a method like Platform.set_device, "
                       "found str 'cuda:0'")


def test_every_bad_hook_is_named_in_the_one_line():
    def check_and_update_config(cls, cfg):
        pass

    message = error_of(subclass(check_and_update_config=classmethod(check_and_update_config), set_device=1))
    assert "Acme.check_and_update_config(cfg)" in message and "Acme.set_device must be" in message


def test_a_method_named_close_to_a_hook_is_a_warning(names):
    def get_attn_backend_class(cls, selected_backend, attn_selector_config, num_heads=None):
        return "fakeplug_names.Backend"

    warnings = validate_platform_cls(subclass(get_attn_backend_class=classmethod(get_attn_backend_class)), PLUGIN)
    assert warnings == [
        f"platform plugin {PLUGIN}: Acme.get_attn_backend_class is not a hook of loom_plugin_api.Platform and "
        "the engine never calls it; did you mean get_attn_backend_cls?"
    ]


def test_a_platform_without_an_attention_backend():
    class Bare(Platform):
        pass

    message = error_of(Bare)
    assert message.startswith(f"platform plugin {PLUGIN}: Bare.get_attn_backend_cls(None, ...) must name a "
                              "subclass of loom_plugin_api.AttentionBackend, found none")
    assert "NotImplementedError" in message


def test_an_attention_backend_that_is_not_one(names):
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        return "fakeplug_names.NotABackend"

    message = error_of(subclass(get_attn_backend_cls=classmethod(get_attn_backend_cls)))
    assert message == (
        f"platform plugin {PLUGIN}: Acme.get_attn_backend_cls(None, ...) must name a subclass of "
        "loom_plugin_api.AttentionBackend, found 'fakeplug_names.NotABackend' (NotABackend, based on "
        "builtins.object)"
    )


def test_an_attention_backend_that_does_not_import(names):
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        return "fakeplug_nosuch.Backend"

    message = error_of(subclass(get_attn_backend_cls=classmethod(get_attn_backend_cls)))
    assert "Acme.get_attn_backend_cls(None, ...) must name a subclass of loom_plugin_api.AttentionBackend," in message
    assert "found 'fakeplug_nosuch.Backend', which does not import: cannot import module 'fakeplug_nosuch'" in message


def test_a_communicator_of_the_wrong_base(names):
    def get_device_communicator_cls(cls):
        return "fakeplug_names.Backend"

    message = error_of(subclass(get_device_communicator_cls=classmethod(get_device_communicator_cls)))
    assert message == (
        f"platform plugin {PLUGIN}: Acme.get_device_communicator_cls() must name a subclass of "
        "loom_plugin_api.DeviceCommunicatorBase, found 'fakeplug_names.Backend' (Backend, based on "
        "loom_plugin_api.attention.AttentionBackend)"
    )


def test_the_default_communicator_is_the_contract_s(names):
    class OnlyBackend(Platform):
        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            return "fakeplug_names.Backend"

    assert OnlyBackend.get_device_communicator_cls() == "loom_plugin_api.communicator.TorchDistributedCommunicator"
    assert validate_platform_cls(OnlyBackend, PLUGIN) == []


def test_names_are_not_resolved_when_asked_not_to():
    class Bare(Platform):
        pass

    assert validate_platform_cls(Bare, PLUGIN, resolve_names=False) == []


def test_a_class_that_is_not_a_platform():
    with pytest.raises(PlatformError, match=r"^platform plugin 'acme' \(loom-platform-acme 0.2\) must name a "
                                            r"subclass of loom_plugin_api.Platform, found <class 'dict'>$"):
        validate_platform_cls(dict, PLUGIN)


def test_worker_cls_must_subclass_worker_base(names):
    validate_worker_cls("loom_plugin_api.cpu_worker.CPUWorker", PLUGIN, Good)
    with pytest.raises(PlatformError) as excinfo:
        validate_worker_cls("fakeplug_names.Communicator", PLUGIN, Good)
    assert str(excinfo.value) == (
        f"platform plugin {PLUGIN}: Good.check_and_update_config(config) (parallel_config.worker_cls) must name "
        "a subclass of loom_plugin_api.WorkerBase, found 'fakeplug_names.Communicator' (Communicator, "
        "based on loom_plugin_api.communicator.DeviceCommunicatorBase)"
    )
    with pytest.raises(PlatformError, match=r"by its qualified name \('pkg.module.Class'\), found None$"):
        validate_worker_cls(None, PLUGIN, Good)


def test_worker_cls_the_user_chose_is_named_as_theirs():
    with pytest.raises(PlatformError) as excinfo:
        validate_worker_cls("fakeplug_nosuch.Worker", PLUGIN, Good, chosen_by_user=True)
    message = str(excinfo.value)
    assert message.startswith("--worker-cls (parallel_config.worker_cls) must name a subclass of "
                              "loom_plugin_api.WorkerBase, found 'fakeplug_nosuch.Worker', which does not import")
    assert "acme" not in message  # the platform did not choose it
