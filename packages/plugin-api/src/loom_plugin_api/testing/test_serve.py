"""Serve tier: ``loom serve`` on the platform, through the official ``openai`` client.

One serve of a tiny Llama built by the kit answers a completion and a chat completion,
then gets SIGTERM and must exit 0 with its whole process tree gone. Everything runs in the
fixture, so the checks below only read what happened (they hold in any order).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ..platform import Platform
from ._platform import PlatformUnderTest
from ._processes import group_alive
from ._tiny_models import build_tiny_model

pytestmark = pytest.mark.serve

READY_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _wait_ready(proc: subprocess.Popen[str], url: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"loom serve exited with {proc.returncode} before it was ready:\n{log.read_text()[-4000:]}"
            )
        if _healthy(url):
            return
        time.sleep(0.3)  # polling /health, bounded by the deadline
    pytest.fail(f"loom serve was not ready in {READY_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def serve_run(
    platform_cls: type[Platform],
    loom_platform_under_test: PlatformUnderTest,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    import openai  # lazy: optional dependency (the testing extra); only this tier needs it

    if not loom_platform_under_test.device_present:
        pytest.skip(f"needs the device: {loom_platform_under_test.error}")
    tmp = tmp_path_factory.mktemp("serve")
    model = build_tiny_model(tmp / "model", "llama")
    dtype = "float32" if "float32" in platform_cls.supported_dtypes else platform_cls.supported_dtypes[0]
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "serve.log"
    with open(log, "w") as out:
        argv = ["serve", str(model), "--port", str(port), "--max-model-len", "128", "--dtype", dtype]
        proc = subprocess.Popen([sys.executable, "-m", "loom.entrypoints.cli.main", *argv], stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env={**os.environ, "LOOM_PLATFORM": loom_platform_under_test.name})
    run: dict[str, Any] = {"log": log}
    try:
        _wait_ready(proc, url, log)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        requests = {
            "completion": lambda: client.completions.create(model=name, prompt="Hello, loom", max_tokens=5,
                                                            temperature=0),
            "chat": lambda: client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0),
        }
        for key, call in requests.items():
            try:
                run[key] = call()
            except openai.OpenAIError as e:
                run[key] = e
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            run["returncode"] = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            run["returncode"] = None
        run["left"] = group_alive(proc.pid)
        if run["left"] or run["returncode"] is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return run


def _answer(run: dict[str, Any], key: str) -> Any:
    answer = run.get(key)
    if answer is None or isinstance(answer, Exception):
        pytest.fail(f"the {key} request failed: {answer!r}\n{run['log'].read_text()[-3000:]}")
    return answer


def test_completion(serve_run: dict[str, Any]) -> None:
    answer = _answer(serve_run, "completion")
    choice = answer.choices[0]
    if not isinstance(choice.text, str) or not 1 <= answer.usage.completion_tokens <= 5:
        pytest.fail(f"the completion answered {answer!r}: expected 1 to 5 generated tokens of text")


def test_chat_completion(serve_run: dict[str, Any]) -> None:
    answer = _answer(serve_run, "chat")
    message = answer.choices[0].message
    if (
        message.role != "assistant"
        or not isinstance(message.content, str)
        or answer.usage.completion_tokens < 1
    ):
        pytest.fail(f"the chat completion answered {answer!r}: expected an assistant message")


def test_sigterm_exits_zero_leaving_no_process(serve_run: dict[str, Any]) -> None:
    code = serve_run["returncode"]
    if code != 0:
        what = f"did not exit within {STOP_TIMEOUT_S} s" if code is None else f"exited {code}"
        pytest.fail(f"loom serve {what} after SIGTERM:\n{serve_run['log'].read_text()[-3000:]}")
    if serve_run["left"]:
        pytest.fail(
            "after loom serve exited, processes of its group were still running (a worker the platform "
            "started and did not stop in shutdown()?)"
        )
