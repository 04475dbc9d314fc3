"""Malformed message bodies sent to each role of a real serve (by an impostor in one role's
place, see impostor.py): each receiver logs the frame with its sender, escaped, drops it, and
keeps serving the well-formed frames that follow."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import loom_supervisor  # noqa: F401  (a missing supervisor wheel is an error, not a skip)
import pytest
from serve_utils import free_port

pytestmark = pytest.mark.usefixtures("every_installed_plugin")

IMPOSTOR = Path(__file__).with_name("impostor.py")


def _start(role: str, model: Path, tmp_path: Path) -> tuple[subprocess.Popen[str], str, Path, Path]:
    port, out, log = free_port(), tmp_path / "out.json", tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, str(IMPOSTOR), "serve", role, str(out), str(model), "--max-model-len", "128",
         "--dtype", "float32", "--port", str(port)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", out, log


def _dropped(log: str, role: str, kind: str, sender: str) -> int:
    return sum(ln.startswith(f"[{role}]") and f"Dropped a {ascii(kind)} frame from {sender!r}" in ln
               for ln in log.splitlines())


def test_the_engine_core_and_a_worker_drop_malformed_frames_and_keep_serving(tiny_llama, tmp_path):
    proc, _, out, log_path = _start("frontend", tiny_llama, tmp_path)
    try:
        code = proc.wait(timeout=240)
    finally:
        proc.kill()
    log = log_path.read_text()
    answers = json.loads(out.read_text())
    # the well-formed requests after the bad frames: refused for their own reason, or served
    assert set(answers["errors"]) == {"negative", "huge"}, answers
    assert all("vocabulary" in m for m in answers["errors"].values()), answers
    assert len(answers["tokens"]) == 4, answers
    assert _dropped(log, "engine_core", "ADD_REQUEST", "frontend") == 4, log[-4000:]
    assert _dropped(log, "engine_core", "ABORT", "frontend") == 1
    assert _dropped(log, "engine_core", "NO_SUCH_KIND\n[engine_core] forged", "frontend") == 1
    assert not any(ln.startswith("[engine_core] forged") for ln in log.splitlines())  # escaped
    assert "Engine core ignored a OUTPUTS frame from frontend" in log
    assert _dropped(log, "worker:0", "EXECUTE", "frontend") == 2, log[-4000:]
    assert _dropped(log, "worker:0", "INIT_CACHE", "frontend") == 1
    assert code == 0, log[-3000:]  # the impostor front end exited 0: a normal end of the serve


def test_the_front_end_drops_malformed_frames_and_keeps_serving(tiny_llama, tmp_path):
    proc, url, _, log_path = _start("engine_core", tiny_llama, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        else:
            pytest.fail("the front end never became healthy: " + log_path.read_text()[-3000:])
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 400 and "impostor engine refuses" in r.json()["error"]["message"], r.text
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    log = log_path.read_text()
    assert _dropped(log, "frontend", "OUTPUTS", "engine_core") == 3, log[-4000:]
    assert _dropped(log, "frontend", "ENGINE_READY", "engine_core") == 1
    assert _dropped(log, "frontend", "NO_SUCH_KIND", "engine_core") == 1
