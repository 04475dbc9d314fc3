"""The filesystem LoRA resolver: adapters found by name in one directory.

With ``LOOM_LORA_RESOLVER_CACHE_DIR=/srv/adapters`` (and ``LOOM_ALLOW_RUNTIME_LORA_UPDATING=1``
for the front end to ask resolvers at all), a request whose ``model`` is ``sql-expert`` is served
by the PEFT adapter in ``/srv/adapters/sql-expert`` when that directory holds an
``adapter_config.json`` of a LoRA adapter. A name is one path component: a name that is empty,
``.``/``..``, holds a separator, or leads (through a symlink) outside the directory is refused.

:func:`register` is the plugin's entry point (``lora_filesystem_resolver``): it registers the
resolver only when the variable is set, and stops start-up (of the CLI and the front end, the
processes that read it) when it names no directory.
"""

from __future__ import annotations

import asyncio
import json
import os

from loom_plugin_api.lora import LoRARequest, LoRAResolver, lora_resolver_registry

from ... import envs
from ...logger import init_logger
from ..peft import ADAPTER_CONFIG

logger = init_logger(__name__)

__all__ = ["FilesystemResolver", "register"]

RESOLVER_NAME = "lora_filesystem_resolver"


class FilesystemResolver(LoRAResolver):
    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)

    def adapter_dir(self, lora_name: str) -> str | None:
        """The directory of adapter ``lora_name`` under the root, None if the name is not a plain
        name or leads elsewhere."""
        if not lora_name or lora_name in (".", "..") or "/" in lora_name or "\\" in lora_name or "\0" in lora_name:
            return None
        path = os.path.realpath(os.path.join(self.root, lora_name))
        if os.path.dirname(path) != self.root:
            return None
        return path

    def _find(self, lora_name: str) -> str | None:
        path = self.adapter_dir(lora_name)
        if path is None:
            logger.warning("LoRA filesystem resolver: refused the name %s (it is not a name in %s)", ascii(lora_name),
                           self.root)
            return None
        try:
            with open(os.path.join(path, ADAPTER_CONFIG), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict) or config.get("peft_type") != "LORA":
            return None
        return path

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        path = await asyncio.to_thread(self._find, lora_name)
        return None if path is None else LoRARequest(lora_name, 1, path)


def register() -> None:
    root = envs.LOOM_LORA_RESOLVER_CACHE_DIR
    if not root:
        return
    if not os.path.isdir(root):
        if os.environ.get("LOOM_ROLE", "frontend") != "frontend":
            return  # only the front end resolves; a worker's node need not have the directory
        raise ValueError(f"LOOM_LORA_RESOLVER_CACHE_DIR={root!r} is not a directory; create it or unset the variable")
    if RESOLVER_NAME not in lora_resolver_registry.get_supported_resolvers():
        lora_resolver_registry.register_resolver(RESOLVER_NAME, FilesystemResolver(root))
