"""``--distributed-executor-backend ray`` on a Ray cluster of two nodes on this machine
(``ray.cluster_utils.Cluster``: two raylets, one CPU each), with the dummy platform and the
test model plugin installed (``nox -s ray``): every rank is an actor that resolves the
platform and runs the plugins itself, one rank per node (STRICT_SPREAD)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import ray
from loom import LLM, SamplingParams
from loom.distributed.ray_utils import differences, fingerprint
from loom_plugin_api import load_general_plugins
from ray.cluster_utils import Cluster
from ray.util.state import list_actors
from serve_utils import Serve, serving

pytestmark = pytest.mark.usefixtures("every_installed_plugin")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
RAY = {"distributed_executor_backend": "ray", "ray_placement_strategy": "STRICT_SPREAD"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address)  # the test's own view of the cluster (loom.LLM joins this one)
    yield c
    ray.shutdown()
    c.shutdown()


def _left_in(cluster_: Cluster, timeout: float = 30) -> tuple[list, list]:
    """Actors still alive and placement groups not removed, once Ray has had time to clean up."""
    deadline = time.monotonic() + timeout
    while True:
        actors = [a.actor_id for a in list_actors(filters=[("state", "!=", "DEAD")])]
        groups = [g for g, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"]
        if not (actors or groups) or time.monotonic() > deadline:
            return actors, groups
        time.sleep(0.5)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_two_ranks_on_two_nodes_match_one_rank_and_mp(cluster, tiny_llama, has_model_plugin):
    assert has_model_plugin  # the session installs it: the architecture below exists only through it
    args = {"dtype": "float32", "max_model_len": 128, "hf_overrides": {"architectures": ["MyLlama"]}}
    want = _tokens(LLM(str(tiny_llama), **args).generate(PROMPTS, GREEDY))
    mp = LLM(str(tiny_llama), tensor_parallel_size=2, **args)
    assert _tokens(mp.generate(PROMPTS, GREEDY)) == want
    mp.shutdown()
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, ray_address=cluster.address, **RAY, **args)
    where = llm.llm_engine.executor.where
    assert len({w["node_id"] for w in where}) == 2, where  # one rank per node
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == want
    llm.shutdown()
    assert _left_in(cluster) == ([], [])


def test_missing_resources_are_named_per_node(cluster, tiny_llama):
    with pytest.raises(RuntimeError) as e:
        LLM(str(tiny_llama), dtype="float32", max_model_len=128, tensor_parallel_size=4, ray_address=cluster.address,
            ray_placement_timeout=2, **RAY)
    message = str(e.value)
    assert "did not give 4 rank(s) one CPU each (STRICT_SPREAD) within 2 s" in message, message
    assert "STRICT_SPREAD needs 4 nodes with 1 CPU free each; the cluster has 2 node(s)" in message, message
    assert message.count("CPU 1 free of 1") == 2, message
    assert _left_in(cluster) == ([], [])


def _serve(cluster_: Cluster, model, tmp_path, name: str, *extra: str):
    return serving([str(model), "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
                    "--ray-address", cluster_.address, "--ray-placement-strategy", "STRICT_SPREAD",
                    "--max-model-len", "128", "--dtype", "float32", *extra], tmp_path, name=name)


def _listening_on(pid: int, port: int) -> list[str]:
    """The local addresses (hex, as /proc/net shows them) of ``pid``'s sockets listening on ``port``."""
    inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
              if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in list(f)[1:]:
                cols = row.split()
                address, _, hexport = cols[1].rpartition(":")
                if cols[3] == "0A" and cols[9] in inodes and int(hexport, 16) == port:
                    found.append(address)
    return found


