"""The executor whose ranks are Ray actors, on the nodes of a Ray cluster.

Start-up: join the cluster, reserve one bundle of the platform's ``ray_device_key`` per rank
(a placement group, ``--ray-placement-strategy``), start one :class:`~loom.worker.ray_actor.RayWorker`
per bundle, and have each run a worker process's start-up after checking that its node runs
the engine's software. ``torch.distributed`` meets at rank 0's node. The KV cache is sized from
the smallest offer, as with worker processes. Each step sends the same ``SchedulerOutput`` to
every rank and returns rank 0's output.

Deaths: each actor holds a ``watch`` call open; a thread waits on them all, and the first
that fails (the actor's process killed, its node lost, ``ray.kill``) is a death, reported
once through ``on_death`` (the engine core passes it to the supervisor) and raised by the
step that needs the actor. ``shutdown`` kills every actor and removes the placement group.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from loom_plugin_api.step import ModelRunnerOutput, SchedulerOutput
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .. import platforms
from ..config import LoomConfig
from ..distributed import ray_utils
from ..logger import init_logger
from ..worker.ray_actor import RayWorker
from .errors import EngineFatalError, StepTimeoutError, WorkerStepError
from .executor import Executor, size_kv_cache

logger = init_logger(__name__)

PROCESS_IDENTITY = ("LOOM_ROLE", "LOOM_RANK", "LOOM_SUPERVISOR_SOCKET")
"""Variables the supervisor sets for the process it spawned: never passed on to a rank."""

STARTUP_TIMEOUT_S = 600.0
"""A rank's whole start-up (plugins, model load) may take this long."""


@dataclass(frozen=True, slots=True)
class RankDeath:
    """Which rank died, where, and why (Ray's words)."""

    rank: int
    pid: int
    node_ip: str
    cause: str
    log_tail: tuple[str, ...] = ()
    """The last lines the actor wrote to stderr (from its node, through Ray's state API)."""

    def describe(self) -> str:
        return f"worker:{self.rank} (pid {self.pid} on node {self.node_ip}) died: {self.cause}"


class RankDiedError(EngineFatalError):
    """A rank's actor died; the engine cannot go on."""


