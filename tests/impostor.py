"""A serve with one role played by an impostor that sends its peers malformed message bodies.

The real processes must log each bad frame with its sender, drop it, and keep serving:

    python impostor.py serve ROLE OUT SERVE_ARGS...  # loom serve's plan, ROLE played by this script
    python impostor.py frontend OUT                  # spawned in place of the front end
    python impostor.py engine_core OUT               # spawned in place of the engine core (no workers)

The fake front end writes what the real engine core answered to OUT (JSON) and exits 0; the
fake engine core answers every request with an error of its own until it is stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import msgpack
from loom.ipc.channel import Channel
from loom.ipc.codec import encode
from loom.ipc.messages import (
    MESSAGES_VERSION,
    AddRequest,
    EngineOutputs,
    EngineReady,
    InitCache,
    Kind,
    RequestError,
)
from loom_plugin_api import SamplingParams
from loom_supervisor import client


def _reshaped(msg: Any, index: int, value: Any) -> bytes:
    """``msg``'s body with field ``index`` replaced: right shape, wrong type."""
    fields = msgpack.unpackb(encode(msg))
    fields[index] = value
    return msgpack.packb(fields)


def _connect(role: str) -> Channel:
    conn = client.connect(os.environ[client.ENV_SOCKET], role, 0)
    conn.hello(role, 0, MESSAGES_VERSION)
    conn.ready()
    return Channel(conn, role)


def _request(request_id: str, token_ids: list[int]) -> AddRequest:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    return AddRequest(request_id=request_id, prompt=None, prompt_token_ids=token_ids, sampling_params=params,
                      stream=False)


def fake_frontend(out: str) -> int:
    channel = _connect("frontend")
    while (msg := channel.recv()).kind is not Kind.ENGINE_READY:
        pass
    good = _request("good", [1, 2, 3])
    to_engine = [
        ("ADD_REQUEST", _reshaped(good, 2, "abc")),  # prompt_token_ids a string
        ("ADD_REQUEST", _reshaped(good, 3, "greedy")),  # sampling_params a string
        ("ADD_REQUEST", _reshaped(good, 2, [1, "2"])),
        ("ABORT", msgpack.packb([5])),  # request_ids an int
        ("ADD_REQUEST", b"\xc1"),  # not msgpack
        ("NO_SUCH_KIND\n[engine_core] forged", b""),
        ("OUTPUTS", encode(EngineOutputs())),  # well formed, but not for the engine core
    ]
    to_worker = [
        ("EXECUTE", b"\xc1"),
        ("EXECUTE", msgpack.packb(["x"])),
        ("INIT_CACHE", _reshaped(InitCache(num_blocks=1, block_size=16), 0, "many")),
    ]
    for kind, body in to_engine:
        channel._conn.send("engine_core", kind, body)
    for kind, body in to_worker:
        channel._conn.send("worker:0", kind, body)
    for request in (_request("negative", [-1, 5]), _request("huge", [2**63]), good):
        channel.send("engine_core", request)
    errors: dict[str, str] = {}
    tokens: list[int] = []
    deadline = time.monotonic() + 120
    while not tokens and time.monotonic() < deadline:
        msg = channel.recv(timeout=1)
        if msg is None or not isinstance(msg.body, EngineOutputs):
            continue
        errors.update({e.request_id: e.message for e in msg.body.errors})
        tokens += [t for o in msg.body.outputs if o.finished for c in o.outputs for t in c.token_ids]
    with open(out, "w") as f:
        json.dump({"errors": errors, "tokens": tokens}, f)
    return 0


def fake_engine_core(out: str) -> int:
    channel = _connect("engine_core")
    ready = EngineReady(num_blocks=64, block_size=16)
    for kind, body in [
        ("OUTPUTS", b"\xc1"),
        ("OUTPUTS", msgpack.packb([["not", "an", "output"]])),
        ("OUTPUTS", _reshaped(EngineOutputs(), 1, 7)),  # errors an int
        ("ENGINE_READY", _reshaped(ready, 0, "many")),
        ("NO_SUCH_KIND", b""),
    ]:
        channel._conn.send("frontend", kind, body)
    channel.send("frontend", ready)
    answered = 0
    while True:
        msg = channel.recv()
        if isinstance(msg.body, AddRequest):
            channel.send("frontend", EngineOutputs(errors=[RequestError(
                request_id=msg.body.request_id, message="the impostor engine refuses every request", status=400)]))
            answered += 1
            with open(out, "w") as f:
                json.dump({"answered": answered}, f)


def serve(role: str, out: str, serve_args: list[str]) -> int:
    import loom_supervisor
    from loom.entrypoints.plan import add_serve_args, plan_from_args

    plan = plan_from_args(add_serve_args(argparse.ArgumentParser()).parse_args(serve_args))
    me = [sys.executable, os.path.abspath(__file__), role, out]
    processes = [dataclasses.replace(p, argv=me) if p.role == role else p for p in plan.processes
                 if not (role == "engine_core" and p.role == "worker")]  # the workers answer the engine only
    return int(loom_supervisor.run(dataclasses.replace(plan, processes=processes)))


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "serve":
        sys.exit(serve(sys.argv[2], sys.argv[3], sys.argv[4:]))
    sys.exit({"frontend": fake_frontend, "engine_core": fake_engine_core}[what](sys.argv[2]))
