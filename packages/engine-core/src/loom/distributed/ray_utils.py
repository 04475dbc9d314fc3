"""What the Ray executor needs from Ray, in one place: the cluster, the placement group, and
the software fingerprint every rank must share with the engine.

The driver (the engine core, or the process of ``loom.LLM``) imports Ray with
``RAY_DEDUP_LOGS=0`` (``loom.config.parallel.RAY_DRIVER_ENV``) unless the operator set it: Ray would otherwise fold
identical lines of several ranks into one ("[repeated 2x across cluster]"), hiding a rank's
start-up lines. Ray reads it once, when it is imported.

Ray is optional (``pip install 'loom-engine[ray]'``): only the Ray executor and its actors
import this module, and it imports ``ray`` itself.
"""

from __future__ import annotations

import sys
import time
from importlib import metadata
from typing import Any

import ray
from loom_plugin_api import GENERAL_PLUGINS_GROUP, PLATFORM_PLUGINS_GROUP, plugin_records
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from ..logger import init_logger

logger = init_logger(__name__)


# ---- one software on every node ------------------------------------------------------------
def fingerprint() -> dict[str, str]:
    """What must be the same in the engine and in every rank: the resolved platform, loom, the
    plugin contract, every plugin distribution loaded in this process, torch and Python."""
    from ..platforms import current_platform  # lazy: resolving the platform is the caller's first act

    found = {
        "platform": f"{type(current_platform).__module__}.{type(current_platform).__qualname__}",
        "loom-engine": metadata.version("loom-engine"),
        "loom-plugin-api": metadata.version("loom-plugin-api"),
        "torch": metadata.version("torch"),
        "python": ".".join(map(str, sys.version_info[:3])),
    }
    for record in plugin_records():
        # the groups every process of a serve loads (not those only the front end or a tool loads)
        if record.group in (PLATFORM_PLUGINS_GROUP, GENERAL_PLUGINS_GROUP) and record.status == "loaded" \
                and record.distribution:
            found[f"plugin {record.distribution}"] = record.version or "?"
    return found


def differences(driver: dict[str, str], here: dict[str, str]) -> list[str]:
    """Each entry that differs, as ``what: engine X, this node Y`` (sorted, for a stable message)."""
    return [f"{key}: engine {driver.get(key, 'absent')}, this node {here.get(key, 'absent')}"
            for key in sorted(driver.keys() | here.keys()) if driver.get(key) != here.get(key)]


class NodeMismatchError(RuntimeError):
    """A rank's node resolved another platform or runs other versions than the engine."""


# ---- the cluster -----------------------------------------------------------------------------
def connect(address: str | None) -> None:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``, which Ray reads itself); with neither,
    a running local cluster, else a new local one, saying so."""
    if ray.is_initialized():
        return
    if address is not None:
        ray.init(address=address, log_to_driver=True)
    else:
        try:
            ray.init(address="auto", log_to_driver=True)
        except ConnectionError:
            ray.init(log_to_driver=True)
            logger.warning("No Ray cluster is running here (RAY_ADDRESS unset, no --ray-address): started a local "
                           "one with %s CPUs; join other machines with `ray start --address=...` first to use them",
                           ray.cluster_resources().get("CPU", 0))
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    logger.info("Joined the Ray cluster: %d node(s), resources %s", len(nodes), _short(ray.cluster_resources()))


def _short(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items())
                     if not k.startswith(("node:", "memory", "object_store_memory", "accelerator_type")))


def bundle_options(device_key: str) -> dict[str, Any]:
    """The actor options that take one unit of ``device_key`` from its bundle."""
    if device_key == "CPU":
        return {"num_cpus": 1}
    if device_key == "GPU":
        return {"num_cpus": 0, "num_gpus": 1}
    return {"num_cpus": 0, "resources": {device_key: 1}}


def create_placement_group(world_size: int, device_key: str, strategy: str, timeout: float) -> PlacementGroup:
    """One bundle of one ``device_key`` per rank; ready within ``timeout`` s, or an error that
    says what each node has and what is missing."""
    bundles = [{device_key: 1.0} for _ in range(world_size)]
    group = placement_group(bundles, strategy=strategy, name=f"loom-{time.time_ns()}")
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if ready:
        return group
    remove_placement_group(group)
    raise RuntimeError(
        f"the Ray cluster did not give {world_size} rank(s) one {device_key} each ({strategy}) within {timeout:g} s "
        f"(--ray-placement-timeout). {describe_nodes(device_key, world_size, strategy)}")


def describe_nodes(device_key: str, world_size: int, strategy: str) -> str:
    """Per alive node: how much of ``device_key`` it has and how much is free now."""
    free = _available_per_node()
    lines, usable = [], 0
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        total = node["Resources"].get(device_key, 0.0)
        left = free.get(node["NodeID"], {}).get(device_key, 0.0)
        usable += int(left)
        lines.append(f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]}): {device_key} {left:g} free "
                     f"of {total:g}")
    need = (f"{world_size} nodes with 1 {device_key} free each" if strategy == "STRICT_SPREAD"
            else f"{world_size} {device_key} free in all" if strategy != "STRICT_PACK"
            else f"one node with {world_size} {device_key} free")
    return (f"{strategy} needs {need}; the cluster has {len(lines)} node(s): " + "; ".join(lines)
            + (f" ({usable} {device_key} free in all)." if lines else "."))


def _available_per_node() -> dict[str, dict[str, float]]:
    try:
        from ray._private.state import available_resources_per_node  # lazy: a private module, may move

        return available_resources_per_node()
    except Exception:  # a newer Ray without it: totals are still shown, free as 0
        return {}


def bundle_nodes(group: PlacementGroup) -> list[str]:
    """The node id of each bundle, in bundle order."""
    table = ray.util.placement_group_table(group)
    by_index = table["bundles_to_node_id"]
    return [by_index[i] for i in range(len(by_index))]


def node_cpus() -> dict[str, int]:
    """Each alive node's CPUs, by node id."""
    return {n["NodeID"]: int(n["Resources"].get("CPU", 1)) for n in ray.nodes() if n.get("Alive")}