class RayExecutor(Executor):
    def __init__(self, config: LoomConfig, step_timeout: float | None = None,
                 on_death: Callable[[RankDeath], None] | None = None) -> None:
        self.config = config
        self.step_timeout = step_timeout or None
        self.on_death = on_death
        self.actors: list[Any] = []
        self.group: Any = None
        self._death: RankDeath | None = None
        self._death_lock = threading.Lock()
        self._closing = False
        self._healthy = False
        """True from the end of start-up until a step times out: only then can the ranks take a
        graceful ``shutdown`` call (an actor stuck in a step would never run it)."""
        parallel = config.parallel_config
        ray_utils.connect(parallel.ray_address)
        device_key = platforms.current_platform.ray_device_key
        try:
            self.group = ray_utils.create_placement_group(
                parallel.world_size, device_key, parallel.ray_placement_strategy, parallel.ray_placement_timeout)
            self._start(device_key)
        except BaseException:  # Ctrl-C included: the cluster gets its resources back
            self.shutdown()
            raise
        self._healthy = True

    @property
    def died(self) -> bool:
        """Whether a rank's death was recorded (and reported through ``on_death``)."""
        return self._death is not None

    # ---- start-up ----------------------------------------------------------------------------
    def _start(self, device_key: str) -> None:
        config, world = self.config, self.config.parallel_config.world_size
        nodes = ray_utils.bundle_nodes(self.group)
        ranks_on = Counter(nodes)
        cpus = ray_utils.node_cpus()
        for rank, node in enumerate(nodes):
            # the operator's LOOM_* settings; not this process's identity, which the supervisor set for it
            env = {k: v for k, v in os.environ.items() if k.startswith("LOOM_") and k not in PROCESS_IDENTITY}
            env.update(LOOM_ROLE="worker", LOOM_RANK=str(rank))
            # the node's cores shared by its ranks, unless the operator said otherwise
            env.setdefault("LOOM_CPU_NUM_THREADS", str(max(1, cpus.get(node, 1) // ranks_on[node])))
            self.actors.append(RayWorker.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank),
                runtime_env={"env_vars": env}, name=None, **ray_utils.bundle_options(device_key),
            ).remote(rank))
        self.where = self._get([a.where.remote() for a in self.actors], STARTUP_TIMEOUT_S, "start")
        for rank, w in enumerate(self.where):
            logger.info("worker:%d is pid %d on node %s", rank, w["pid"], w["ip"])
        init_method = None
        if world > 1:
            port = self._get([self.actors[0].free_port.remote()], STARTUP_TIMEOUT_S, "start")[0]
            init_method = f"tcp://{self.where[0]['ip']}:{port}"
            logger.info("The ranks meet at %s (rank 0's node)", init_method)
        fingerprint = ray_utils.fingerprint()
        local_ranks = [nodes[:rank].count(node) for rank, node in enumerate(nodes)]  # index among its node's ranks
        infos = self._get([a.start.remote(config, init_method, fingerprint, local_ranks[rank])
                           for rank, a in enumerate(self.actors)], STARTUP_TIMEOUT_S, "start")
        self.num_blocks = size_kv_cache(config, infos)
        self._get([a.allocate.remote(self.num_blocks) for a in self.actors], STARTUP_TIMEOUT_S, "start")
        self._watches = {a.watch.remote(): rank for rank, a in enumerate(self.actors)}
        threading.Thread(target=self._watch, name="loom-ray-watch", daemon=True).start()
        logger.info("%d Ray worker(s) allocated %d KV-cache blocks of %d tokens", world, self.num_blocks,
                    config.cache_config.block_size)

    # ---- steps -------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._death is not None:
            raise RankDiedError(self._death.describe())
        refs = [a.execute_model.remote(scheduler_output) for a in self.actors]
        return self._get(refs, self.step_timeout, "step")[0]

    def _get(self, refs: list[Any], timeout: float | None, phase: str) -> list[Any]:
        """``ray.get`` with loom's errors: a rank's exception is a failed step (or start-up), a dead
        actor is fatal and reported, time up is a stuck step."""
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            self._healthy = False
            if phase == "step":
                raise StepTimeoutError(
                    f"a model step has run {timeout:g} s without the ranks' output (--step-timeout): a Ray worker "
                    "is stuck in the step although its actor lives; stopping") from None
            raise RuntimeError(f"the Ray workers did not finish start-up within {timeout:g} s") from None
        except (RayActorError, RayTaskError) as e:
            dead = _dead_rank(refs)
            if dead is not None:
                rank, why = dead
                if phase == "start":
                    raise RuntimeError(f"worker:{rank} died during start-up: {why}") from None
                raise RankDiedError(self._record_death(rank, why).describe()) from None
            if phase == "step" and len(self.actors) > 1:
                silent = self._silent_rank()
                if silent is not None:
                    why = (f"it does not answer within {PROBE_TIMEOUT_S:g} s after its partners' collective failed: "
                           "its node is probably lost (Ray has not declared it dead yet)")
                    raise RankDiedError(self._record_death(silent, why).describe()) from None
            cause = e.cause if isinstance(e, RayTaskError) and isinstance(e.cause, BaseException) else e
            if phase == "start":
                if isinstance(cause, ray_utils.NodeMismatchError):
                    raise cause from None
                raise RuntimeError(f"a Ray worker failed to start: {type(cause).__name__}: {cause}") from None
            raise WorkerStepError(f"{type(cause).__name__}: {cause}") from None

    # ---- deaths ------------------------------------------------------------------------------
    def _silent_rank(self) -> int | None:
        """After a failed step of several ranks: the first rank that does not answer a trivial
        call. A lost node's actor is declared dead by Ray only after its health checks (over
        ten seconds); its partners' collective fails at once, and so does this probe."""
        probes = [a.where.remote() for a in self.actors]
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=PROBE_TIMEOUT_S)
        answered = set(ready)
        return next((rank for rank, ref in enumerate(probes) if ref not in answered), None)

    def _watch(self) -> None:
        try:
            self._watch_until_a_death()
        except Exception as e:  # Ray itself went away under us (the driver shut it down)
            if not self._closing:
                logger.warning("Stopped watching the Ray workers: %s: %s", type(e).__name__, _first_line(e))

    def _watch_until_a_death(self) -> None:
        pending = list(self._watches)
        while pending and not self._closing:
            done, pending = ray.wait(pending, num_returns=1, timeout=None)
            for ref in done:
                rank = self._watches[ref]
                try:
                    ray.get(ref)
                except ActorUnavailableError:  # unreachable for now (a network blip): watch again
                    actors = self.actors  # shutdown may empty it meanwhile
                    if not self._closing and rank < len(actors):
                        again = actors[rank].watch.remote()
                        self._watches[again] = rank
                        pending.append(again)
                except Exception as e:  # the actor died (the watch returns normally only on shutdown)
                    if not self._closing:
                        self._record_death(rank, _first_line(e))
                        return

    def _record_death(self, rank: int, cause: str) -> RankDeath:
        with self._death_lock:
            if self._death is None and not (self._closing and not self.actors):
                where = self.where[rank]  # deaths are recorded once started (start-up raises instead)
                actors = self.actors  # shutdown may empty the list meanwhile
                tail = _log_tail(actors[rank], where["node_id"]) if rank < len(actors) else ()
                self._death = RankDeath(rank=rank, pid=where["pid"], node_ip=where["ip"], cause=cause, log_tail=tail)
                logger.error("%s", self._death.describe())
                if self.on_death is not None:
                    self.on_death(self._death)
            return self._death or RankDeath(rank=rank, pid=0, node_ip="?", cause=cause)

    # ---- the end -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every rank and give the cluster its resources back (also after a death)."""
        self._closing = True
        if self.actors and self._healthy and self._death is None:
            try:
                ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
            except Exception as e:
                logger.warning("Ray workers did not shut down cleanly: %s", _first_line(e))
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:
                pass  # already gone
        self.actors = []
        if self.group is not None:
            try:
                remove_placement_group(self.group)
            except Exception as e:
                logger.warning("Could not remove the placement group: %s", _first_line(e))
            self.group = None


