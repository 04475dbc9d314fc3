"""custom_ops switches on the real layers, under whichever platform this session installs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from loom_plugin_api import load_general_plugins, set_current_config
from loom_plugin_api.ops.layernorm import LayerNorm, RMSNorm
from loom_plugin_api.ops.rotary_embedding import get_rope


@pytest.fixture(autouse=True, scope="module")
def _plugins_loaded():
    """A serve's processes load the general plugins (the dummy platform's op) before building models."""
    load_general_plugins()


def _config(custom_ops):
    return SimpleNamespace(compilation_config=SimpleNamespace(custom_ops=custom_ops))


@pytest.mark.parametrize(
    ("custom_ops", "rope_method", "rms_method"),
    [
        (["none"], "forward_native", "forward_native"),
        (["all"], "platform", "platform"),
        (["none", "+rotary_embedding"], "platform", "forward_native"),
        (["all", "-rms_norm"], "platform", "forward_native"),
    ],
)
def test_switches_pick_the_forward(custom_ops, rope_method, rms_method, expected_platform):
    platform_method = "forward_oot" if expected_platform == "dummy" else "forward_cpu"
    with set_current_config(_config(custom_ops)):
        rope = get_rope(16, 16, 64, 10000.0)
        rms = RMSNorm(32)
        ln = LayerNorm(32)
    assert rope.forward_method_name == (platform_method if rope_method == "platform" else rope_method)
    assert rms.forward_method_name == (platform_method if rms_method == "platform" else rms_method)
    assert type(ln) is LayerNorm  # nothing replaces LayerNorm
    expected_rope = "DummyRotaryEmbedding" if expected_platform == "dummy" else "RotaryEmbedding"
    assert type(rope).__name__ == expected_rope
    # every forward computes the same thing
    q, k = torch.randn(3, 32), torch.randn(3, 16)
    pos = torch.tensor([0, 5, 9])
    got = rope(pos, q.clone(), k.clone())
    ref = rope.forward_native(pos, q.clone(), k.clone())
    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])
