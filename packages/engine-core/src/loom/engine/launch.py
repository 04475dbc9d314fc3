"""The launch plan: which processes a serve runs, with which environment, built in one place.

The CLI process builds the ``LoomConfig`` once (stops 3-7) and the plan carries it, pickled,
to every child through the supervisor's CONFIG frame. Two shapes, one builder:

* ``loom serve`` / ``loom-supervisor serve``: front end, engine core, one worker per rank.
* ``loom.LLM(tensor_parallel_size=N)``: the workers, and the bridge that stands in for the
  engine core (the engine runs in the caller's process; see :mod:`.supervised`).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
from pathlib import Path

from loom_plugin_api import tracing
from loom_supervisor import Plan, ProcessPlan

from ..config import LoomConfig
from ..config.parallel import RAY_DRIVER_ENV
from ..config.server import ServerConfig
from ..ipc.messages import MESSAGES_VERSION

MAX_FRAME_BYTES = 64 << 20
"""Largest frame the supervisor relays: a SchedulerOutput of a full batch fits many times over."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# libgomp's OpenMP threads spin for GOMP_SPINCOUNT rounds (300,000 by default: about 3 ms at
# the ~10 ns of a PAUSE here) after each parallel region before they sleep. What that costs
# depends on the model. A tiny one's step is mostly Python between small ops, so a worker's
# second thread spins through the whole step on the core the front end, the engine core and
# local clients need: 200 streams of the 2M OPT served 2,816 tok/s with the default spin and
# 4,530 with 1,000 rounds. A real one runs back-to-back regions, and a thread that fell
# asleep between two of them is woken for the next: the default model served 505 tok/s with
# 1,000 rounds and 603 with the default (bench/serve_throughput.py, 2026-12-02, docs/decisions.md).
# So workers of models narrower than SHORT_SPIN_BELOW_HIDDEN spin briefly; the others keep
# libgomp's spin. The operator's own GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
WORKER_GOMP_SPINCOUNT = "1000"
SHORT_SPIN_BELOW_HIDDEN = 512

# A CPU worker of a real model has its OpenMP threads bound one to a core (OMP_PROC_BIND=close;
# OMP_PLACES=cores for a lone worker, whose libgomp takes the cores of the process's affinity
# mask, so taskset and cpusets still decide which; a tensor-parallel rank gets its own share of
# those cores, listed). Every parallel region ends at a barrier, so a thread the kernel moves onto
# a core another of them holds stalls them all; served, the front end, the engine core and local
# clients come and go on those cores. The default model served 64 streams at 762-805 tok/s bound
# against 705-756 unbound, six pairs alternated, offline unchanged; an OPT-125m shape with
# --tensor-parallel-size 2 (one core a rank) 578-600 against 522-541, two pairs. A small model's
# worker is mostly one Python thread, which bound to a core can no longer go where the front end
# and the client leave room: 200 streams of the 2M OPT served 3,629-3,692 tok/s bound against
# 5,451-5,619 (bench/serve_throughput.py, 2026-12-06, docs/decisions.md). So the binding follows
# the model as the spin does. A worker whose operator chose a binding or a thread count (serves
# sharing a machine would be stacked on the same first cores), or set LOOM_CPU_BIND=0 (read from
# the environment the workers get, like the rest), stays unbound.
CPU_BINDING = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
OPERATOR_CHOICE = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_NUM_THREADS",
                   "LOOM_CPU_NUM_THREADS")


def physical_cores(cpus: list[int]) -> list[list[int]]:
    """``cpus`` grouped by physical core (hardware threads of one core together), in order."""
    cores: dict[str, list[int]] = {}
    for cpu in sorted(cpus):
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:  # no topology here: each CPU its own core
            siblings = str(cpu)
        cores.setdefault(siblings, []).append(cpu)
    return list(cores.values())


