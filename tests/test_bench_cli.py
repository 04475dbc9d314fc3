"""``loom bench offline|serve|startup`` end to end, with small counts: each mode on a tiny random
Llama (a real ``loom serve`` for serve and startup), then the JSON's fields and the PNG.

The trace, ``--url`` and ``--api-key`` paths run against ``tests/fake_loom_serve.py``, a stand-in
that starts in a moment and writes a start-up trace in loom's format. Nothing here asserts on
speed: figures are checked against each other (tokens over time), never against a bound.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
from loom.benchmarks import server
from loom.entrypoints.cli.main import main

SMALL = ["--num-prompts", "4", "--input-len", "16", "--output-len", "8"]
ENGINE = ["--dtype", "float32", "--max-model-len", "64"]
FAKE_SERVE = [sys.executable, str(Path(__file__).parent / "fake_loom_serve.py")]
MACHINE = {"date", "cpu", "cpu_count", "cpus_usable", "memory_bytes", "os", "python", "loom", "torch", "command"}


def bench(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    """Run ``loom bench ARGV --json --plot`` in this process; returns the JSON and what it printed."""
    rc = main(["bench", *argv, "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "out.png")])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    image = tmp_path / "out.png"
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(str(image)).shape[0] > 200
    document = json.loads((tmp_path / "out.json").read_text())
    assert set(document["machine"]) == MACHINE
    assert f"measurements: {tmp_path / 'out.json'}" in out and f"plot: {tmp_path / 'out.png'}" in out
    return document, out + err


def test_offline(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc, out = bench(["offline", str(tiny_llama), *SMALL, *ENGINE, "--runs", "2"], tmp_path, capsys)
    assert doc["mode"] == "offline"
    assert doc["workload"] == {"num_prompts": 4, "input_len": 16, "output_len": 8, "seed": 0}
    assert doc["config"]["max_model_len"] == 64 and doc["config"]["runs"] == 2
    results = doc["results"]
    assert results["dtype"] == "float32" and results["model"] == str(tiny_llama) and results["load_s"] > 0
    assert len(results["runs"]) == 2
    for run in results["runs"]:
        assert run["output_tokens_per_request"] == [8] * 4  # EOS ignored: every request makes all 8
        assert run["output_tokens"] == 32 and run["prompt_tokens"] == 64
        assert run["output_tok_s"] == pytest.approx(32 / run["elapsed_s"])
        assert run["total_tok_s"] == pytest.approx(96 / run["elapsed_s"])
    assert "output tok/s" in out and "median" in out and "TTFT and TPOT are not measured offline" in out
    assert "Processed prompts" in out  # the progress bar, on stderr


def test_serve(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc, out = bench(["serve", str(tiny_llama), *SMALL, *ENGINE, "--concurrency", "1", "2"], tmp_path, capsys)
    results = doc["results"]
    assert results["launched"] and results["time_to_ready_s"] > 0 and results["tree_rss_bytes_ready"] > 2**20
    assert results["serve_args"] == [str(tiny_llama), "--dtype=float32", "--max-model-len=64"]
    assert [level["concurrency"] for level in results["levels"]] == [1, 2]
    for level in results["levels"]:
        assert level["requests"] == 4 and level["output_tokens_per_request"] == [8] * 4
        assert level["output_tok_s"] == pytest.approx(32 / level["elapsed_s"])
        assert len(level["ttft_s"]) == len(level["tpot_s"]) == len(level["e2e_s"]) == 4
        for ttft, tpot, e2e in zip(level["ttft_s"], level["tpot_s"], level["e2e_s"]):
            assert 0 < ttft < e2e and tpot == pytest.approx((e2e - ttft) / 7, rel=0.05, abs=1e-3)
        assert level["summary"]["ttft"]["n"] == 4
        assert level["summary"]["ttft"]["min"] <= level["summary"]["ttft"]["p50"] <= level["summary"]["ttft"]["max"]
        assert level["tree_rss_bytes"] > 2**20
    assert server.health(results["url"]) is None  # the serve was stopped
    assert "TTFT p50 ms" in out and "server: ready in" in out and "concurrency 2" in out


def test_startup(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc, out = bench(["startup", str(tiny_llama), *ENGINE, "--runs", "1"], tmp_path, capsys)
    results = doc["results"]
    assert doc["workload"] is None
    assert [r["warmup"] for r in results["runs"]] == [True, False]
    counted = results["runs"][1]
    assert counted["time_to_ready_s"] > 0 and counted["tree_rss_bytes"] > 2**20
    assert results["time_to_ready_s"]["median"] == counted["time_to_ready_s"] and results["median_run"] == 1
    # loom serve's own trace once it has --startup-trace; until then the plot is the launch alone
    assert results["trace"] in ("on", "loom serve has no --startup-trace flag")
    if results["trace"] == "on":
        assert counted["spans"], "loom serve --startup-trace wrote no spans"
    assert "launch -> /health 200 s" in out and "warm-up" in out


def test_startup_reads_the_trace(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "SERVE", FAKE_SERVE)
    doc, out = bench(["startup", str(tiny_llama), "--runs", "2"], tmp_path, capsys)
    results = doc["results"]
    assert results["trace"] == "on" and len(results["runs"]) == 3
    spans = results["runs"][results["median_run"]]["spans"]
    assert {s["process"] for s in spans} == {"cli", "supervisor", "frontend", "worker:0"}
    assert {s["name"]: s["depth"] for s in spans}["import torch"] == 1
    assert "where run" in out and "load weights (worker:0) 0.50 s" in out

    monkeypatch.setenv("FAKE_NO_TRACE", "1")  # a loom serve without the flag: no trace, still a plot
    doc, out = bench(["startup", str(tiny_llama), "--runs", "1"], tmp_path, capsys)
    assert doc["results"]["trace"] == "loom serve has no --startup-trace flag"
    assert all(r["spans"] is None for r in doc["results"]["runs"])
    doc, out = bench(["startup", str(tiny_llama), "--runs", "1", "--no-trace"], tmp_path, capsys)
    assert doc["results"]["trace"] == "off (--no-trace)"


def test_serve_url_and_api_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "SERVE", FAKE_SERVE)
    monkeypatch.setenv("FAKE_API_KEY", "sesame")
    proc, url, _ = server.start([], str(tmp_path / "fake.log"))
    try:
        server.wait_healthy(proc, url, timeout=60)
        doc, out = bench(["serve", "--url", url, "--api-key", "sesame", *SMALL, "--concurrency", "1", "3"],
                         tmp_path, capsys)
        results = doc["results"]
        assert not results["launched"] and results["tree_rss_bytes_ready"] is None and results["url"] == url
        assert [lv["output_tokens_per_request"] for lv in results["levels"]] == [[8] * 4, [8] * 4]
        for level in results["levels"]:
            assert len(level["itl_s"]) == 4 * 7  # one event per token here
            for ttft, tpot, e2e in zip(level["ttft_s"], level["tpot_s"], level["e2e_s"]):
                assert tpot == pytest.approx((e2e - ttft) / 7)
        assert "not launched by loom bench" in out

        assert main(["bench", "serve", "--url", url, "--api-key", "wrong", *SMALL]) == 1
        assert "loom: error: /v1/completions answered 401: invalid API key" in capsys.readouterr().err
    finally:
        server.stop(proc)


@pytest.mark.parametrize(("argv", "message"), [
    (["offline", "/no/such/model"], "model path '/no/such/model' does not exist"),
    (["startup", "/no/such/model"], "model path '/no/such/model' does not exist"),
    (["offline", "--plot", "/no/such/folder/x.png"], "--plot /no/such/folder/x.png: the folder /no/such/folder "
                                                      "does not exist; create it or pick another path"),
    (["serve", "--json", "/no/such/folder/x.json"], "the folder /no/such/folder does not exist"),
    (["serve", "somemodel", "--url", "http://127.0.0.1:9"], "--url benches the server already running there: "
                                                           "leave out MODEL"),
    (["serve", "--url", "http://127.0.0.1:9", "--dtype", "float32"], "leave out MODEL, --dtype and --serve-arg"),
    (["serve", "--url", "http://127.0.0.1:9"], "no loom server answers 200 at http://127.0.0.1:9/health"),
])
def test_bad_input_is_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loom: error: ") and message in err[0], err


def test_bad_flags_are_refused_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in ((["offline", "--num-prompts", "0"], "expected a positive integer, got 0"),
                          (["serve", "--concurrency", "x"], "expected a positive integer, got 'x'"),
                          (["serve", "--dtype", "fp64"], "invalid choice: 'fp64'"),
                          (["bench"], "invalid choice: 'bench'")):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_missing_matplotlib_and_a_refused_serve_flag(tiny_llama: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "matplotlib", None)
        assert main(["bench", "offline", str(tiny_llama), "--plot", str(tmp_path / "x.png")]) == 1
    assert capsys.readouterr().err.strip() == (
        "loom: error: --plot needs matplotlib: pip install matplotlib (or pip install 'loom-engine[bench]')")
    # loom serve refuses a flag: its own one-line error comes back, with where its log is
    assert main(["bench", "startup", str(tiny_llama), "--serve-arg=--no-such-flag"]) == 1
    err = capsys.readouterr().err
    assert "loom: error: loom serve exited with 2 before it was ready: " in err
    assert "unrecognized arguments: --no-such-flag" in err
    log = Path(re.search(r"\(log: (\S+)\)", err).group(1))
    assert "--no-such-flag" in log.read_text()  # kept for the user to read
    shutil.rmtree(log.parent)


def test_the_console_script_speaks_in_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "loom.entrypoints.cli.main", "bench", "serve", "/no/such/model"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "loom: error: model path '/no/such/model' does not exist; loom loads models from local paths: a directory "
        "with config.json and *.safetensors, or a .gguf file"]


def test_tree_cpu_seconds_names_each_process_by_its_role():
    """The serve benchmark's CPU split: a descendant whose command line is a worker's is counted as
    the worker, the root as the supervisor, and a role with no process is absent."""
    import time

    burn = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
            "time.sleep(60)")
    spawn = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {burn!r}, 'loom.worker.proc'])\n" \
            "time.sleep(60)"
    root = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        deadline = time.monotonic() + 30
        cpu = server.tree_cpu_seconds(root.pid)
        while cpu.get("worker", 0.0) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
            cpu = server.tree_cpu_seconds(root.pid)
        assert cpu.get("worker", 0.0) >= 0.25 and "supervisor" in cpu
        assert "front end" not in cpu and "engine core" not in cpu
        assert cpu["supervisor"] < cpu["worker"]
    finally:
        for pid, _ in server._tree(root.pid):
            os.kill(pid, signal.SIGKILL)
        root.wait()