def test_serve_on_ray_answers_and_drains(cluster, tiny_llama, tmp_path):
    prompt = "Hello, my name is"
    want = LLM(str(tiny_llama), dtype="float32", max_model_len=128).generate(
        prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0].outputs[0].text
    trace = tmp_path / "startup.json"
    with _serve(cluster, tiny_llama, tmp_path, "drain", "--startup-trace", str(trace)) as serve:
        ranks = {f"worker:{r}": _rank_pid(serve, r) for r in (0, 1)}
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=tiny_llama.name, prompt=prompt, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want[:len(r.choices[0].text)] and r.usage.completion_tokens == 10
        # torch.distributed's store listens on rank 0's node address, not on every interface
        meet = serve.log.split("The ranks meet at tcp://")[1].split()[0]
        ip, port = meet.rsplit(":", 1)
        hex_ip = "".join(f"{int(b):02X}" for b in reversed(ip.split(".")))
        assert _listening_on(_rank_pid(serve, 0), int(port)) == [hex_ip]
        # SIGTERM with a stream in flight: it finishes, then the serve ends cleanly
        body = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
        text, done = [], False
        with httpx.stream("POST", serve.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    if not text:
                        serve.proc.send_signal(signal.SIGTERM)
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        assert ("".join(text), done) == (want, True)
        assert serve.wait(timeout=60) == 0, serve.log[-3000:]
    assert "(worker:1@" in serve.log  # the ranks' lines reach the serve's output, named
    # the actors (on this machine: the cluster's nodes share it) are tracks of the start-up trace
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert {k: tracks.get(k) for k in ranks} == ranks
    assert {(e["pid"], e["name"]) for e in events if e["name"] == "load_model"} == {(p, "load_model") for p in ranks.values()}
    assert "Worker rank 1 shut down" in serve.log  # shutdown() ran: the ranks were stopped, not left to Ray
    assert _left_in(cluster) == ([], [])


def _rank_pid(serve: Serve, rank: int) -> int:
    line = next(ln for ln in serve.log.splitlines() if f"worker:{rank} is pid " in ln)
    return int(line.split(f"worker:{rank} is pid ")[1].split()[0])


def test_kill_9_of_a_rank_is_reported_like_a_local_worker(cluster, tiny_llama, tmp_path):
    with _serve(cluster, tiny_llama, tmp_path, "kill") as serve:
        pid = _rank_pid(serve, 1)
        body = {"prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", serve.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            events = [first, *(line for line in lines if line.startswith("data: "))]
            told = time.monotonic() - killed_at  # the client has its error and [DONE]
        code = serve.wait(timeout=60)
        took = time.monotonic() - killed_at
    log = serve.log
    assert code != 0, log[-3000:]
    assert f"worker:1 (pid {pid} on node " in log, log[-3000:]
    report = log[log.index(f"loom-supervisor: worker:1 (pid {pid} on node "):]
    assert "Worker rank 1 is ready" in report  # the tail of the rank's own log, read from its node
    assert f"DummyRotaryEmbedding.forward_oot runs in pid {pid}" in report  # the platform plugin's op, in the actor
    print(f"kill -9 of worker:1: the client was told after {told:.2f} s, the serve ended after {took:.2f} s")
    assert told < 5, f"the client was told {told:.1f} s after the kill"  # a lost rank is found, not waited on
    assert took < 20, f"the serve ended {took:.1f} s after the kill"
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert "worker:1" in error["message"], error
    assert _left_in(cluster) == ([], [])


def test_the_fingerprint_names_every_difference(expected_platform):
    load_general_plugins()  # as the engine has before it asks (once per process)
    here = fingerprint()
    assert here["platform"] == "loom_platform_dummy.dummy_platform.DummyPlatform"
    assert {"plugin loom-platform-dummy", "plugin loom-add-dummy-model", "torch", "loom-engine"} <= set(here)
    other = {**here, "torch": "0.0.1", "plugin extra": "1.0"}
    del other["plugin loom-add-dummy-model"]
    assert differences(here, other) == [
        "plugin extra: engine absent, this node 1.0",
        f"plugin loom-add-dummy-model: engine {here['plugin loom-add-dummy-model']}, this node absent",
        f"torch: engine {here['torch']}, this node 0.0.1",
    ]
    assert differences(here, dict(here)) == []


def test_a_node_that_resolves_another_platform_is_refused(cluster, tiny_llama, expected_platform):
    assert expected_platform == "dummy"  # the driver's platform; the new node is told to resolve cpu
    os.environ["LOOM_PLATFORM"] = "cpu"  # the raylet, and every actor it starts, inherit it
    try:
        odd = cluster.add_node(num_cpus=2)  # the only node where STRICT_PACK fits two ranks
    finally:
        del os.environ["LOOM_PLATFORM"]
    cluster.wait_for_nodes()
    try:
        with pytest.raises(Exception) as e:
            LLM(str(tiny_llama), dtype="float32", max_model_len=128, tensor_parallel_size=2,
                ray_address=cluster.address, distributed_executor_backend="ray", ray_placement_strategy="STRICT_PACK")
        message = str(e.value)
        assert "does not run the engine's software" in message, message
        assert ("platform: engine loom_platform_dummy.dummy_platform.DummyPlatform, this node "
                "loom.platforms.cpu.CpuPlatform") in message, message
        assert "on node " in message
        assert _left_in(cluster) == ([], [])
    finally:
        cluster.remove_node(odd)


def test_a_node_lost_during_a_step_is_found_within_seconds(cluster, tiny_llama):
    """The node of a rank goes away without warning (its raylet killed) while a batch runs: the
    step fails with the rank named, well before Ray's health checks declare the node dead."""
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256, tensor_parallel_size=2,
              ray_address=cluster.address, **RAY)
    executor = llm.llm_engine.executor
    # the rank that is not on the head node (this process, the driver, is connected to the head)
    rank = next(r for r, w in enumerate(executor.where) if w["node_id"] != cluster.head_node.node_id)
    node = next(n for n in cluster.list_all_nodes() if n.node_id == executor.where[rank]["node_id"])
    failed: list[tuple[BaseException, float]] = []

    def generate() -> None:
        try:
            llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 4, SamplingParams(max_tokens=200, ignore_eos=True))
        except Exception as e:
            failed.append((e, time.monotonic()))

    runner = threading.Thread(target=generate)
    runner.start()
    while llm.llm_engine.get_stats().num_generation_tokens < 8:  # the batch is decoding
        assert runner.is_alive(), failed
        time.sleep(0.05)
    cluster.remove_node(node, allow_graceful=False)
    lost_at = time.monotonic()
    runner.join(timeout=60)
    try:
        assert failed, "the batch finished although rank 1's node is gone"
        error, at = failed[0]
        print(f"node of worker:{rank} lost: the step failed {at - lost_at:.2f} s later")
        assert f"worker:{rank}" in str(error) and executor.died, error
        assert at - lost_at < 10, f"found {at - lost_at:.1f} s after the node was lost"
    finally:
        llm.shutdown()
        cluster.add_node(num_cpus=1)  # the fixture's two nodes again
        cluster.wait_for_nodes()
    assert _left_in(cluster) == ([], [])
