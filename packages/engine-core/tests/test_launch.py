"""The launch plan: one builder for ``loom serve`` and ``loom.LLM``'s workers, and the server flags
the front end parses back from the plan exactly as ``loom serve`` parsed them."""

from __future__ import annotations

import argparse
import os
import pickle
import re
from types import SimpleNamespace

import pytest
from loom.config.server import ServerConfig
from loom.engine import launch
from loom.engine.launch import build_plan
from loom.ipc.messages import MESSAGES_VERSION
from loom_supervisor import Plan


class _ModelConfig(SimpleNamespace):
    def get_hidden_size(self) -> int:
        return self.hidden_size


def config(tp: int, hidden_size: int = 128, uses_ray: bool = False, device_type: str = "cpu") -> SimpleNamespace:
    """Just what the plan reads (the plan pickles it, so no lambdas)."""
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp, uses_ray=uses_ray),
                           model_config=_ModelConfig(hidden_size=hidden_size),
                           device_config=SimpleNamespace(device_type=device_type))


def parse(argv: list[str]) -> ServerConfig:
    return ServerConfig.from_cli_args(ServerConfig.add_cli_args(argparse.ArgumentParser()).parse_args(argv))


def test_server_flags_survive_the_plan(monkeypatch) -> None:
    monkeypatch.delenv("LOOM_API_KEY", raising=False)
    server = parse(["--host", "0.0.0.0", "--port", "8123", "--grace-period", "2.5", "--stream-interval", "4",
                    "--chat-template", "{{ messages }}", "--api-key", "sk-secret"])
    plan = build_plan(config(2), server)
    assert isinstance(plan, Plan) and plan.messages_version == MESSAGES_VERSION
    frontend, engine_core, *workers = plan.processes
    assert (frontend.role, engine_core.role) == ("frontend", "engine_core")
    assert [(w.role, w.rank) for w in workers] == [("worker", 0), ("worker", 1)]
    # the front end parses its argv with the same parser: the same config, the key from its environment
    monkeypatch.setenv("LOOM_API_KEY", frontend.env["LOOM_API_KEY"])
    assert parse(list(frontend.argv[3:])) == server
    assert not any("sk-secret" in arg for p in plan.processes for arg in p.argv)
    assert all("LOOM_API_KEY" not in p.env for p in plan.processes[1:])
    assert plan.ready_url == "http://127.0.0.1:8123"
    assert (plan.grace_period_s, plan.startup_timeout_s) == (2.5, 300.0)
    assert pickle.loads(plan.config).parallel_config.tensor_parallel_size == 2


def test_llm_workers_plan_has_the_bridge_and_no_server() -> None:
    plan = build_plan(config(2), bridge_socket="/tmp/x.sock")
    assert [(p.role, p.argv[-1]) for p in plan.processes[:1]] == [("engine_core", "loom.engine.bridge")]
    assert plan.processes[0].env["LOOM_BRIDGE_SOCKET"] == "/tmp/x.sock"
    assert [p.role for p in plan.processes[1:]] == ["worker", "worker"]
    assert plan.ready_url is None and plan.messages_version == MESSAGES_VERSION
    # every worker of one plan meets at the same rendezvous
    assert len({p.env["LOOM_DIST_INIT_METHOD"] for p in plan.processes[1:]}) == 1


def test_a_plan_has_a_server_or_a_bridge() -> None:
    with pytest.raises(ValueError, match="either a server or a bridge"):
        build_plan(config(1))
    with pytest.raises(ValueError, match="either a server or a bridge"):
        build_plan(config(1), ServerConfig(), bridge_socket="/tmp/x.sock")


def test_stream_interval_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        parse(["--stream-interval", "0"])


@pytest.mark.parametrize(("operator", "hidden", "want"), [
    ({}, 128, "1000"),  # loom's short spin for a small model
    ({}, 576, None),  # libgomp's own spin for a real one (the default model's width)
    ({"GOMP_SPINCOUNT": "50"}, 128, "50"),  # the operator's count wins
    ({"GOMP_SPINCOUNT": "50"}, 4096, "50"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, 128, None),  # so does a wait policy: no count is added beside it
])
def test_workers_of_small_models_spin_briefly_unless_the_operator_says(monkeypatch, operator, hidden, want) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    for name, value in operator.items():
        monkeypatch.setenv(name, value)
    plan = build_plan(config(2, hidden), ServerConfig())
    workers = [p for p in plan.processes if p.role == "worker"]
    assert [p.env.get("GOMP_SPINCOUNT") for p in workers] == [want, want]
    assert all("GOMP_SPINCOUNT" not in p.env or operator for p in plan.processes if p.role != "worker")