def worker_env(env: dict[str, str], tp: int, hidden_size: int, device_type: str) -> list[dict[str, str]]:
    """Each rank's environment: a rendezvous address for torch.distributed, a short OpenMP spin
    for small models, OpenMP threads bound to cores for the others on the CPU (a rank's own share
    of them), and a share of the cores each where there are several ranks, so that they do not
    oversubscribe them."""
    wenv = dict(env, LOOM_DIST_INIT_METHOD=f"tcp://127.0.0.1:{_free_port()}")
    if "OMP_WAIT_POLICY" not in wenv and hidden_size < SHORT_SPIN_BELOW_HIDDEN:
        wenv.setdefault("GOMP_SPINCOUNT", WORKER_GOMP_SPINCOUNT)  # a policy the operator chose decides alone
    bind = (device_type == "cpu" and hidden_size >= SHORT_SPIN_BELOW_HIDDEN and wenv.get("LOOM_CPU_BIND", "1") != "0"
            and not any(name in wenv for name in OPERATOR_CHOICE))
    if tp == 1:
        return [dict(wenv, **CPU_BINDING) if bind else wenv]
    # every rank is on this machine: gloo's pairs listen on loopback only, not on every interface
    wenv.setdefault("GLOO_SOCKET_IFNAME", "lo")
    usable = sorted(os.sched_getaffinity(0))  # the CPUs this serve may use (taskset, a cpuset), not the machine's
    per_rank = max(1, len(usable) // tp)
    wenv.setdefault("LOOM_CPU_NUM_THREADS", str(per_rank))
    wenv.setdefault("OMP_NUM_THREADS", str(per_rank))
    cores = physical_cores(usable) if bind else []
    share = len(cores) // tp
    if share == 0:  # not bound, or more ranks than cores
        return [dict(wenv) for _ in range(tp)]
    return [dict(wenv, OMP_PROC_BIND="close",
                 OMP_PLACES=",".join("{" + ",".join(map(str, core)) + "}" for core in cores[r * share:(r + 1) * share]))
            for r in range(tp)]


def build_plan(config: LoomConfig, server: ServerConfig | None = None, *, bridge_socket: str | None = None) -> Plan:
    """The plan of a serve (``server`` given) or of ``loom.LLM``'s workers (``bridge_socket`` given)."""
    if (server is None) == (bridge_socket is None):
        raise ValueError("a launch plan has either a server or a bridge to the caller's engine")
    python = sys.executable
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("LOOM_API_KEY", None)  # the front end alone gets it (below), never on a command line
    processes: list[ProcessPlan] = []
    if server is not None:
        frontend_env = dict(env, **({"LOOM_API_KEY": server.api_key} if server.api_key else {}))
        processes.append(ProcessPlan(role="frontend", env=frontend_env,
                                     argv=[python, "-m", "loom.entrypoints.frontend", *server.to_argv()]))
        core_env = {**RAY_DRIVER_ENV, **env} if config.parallel_config.uses_ray else env
        processes.append(ProcessPlan(role="engine_core", env=core_env, argv=[
            python, "-m", "loom.engine.core_proc", f"--step-timeout={server.step_timeout}"]))
    else:
        processes.append(ProcessPlan(role="engine_core", env=dict(env, LOOM_BRIDGE_SOCKET=str(bridge_socket)),
                                     argv=[python, "-m", "loom.engine.bridge"]))
    tp = config.parallel_config.tensor_parallel_size
    if not config.parallel_config.uses_ray:  # on Ray the engine core starts the ranks as actors
        wenvs = worker_env(env, tp, config.model_config.get_hidden_size(), config.device_config.device_type)
        processes += [ProcessPlan(role="worker", rank=rank, env=wenvs[rank],
                                  argv=[python, "-m", "loom.worker.proc", "--rank", str(rank)])
                      for rank in range(tp)]
    limits = server or ServerConfig()  # the workers of loom.LLM run under the server's default limits
    return Plan(
        processes=processes,
        config=pickle.dumps(config),
        startup_timeout_s=float(limits.startup_timeout),
        grace_period_s=float(limits.grace_period),
        max_frame_bytes=MAX_FRAME_BYTES,
        heartbeat_timeout_s=float(limits.heartbeat_timeout),
        ready_url=server.ready_url if server is not None else None,
        messages_version=MESSAGES_VERSION,
        # the supervisor adds its spawn, HELLO, CONFIG and READY times to a traced start-up
        startup_trace_dir=os.environ.get(tracing.TRACE_DIR_ENV) if tracing.enabled() else None,
    )
