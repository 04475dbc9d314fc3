"""The contract's LoRA parts: ``LoRARequest``, the resolver registry, and ``BatchedLoRA``'s reference
against a row-by-row loop."""

from __future__ import annotations

import asyncio

import pytest
import torch
from loom_plugin_api import LoRARequest, LoRAResolver, LoRAResolverRegistry, PluginError
from loom_plugin_api.ops import BatchedLoRA, LoRAMapping


@pytest.mark.parametrize("args, field", [
    (("", 1, "/a"), "lora_name"), (("a", 0, "/a"), "lora_int_id"), (("a", True, "/a"), "lora_int_id"),
    (("a", 1, ""), "lora_path"),
])
def test_lora_request_refuses_what_cannot_name_an_adapter(args, field):
    with pytest.raises(ValueError, match=f"LoRARequest.{field}"):
        LoRARequest(*args)


class Found(LoRAResolver):
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        return LoRARequest(lora_name, 1, f"/adapters/{lora_name}") if lora_name.startswith("x") else None


def test_resolver_registry_keeps_order_and_refuses_duplicates():
    registry = LoRAResolverRegistry()
    registry.register_resolver("first", Found())
    registry.register_resolver("second", Found())
    assert registry.get_supported_resolvers() == ["first", "second"]
    with pytest.raises(PluginError, match="'first' is already registered"):
        registry.register_resolver("first", Found())
    with pytest.raises(PluginError, match="must be a LoRAResolver"):
        registry.register_resolver("third", object())  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="registered: first, second"):
        registry.get_resolver("nope")
    resolver = registry.get_resolver("first")
    assert asyncio.run(resolver.resolve_lora("base", "xy")) == LoRARequest("xy", 1, "/adapters/xy")
    assert asyncio.run(resolver.resolve_lora("base", "y")) is None
    registry.unregister_resolver("first")
    assert registry.get_supported_resolvers() == ["second"]


def _loop_reference(y, x, a, b, token_slots):
    out = y.clone().double()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            out[t] += (x[t].double() @ a[s].double().T) @ b[s].double().T
    return out


@pytest.mark.parametrize("token_slots", [[0, 1, -1, 1, 2, 0, -1], [2] * 5, [-1] * 3, [1], []])
def test_batched_lora_reference_adds_each_rows_adapter(token_slots):
    g = torch.Generator().manual_seed(0)
    slots, rank, d_in, d_out = 3, 8, 24, 40
    a, b = torch.randn(slots, rank, d_in, generator=g), torch.randn(slots, d_out, rank, generator=g)
    t = len(token_slots)
    x, y = torch.randn(t, d_in, generator=g), torch.randn(t, d_out, generator=g)
    mapping = LoRAMapping.from_token_slots(torch.tensor(token_slots, dtype=torch.int64))
    want = _loop_reference(y, x, a, b, mapping.token_slots)
    before = y.clone()
    got = BatchedLoRA().forward_native(y, x, a, b, mapping)
    assert got is y  # in place
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    unused = [i for i, s in enumerate(token_slots) if s < 0]
    assert torch.equal(got[unused], before[unused])
    assert sorted(s for s, _ in mapping.groups) == sorted({s for s in token_slots if s >= 0})
    if len(set(token_slots)) == 1 and token_slots[0] >= 0:
        assert mapping.groups[0][1] is None  # every row on one slot: no index gather


def test_lora_mapping_wants_int64_rows():
    with pytest.raises(ValueError, match="1-D int64"):
        LoRAMapping.from_token_slots(torch.tensor([0, 1], dtype=torch.int32))
