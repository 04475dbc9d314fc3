"""The conformance kit: loom's checks of a platform plugin, run by its vendor.

``pip install "loom-plugin-api[testing]"`` installs the kit's pytest plugin (entry point
group ``pytest11``); then::

    pytest --pyargs loom_plugin_api.testing --loom-platform NAME [-m "static or config or ops"]
           [--loom-report report.json]

runs it against the installed platform whose detector is ``NAME`` (the names ``loom plugins``
lists; ``loom plugins check NAME`` runs the same). The tiers are markers:

================  ==============================================================================
``static``        the entry point loads; the detector answers a qualified name or None, the same
                  each time and in a fresh interpreter; the distribution's contract range holds
                  the installed contract; hook signatures; returned names import and subclass
``config``        ``check_and_update_config`` sets ``worker_cls``, is idempotent, rejects a dtype
                  the platform does not declare; ``update_block_size_for_backend``
``ops``           every replaced op (``register_oot`` class or ``register_kernel`` kernel) against
                  ``forward_native`` over shapes and the declared dtypes
``attention``     the backend against a reference paged attention: prefill, decode, chunked
                  prefill over a cached prefix, GQA, block boundaries
``communicator``  two ranks: ``all_reduce``, ``all_gather``, ``broadcast``
``worker``        tiny Llama and OPT built by the kit: the worker lifecycle, greedy tokens equal
                  HF transformers', no process left (needs loom-engine)
``serve``         ``loom serve``: a completion and a chat completion through ``openai``, exit 0 on
                  SIGTERM (needs loom-engine)
================  ==============================================================================

What the platform does not claim (``supports_tensor_parallel``, ``supported_dtypes``) skips
with the reason. Only the worker and serve tiers import the engine (lazily).
"""

from __future__ import annotations

from .tiers import TIERS

__all__ = ["TIERS"]
