"""Communicator tier: two ranks, each in its own interpreter, through the platform's communicator."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ..platform import Platform
from ._platform import PlatformUnderTest

pytestmark = pytest.mark.communicator

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _x(rank: int) -> list[list[float]]:
    return [[float(10 * rank + 3 * r + c) for c in range(3)] for r in range(2)]


@pytest.fixture(scope="module")
def rank_results(
    platform_cls: type[Platform],
    loom_platform_under_test: PlatformUnderTest,
    tmp_path_factory: pytest.TempPathFactory,
) -> list[dict]:
    if not platform_cls.supports_tensor_parallel:
        pytest.skip(f"{platform_cls.__qualname__}.supports_tensor_parallel is False")
    if not loom_platform_under_test.device_present:
        pytest.skip(f"needs the device: {loom_platform_under_test.error}")
    tmp = tmp_path_factory.mktemp("communicator")
    init = f"tcp://127.0.0.1:{_free_port()}"
    qualname = f"{platform_cls.__module__}.{platform_cls.__qualname__}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loom_plugin_api.testing._comm_rank",
                str(rank),
                str(WORLD),
                init,
                qualname,
                str(tmp / f"rank{rank}.json"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "LOOM_PLATFORM": loom_platform_under_test.name},
        )
        for rank in range(WORLD)
    ]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("the two ranks did not finish in 120 s (a collective that never completes?)")
    for rank, proc in enumerate(procs):
        if proc.returncode != 0:
            pytest.fail(f"rank {rank} failed (exit {proc.returncode}):\n{logs[rank][-3000:]}")
    return [json.loads(Path(tmp / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def _expect(results: list[dict], key: str, expected: list, what: str) -> None:
    for rank, result in enumerate(results):
        if result[key] != expected:
            pytest.fail(f"{what} on rank {rank} returned {result[key]}, expected {expected}")


def test_group_size_and_rank(rank_results: list[dict]) -> None:
    for rank, result in enumerate(rank_results):
        if result["world_size_rank"] != [WORLD, rank]:
            pytest.fail(
                f"the communicator of rank {rank} says world_size, rank = {result['world_size_rank']}"
            )


def test_all_reduce(rank_results: list[dict]) -> None:
    expected = [[sum(_x(r)[i][j] for r in range(WORLD)) for j in range(3)] for i in range(2)]
    _expect(rank_results, "all_reduce", expected, "all_reduce (sum)")


def test_all_gather(rank_results: list[dict]) -> None:
    last = [[v for r in range(WORLD) for v in _x(r)[i]] for i in range(2)]
    _expect(rank_results, "all_gather_last", last, "all_gather(dim=-1) (rank order)")
    _expect(rank_results, "all_gather_0", [row for r in range(WORLD) for row in _x(r)], "all_gather(dim=0)")


def test_broadcast(rank_results: list[dict]) -> None:
    for src in range(WORLD):
        _expect(rank_results, f"broadcast_{src}", _x(src), f"broadcast(src={src})")
