"""LoRA adapters: how a request names one, and how plugins find adapters by name.

A :class:`LoRARequest` travels with a request from the front end to every worker: the adapter's
name (what clients send as ``model``), an integer id unique within a serve (the engine keys its
KV-cache prefixes and the workers their loaded weights by it), and the directory that holds it in
the PEFT format (``adapter_config.json`` and ``adapter_model.safetensors``).

Resolvers let the front end find an adapter that nobody loaded when a request names it. A
general plugin registers one from its entry point (it runs in every process, so register only
what the process can use, typically when an environment variable configures it)::

    from loom_plugin_api.lora import LoRAResolver, LoRARequest, lora_resolver_registry

    class HubResolver(LoRAResolver):
        async def resolve_lora(self, base_model_name, lora_name):
            path = await download(lora_name)        # never block the event loop
            return None if path is None else LoRARequest(lora_name, 1, path)  # the server gives the id

    def register() -> None:                           # the plugin's entry point
        lora_resolver_registry.register_resolver("hub", HubResolver())

With ``LOOM_ALLOW_RUNTIME_LORA_UPDATING=1``, a request naming an unknown model asks the
resolvers in the order they registered; the first ``LoRARequest`` returned is checked, loaded
under the requested name with an id the server assigns (the resolver's ``lora_int_id`` is
ignored), and serves the request. Nothing here imports torch.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from .errors import PluginError

__all__ = ["LoRARequest", "LoRAResolver", "LoRAResolverRegistry", "lora_resolver_registry"]


@dataclass(slots=True, kw_only=False)
class LoRARequest:
    """One adapter: ``LoRARequest(lora_name, lora_int_id, lora_path)``.

    ``lora_int_id`` is >= 1 and names one adapter for the engine's life: the same id with another
    name or path is refused. ``lora_path`` is a directory in the PEFT format.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must be a non-empty string, got {self.lora_path!r}")


class LoRAResolver(abc.ABC):
    """Finds an adapter by name at request time."""

    @abc.abstractmethod
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """The adapter called ``lora_name`` for the served model ``base_model_name``, or None when
        this resolver does not know it. Runs on the front end's event loop: do blocking work (a
        download, a scan of a large directory) in a thread. Raising makes the request fail with a
        500 naming the resolver; return None for "not found"."""


class LoRAResolverRegistry:
    """The resolvers of this process, by name, in the order they registered."""

    def __init__(self) -> None:
        self._resolvers: dict[str, LoRAResolver] = {}

    def register_resolver(self, name: str, resolver: LoRAResolver) -> None:
        """Add ``resolver`` under ``name``; a name registered twice is an error (two plugins
        picked the same one)."""
        if not isinstance(resolver, LoRAResolver):
            raise PluginError(f"LoRA resolver {name!r} must be a LoRAResolver instance, got "
                              f"{type(resolver).__name__}")
        if name in self._resolvers:
            raise PluginError(f"a LoRA resolver named {name!r} is already registered "
                              f"({type(self._resolvers[name]).__qualname__}); choose another name")
        self._resolvers[name] = resolver

    def get_resolver(self, name: str) -> LoRAResolver:
        try:
            return self._resolvers[name]
        except KeyError:
            raise KeyError(f"no LoRA resolver named {name!r}; registered: {', '.join(self._resolvers) or 'none'}") \
                from None

    def get_supported_resolvers(self) -> list[str]:
        """Names of the registered resolvers, in the order they are asked."""
        return list(self._resolvers)

    def unregister_resolver(self, name: str) -> None:
        """Remove one (tests; a plugin never needs it)."""
        self._resolvers.pop(name, None)


lora_resolver_registry = LoRAResolverRegistry()
"""This process's registry; general plugins register their resolvers on it."""