@pytest.mark.parametrize(("tp", "hidden", "device_type", "operator", "bound"), [
    (1, 576, "cpu", {}, True),  # the default model's width
    (1, 128, "cpu", {}, False),  # a small model's worker: mostly one Python thread
    (2, 576, "cpu", {}, True),  # each rank on its own share of the cores
    (1, 576, "cuda", {}, False),
    (2, 576, "cuda", {}, False),
    (1, 576, "cpu", {"LOOM_CPU_BIND": "0"}, False),
    (2, 576, "cpu", {"LOOM_CPU_BIND": "0"}, False),
    (1, 576, "cpu", {"OMP_PLACES": "{0}"}, False),  # the operator's binding stays the only one
    (1, 576, "cpu", {"GOMP_CPU_AFFINITY": "1"}, False),
    (1, 576, "cpu", {"OMP_NUM_THREADS": "1"}, False),  # serves sharing the machine: not all on core 0
    (2, 576, "cpu", {"LOOM_CPU_NUM_THREADS": "1"}, False),
])
def test_cpu_workers_of_real_models_are_bound_to_cores(monkeypatch, tp, hidden, device_type, operator, bound) -> None:
    for name in (*launch.OPERATOR_CHOICE, "LOOM_CPU_BIND"):
        monkeypatch.delenv(name, raising=False)
    for name, value in operator.items():
        monkeypatch.setenv(name, value)
    plan = build_plan(config(tp, hidden, device_type=device_type), ServerConfig())
    workers = [p for p in plan.processes if p.role == "worker"]
    assert len(workers) == tp
    binding = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
    operators = {k: operator.get(k) for k in binding}
    for p in plan.processes:  # the front end and the engine core float
        if p.role != "worker":
            assert {k: p.env.get(k) for k in binding} == operators
    cores = launch.physical_cores(list(os.sched_getaffinity(0)))
    if not bound or len(cores) < tp:  # (a rank needs a core of its own)
        assert all({k: p.env.get(k) for k in binding} == operators for p in workers)
    elif tp == 1:
        assert {k: workers[0].env.get(k) for k in binding} == dict(operators, **launch.CPU_BINDING)
    else:
        places = [p.env["OMP_PLACES"] for p in workers]
        assert all(p.env["OMP_PROC_BIND"] == "close" for p in workers)
        shares = [[c.strip("{}") for c in re.findall(r"\{[^}]*\}", place)] for place in places]
        assert all(shares) and len({c for share in shares for c in share}) == sum(map(len, shares)), places
        assert {c for share in shares for c in share} <= {",".join(map(str, core)) for core in cores}, places


@pytest.mark.parametrize(("cpus", "machine", "smt", "bind"), [
    ({0, 1}, 8, False, True),  # a cpuset of two CPUs on an 8-CPU machine: a thread each, on its own CPU
    ({0, 1, 2, 3}, 16, False, True),
    ({0, 1, 2, 3}, 16, False, False),
    ({0, 1, 2, 3}, 16, True, True),  # two cores of two hardware threads: two threads a rank, on its core
    ({3}, 2, False, True),  # fewer CPUs than ranks: one thread each, unbound
])
def test_tensor_parallel_ranks_share_the_cpus_the_serve_may_use(monkeypatch, cpus, machine, smt, bind) -> None:
    for name in (*launch.OPERATOR_CHOICE, "LOOM_CPU_BIND"):
        monkeypatch.delenv(name, raising=False)
    if not bind:
        monkeypatch.setenv("LOOM_CPU_BIND", "0")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus))
    monkeypatch.setattr(os, "cpu_count", lambda: machine)
    width = 2 if smt else 1  # hardware threads a core
    monkeypatch.setattr(launch, "physical_cores", lambda usable: [sorted(usable)[i:i + width]
                                                                  for i in range(0, len(usable), width)])
    workers = [p for p in build_plan(config(2, 576), ServerConfig()).processes if p.role == "worker"]
    per_rank = max(1, len(cpus) // 2)
    assert [(p.env["OMP_NUM_THREADS"], p.env["LOOM_CPU_NUM_THREADS"]) for p in workers] == [(str(per_rank),) * 2] * 2
    places = [p.env.get("OMP_PLACES") for p in workers]
    if bind and len(cpus) >= 2 * width:  # each rank's threads fill its cores, every CPU of the serve's in one place
        shares = [[[int(c) for c in core.split(",")] for core in re.findall(r"\{([\d,]+)\}", place)] for place in places]
        assert [sum(map(len, share)) for share in shares] == [per_rank, per_rank], places
        assert all(len(core) == width for share in shares for core in share), places
        assert sorted(c for share in shares for core in share for c in core) == sorted(cpus), places
    else:
        assert places == [None, None]


def test_tensor_parallel_workers_talk_over_loopback_only(monkeypatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    plan = build_plan(config(2), ServerConfig())
    workers = [p for p in plan.processes if p.role == "worker"]
    assert [p.env.get("GLOO_SOCKET_IFNAME") for p in workers] == ["lo", "lo"]
    assert all(p.env["LOOM_DIST_INIT_METHOD"].startswith("tcp://127.0.0.1:") for p in workers)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")  # the operator's interface wins
    assert {p.env["GLOO_SOCKET_IFNAME"] for p in build_plan(config(2), ServerConfig()).processes
            if p.role == "worker"} == {"eth0"}


def test_on_ray_the_engine_core_starts_the_ranks(monkeypatch) -> None:
    monkeypatch.delenv("RAY_DEDUP_LOGS", raising=False)
    plan = build_plan(config(2, uses_ray=True), ServerConfig())
    assert [p.role for p in plan.processes] == ["frontend", "engine_core"]  # no local worker process
    core = next(p for p in plan.processes if p.role == "engine_core")
    assert core.env["RAY_DEDUP_LOGS"] == "0"  # every rank's lines shown, not folded into one
    monkeypatch.setenv("RAY_DEDUP_LOGS", "1")  # the operator's choice wins
    assert {p.env["RAY_DEDUP_LOGS"] for p in build_plan(config(2, uses_ray=True), ServerConfig()).processes} == {"1"}