PROBE_TIMEOUT_S = 2.0
"""How long a rank whose thread is free may take to answer a trivial call before it is taken for lost."""

DEATH_SETTLE_S = 2.0
"""When a rank dies its partners' calls fail too (their collective lost a member), often first:
how long to wait for every call of the step to end before deciding which failure is the death."""


def _dead_rank(refs: list[Any]) -> tuple[int, str] | None:
    """The first rank (the index in ``refs``) whose call failed because its actor died, and why."""
    ray.wait(refs, num_returns=len(refs), timeout=DEATH_SETTLE_S)
    for rank, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=0)
        except RayActorError as e:
            return rank, _first_line(e)
        except Exception:  # its own error, or still running
            continue
    return None


def _first_line(e: BaseException) -> str:
    """The sentence of Ray's error that says why: 'The actor is dead because ...' up to its advice."""
    text = str(e).strip()
    lines = [line.strip() for line in text.splitlines()]
    for marker in ("is dead because", "died", "dead", "killed"):
        line = next((ln for ln in lines if marker in ln), None)
        if line is not None:
            return line.split(" Some common causes")[0]
    return lines[0] if lines else type(e).__name__


LOG_TAIL_LINES = 20


def _log_tail(actor: Any, node_id: str) -> tuple[str, ...]:
    """The actor's last stderr lines, read from its node's log by Ray's state API (the node
    must be alive; otherwise one line says why there are none)."""
    if not any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes()):
        return ("(its node is gone from the cluster: its log could not be read)",)
    try:
        from ray.util.state import get_log  # lazy: needs ray[default]'s state API, only after a death

        chunks = get_log(actor_id=actor._actor_id.hex(), tail=LOG_TAIL_LINES + 2, suffix="err", timeout=1)
        lines = [ln for chunk in chunks for ln in chunk.splitlines() if ln and not ln.startswith(":")]
        return tuple(lines[-LOG_TAIL_LINES:])
    except Exception as e:
        return (f"(its log could not be read from its node: {type(e).__name__}: {_first_line(e)})",)
