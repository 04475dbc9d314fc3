"""The models a server answers to: the base model's names and the LoRA adapters loaded on it.

A request's ``model`` is the base model (a served name, or the model as given to ``loom serve``)
or an adapter's name. Adapters come from ``--lora-modules`` at start-up, from
``POST /v1/load_lora_adapter`` and, for a name nobody loaded, from the LoRA resolvers that general
plugins registered (both only with ``LOOM_ALLOW_RUNTIME_LORA_UPDATING=1``). Every adapter is
checked here (its config and safetensors header against the model, on a thread: it reads files)
before it is named, so a broken one is a 400 naming the problem and never reaches the engine.
Each gets an id from this server's counter; ids are never reused, so the engine's prefix cache
and the workers' loaded weights can never mistake a reloaded adapter for the one before it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Sequence

from loom_plugin_api.lora import LoRARequest, lora_resolver_registry

from ... import envs
from ...config import LoomConfig
from ...config.server import LoRAModulePath
from ...logger import init_logger
from ...lora.peft import LoRAAdapterError, check_adapter
from .protocol import ModelCard
from .serving_engine import APIError

logger = init_logger(__name__)

__all__ = ["OpenAIServingModels"]


class OpenAIServingModels:
    def __init__(self, config: LoomConfig, base_model_names: Sequence[str], aliases: set[str] | None = None) -> None:
        self.base_model_names = list(base_model_names)
        self.aliases = set(aliases or ())
        self.lora_config = config.lora_config
        self.hf_config = config.model_config.hf_config
        self.max_model_len = config.model_config.max_model_len
        self.lora_requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._resolving: dict[str, asyncio.Future[LoRARequest]] = {}
        """Names being resolved now, and the one resolution each that its requests await."""
        self.runtime_updates = bool(envs.LOOM_ALLOW_RUNTIME_LORA_UPDATING)
        """Load/unload routes and resolvers (read once, when the app is built)."""

    def is_base_model(self, name: str | None) -> bool:
        return name is None or name in self.base_model_names or name in self.aliases

    # ---- adapters -------------------------------------------------------------------------
    def _checked(self, name: str, path: str) -> LoRARequest:
        """Check an adapter and give it the next id (runs on a thread)."""
        if not self.lora_config.enable_lora:
            raise APIError(f"cannot load LoRA adapter {name!r}: the server runs without LoRA; start it with "
                           "--enable-lora", param="lora_name")
        if self.is_base_model(name):
            raise APIError(f"{name!r} is the base model's name; give the adapter another one", param="lora_name")
        try:
            check_adapter(path, self.hf_config, self.lora_config.max_lora_rank, name=name)
        except LoRAAdapterError as e:
            raise APIError(str(e), param="lora_path") from None
        # absolute: every process of the serve reads it, whatever its working directory
        return LoRARequest(name, next(self._ids), os.path.abspath(path))

    def add_startup_adapters(self, modules: Sequence[LoRAModulePath]) -> None:
        """``--lora-modules``: each checked now; a broken one stops the start-up (ValueError)."""
        for module in modules:
            if module.name in self.lora_requests:
                raise ValueError(f"--lora-modules names adapter {module.name!r} twice")
            try:
                self.lora_requests[module.name] = self._checked(module.name, module.path)
            except APIError as e:
                raise ValueError(e.message) from None
            logger.info("LoRA adapter %r from %s", module.name, module.path)

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        if name in self.lora_requests:
            raise APIError(f"LoRA adapter {name!r} is already loaded; unload it first to load another under that "
                           "name", param="lora_name")
        request = await asyncio.to_thread(self._checked, name, path)
        if name in self.lora_requests:  # another load of the name finished while this one was checked
            raise APIError(f"LoRA adapter {name!r} is already loaded", param="lora_name")
        self.lora_requests[name] = request
        logger.info("Loaded LoRA adapter %r (id %d) from %s", name, request.lora_int_id, path)
        return request

    def unload_lora_adapter(self, name: str) -> None:
        if self.lora_requests.pop(name, None) is None:
            raise APIError(f"LoRA adapter {name!r} is not loaded; loaded: {', '.join(self.lora_requests) or 'none'}",
                           status=404, param="lora_name", code="model_not_found")
        logger.info("Unloaded LoRA adapter %r", name)

    # ---- a request's model ----------------------------------------------------------------
    def _not_found(self, name: str) -> APIError:
        served = [*self.base_model_names, *self.lora_requests]
        return APIError(f"The model `{name}` does not exist. Served: {', '.join(served)}", status=404,
                        param="model", code="model_not_found")

    def known(self, name: str | None) -> bool:
        """Whether ``name`` is served now without asking a resolver."""
        return self.is_base_model(name) or name in self.lora_requests

    def check_known(self, name: str | None) -> None:
        """404 for a name that is neither served nor resolvable."""
        if not self.known(name) and not (self.runtime_updates and lora_resolver_registry.get_supported_resolvers()):
            raise self._not_found(str(name))

    async def lora_for(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model), asking the resolvers
        in order for a name nobody loaded. One resolution per name at a time: requests for a name
        being resolved share its outcome (a waiter that goes away does not cancel it)."""
        if self.is_base_model(name):
            return None
        assert name is not None
        known = self.lora_requests.get(name)
        if known is not None:
            return known
        if not self.runtime_updates:
            raise self._not_found(name)
        task = self._resolving.get(name)
        if task is None:
            task = asyncio.ensure_future(self._resolve(name))
            self._resolving[name] = task
            task.add_done_callback(lambda _: self._resolving.pop(name, None))
        return await asyncio.shield(task)

    async def _resolve(self, name: str) -> LoRARequest:
        for resolver_name in lora_resolver_registry.get_supported_resolvers():
            resolver = lora_resolver_registry.get_resolver(resolver_name)
            try:
                found = await resolver.resolve_lora(self.base_model_names[0], name)
            except Exception as e:
                logger.exception("LoRA resolver %r failed for %r", resolver_name, name)
                raise APIError(f"LoRA resolver {resolver_name!r} failed for {name!r}: {type(e).__name__}: {e}",
                               status=500, type="server_error") from None
            if found is not None:
                known = self.lora_requests.get(name)  # loaded through the endpoint meanwhile
                if known is not None:
                    return known
                request = await self.load_lora_adapter(name, found.lora_path)
                logger.info("LoRA resolver %r found adapter %r", resolver_name, name)
                return request
        raise self._not_found(name)

    def model_cards(self) -> list[ModelCard]:
        base = self.base_model_names[0]
        cards = [ModelCard(id=name, root=base, max_model_len=self.max_model_len) for name in self.base_model_names]
        cards += [ModelCard(id=name, root=name, parent=base, max_model_len=self.max_model_len)
                  for name in self.lora_requests]
        return cards
