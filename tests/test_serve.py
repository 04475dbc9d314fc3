"""loom serve end to end: the supervisor, the engine core, workers and the OpenAI front end."""

from __future__ import annotations

import concurrent.futures
import os

import loom_supervisor  # noqa: F401  (a missing supervisor wheel is an error, not a skip)
import openai
import pytest
from loom import LLM, SamplingParams
from serve_utils import alive, get, serving

PROMPTS = ["Hello, my name is", "The capital of France is", "One two three"]


pytestmark = pytest.mark.usefixtures("every_installed_plugin")


@pytest.fixture(scope="module")
def tp2_server(tiny_llama, tmp_path_factory):
    with serving([str(tiny_llama), "--tensor-parallel-size", "2", "--max-model-len", "256", "--dtype", "float32"],
                 tmp_path_factory.mktemp("tp2")) as serve:
        yield serve


def test_tp2_completions_chat_streaming_match_llm(tp2_server, tiny_llama):
    client = openai.OpenAI(base_url=tp2_server.url + "/v1", api_key="none")
    model = str(tiny_llama)
    llm = LLM(model, dtype="float32", max_model_len=256)  # fp32 as the serve: greedy equality across shardings
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8,
                                                                                   ignore_eos=True))]
    for prompt, want in zip(PROMPTS, expected):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want
        assert r.usage.completion_tokens == 8
        chunks = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    messages = [{"role": "user", "content": "Say something"}]
    chat_want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].text
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == chat_want
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat_want
    assert [m.id for m in client.models.list().data] == [tiny_llama.name]  # the path is not shown


def _listening(pid: int) -> list[str]:
    """The local addresses of ``pid``'s listening TCP sockets, as /proc/net shows them (hex)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in list(f)[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    found.append(cols[1])
    return found


LOOPBACK = ("0100007F:", "0000000000000000FFFF00000100007F:", "00000000000000000000000001000000:")


def test_tp2_workers_listen_on_loopback_only(tp2_server):
    workers = [pid for role, pid in tp2_server.child_pids().items() if role.startswith("worker")]
    addresses = {pid: _listening(pid) for pid in workers}
    assert any(addresses.values()), addresses  # rank 0's store and gloo's pairs do listen
    assert all(a.startswith(LOOPBACK) for found in addresses.values() for a in found), addresses


def _forward_oot_logged(log: str, rank: int) -> bool:
    return any(ln.startswith(f"[worker:{rank}]") and "DummyRotaryEmbedding.forward_oot runs in pid" in ln
               for ln in log.splitlines())


def test_tour_across_processes(tp2_server, tiny_llama, expected_platform):
    import time

    # one request, so that every worker has run a forward pass whatever ran before this test
    client = openai.OpenAI(base_url=tp2_server.url + "/v1", api_key="none", max_retries=0)
    client.completions.create(model=str(tiny_llama), prompt="Hi", max_tokens=1)
    deadline = time.monotonic() + 30  # the supervisor relays the workers' lines to the log
    while expected_platform == "dummy" and time.monotonic() < deadline and not all(
            _forward_oot_logged(tp2_server.log, rank) for rank in (0, 1)):
        time.sleep(0.1)
    log = tp2_server.log
    for role in ("frontend", "engine_core", "worker:0", "worker:1"):
        lines = [ln for ln in log.splitlines() if ln.startswith(f"[{role}]")]
        assert any("Resolved platform" in ln for ln in lines), role
        if expected_platform == "dummy":
            assert any("General plugin dummy_custom_ops ran" in ln for ln in lines), role
            assert any("Platform plugin dummy_platform_plugin is activated" in ln for ln in lines), role
    for rank in (0, 1):
        worker = [ln for ln in log.splitlines() if ln.startswith(f"[worker:{rank}]")]
        assert any("Using attention backend" in ln for ln in worker)
        if expected_platform == "dummy":
            assert _forward_oot_logged(log, rank)
    assert "all 4 processes ready; serving at " + tp2_server.url in log


def _loads_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_only_the_workers_load_torch(tp2_server, expected_platform):
    """The front end and the engine core never compute: they start without torch (seconds
    and ~250 MB each). A platform's general plugin may import it, as the dummy one does."""
    pids = tp2_server.child_pids()
    assert _loads_torch(pids["worker:0"]) and _loads_torch(pids["worker:1"])
    if expected_platform == "cpu":
        assert not _loads_torch(pids["frontend"])
        assert not _loads_torch(pids["engine_core"])


def test_64_concurrent_streaming_clients(tp2_server, tiny_llama):
    client = openai.OpenAI(base_url=tp2_server.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def one(i: int) -> int:
        stream = client.completions.create(model=str(tiny_llama), prompt=f"Request {i}:", max_tokens=5 + i % 7,
                                           stream=True, temperature=0.7, seed=i, extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True})
        usage = None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
        return usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        counts = list(pool.map(one, range(64)))
    assert counts == [5 + i % 7 for i in range(64)]
    assert get(tp2_server.url + "/health")[0] == 200
    metrics = get(tp2_server.url + "/metrics")[1]
    assert "loom:request_success_total" in metrics


@pytest.mark.parametrize("victim", ["engine_core", "worker:0"])
def test_sigkill_of_a_child_stops_the_serve(tiny_llama, tmp_path, victim):
    import os
    import signal
    import threading

    import httpx

    events: list[str] = []
    with serving([str(tiny_llama), "--max-model-len", "512"], tmp_path) as serve:
        pids = serve.child_pids()
        streaming = threading.Event()

        def stream() -> None:
            body = {"model": str(tiny_llama), "prompt": "Hi", "max_tokens": 400, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", serve.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        streaming.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert streaming.wait(30)
        os.kill(pids[victim], signal.SIGKILL)
        code = serve.wait(timeout=60)  # a liveness bound: the serve must stop on its own
        reader.join(60)
    assert code != 0
    assert not reader.is_alive(), "the stream did not end after the serve stopped"
    # the request in flight ended with an error that names the dead process and the cause
    errors = [e for e in events if '"error"' in e]
    assert errors and f"{victim} (pid {pids[victim]}) died with signal SIGKILL" in errors[0], events[-3:]
    log = serve.log
    assert f"{victim} (pid {pids[victim]}) was killed by SIGKILL in phase 'running'" in log
    for pid in pids.values():
        assert not alive(pid), f"pid {pid} outlived the supervisor"


def test_sigkill_of_the_supervisor_leaves_nothing(tiny_llama, tmp_path):
    import os
    import signal
    import time

    with serving([str(tiny_llama), "--max-model-len", "128"], tmp_path) as serve:
        pids = serve.child_pids()
        os.kill(serve.proc.pid, signal.SIGKILL)
        serve.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not [p for p in pids.values() if alive(p)]


@pytest.mark.parametrize("to", ["serve", "group"])
def test_sigterm_during_load_finishes_requests_and_exits_0(tiny_llama, tmp_path, to):
    """SIGTERM once every request has streamed its first token and none has finished: the
    drain lets all of them run to max_tokens, then every process exits and the serve returns 0.
    ``group``: SIGTERM to the whole process group, as systemd, docker and ``kill -- -PGID`` send
    it: the children ignore it and leave the drain to the supervisor."""
    import os
    import signal
    import threading

    n, max_tokens = 8, 200
    started = [threading.Event() for _ in range(n)]
    finished_early: list[int] = []  # requests that ended before SIGTERM: not in flight then
    sigterm = threading.Event()
    with serving([str(tiny_llama), "--max-model-len", "256", "--grace-period", "120"], tmp_path) as serve:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="none", max_retries=0, timeout=180)

        def one(i: int) -> tuple[str | None, int]:
            stream = client.completions.create(model=str(tiny_llama), prompt=f"Item {i}", max_tokens=max_tokens,
                                               stream=True, extra_body={"ignore_eos": True},
                                               stream_options={"include_usage": True})
            reason, tokens = None, 0
            for chunk in stream:
                if chunk.choices:
                    started[i].set()
                    if chunk.choices[0].finish_reason is not None:
                        reason = chunk.choices[0].finish_reason
                        if not sigterm.is_set():
                            finished_early.append(i)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return reason, tokens

        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(one, i) for i in range(n)]
            for i, event in enumerate(started):
                assert event.wait(60), f"request {i} got no token in 60 s"
            sigterm.set()
            if to == "group":
                os.killpg(os.getpgid(serve.proc.pid), signal.SIGTERM)
            else:
                os.kill(serve.proc.pid, signal.SIGTERM)
            results = [f.result() for f in futures]
        code = serve.wait(timeout=150)
    assert not finished_early, f"requests {finished_early} finished before SIGTERM: the drain was not tested"
    assert results == [("length", max_tokens)] * n
    assert code == 0, serve.log[-3000:]
    assert "all 3 processes stopped" in serve.log


def _wait_for_requests(url: str, n: int, timeout: float = 60) -> None:
    """Until the engine holds ``n`` requests (running or waiting), as ``/metrics`` reports them."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = sum(float(line.split()[-1]) for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                   if line.startswith(("loom:num_requests_running{", "loom:num_requests_waiting{")))
        if held >= n:
            return
        time.sleep(0.05)
    raise TimeoutError(f"the engine did not hold {n} requests within {timeout} s")


def test_requests_still_running_when_the_grace_period_ends_get_an_error(tiny_llama, tmp_path):
    """One request at a time and a 1 s grace period: what has not finished by then ends with an
    error its client can read (an SSE error event and [DONE], or a 503), and the exit code says
    the drain was cut."""
    import json
    import os
    import signal

    import httpx

    n = 6
    first_token = concurrent.futures.Future()
    with serving([str(tiny_llama), "--max-model-len", "256", "--max-num-seqs", "1", "--grace-period", "1"],
                 tmp_path) as serve:
        def one(i: int) -> tuple[int, list[str]]:
            body = {"prompt": f"Item {i}", "max_tokens": 240, "ignore_eos": True, "stream": True}
            lines = []
            with httpx.stream("POST", serve.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    if line.startswith("data: {") and not first_token.done():
                        first_token.set_result(i)
                return r.status_code, lines

        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(one, i) for i in range(n)]
            first_token.result(timeout=60)  # one request streams, the others wait in the queue
            _wait_for_requests(serve.url, n)  # every one accepted: none may meet a closed listener
            os.kill(serve.proc.pid, signal.SIGTERM)
            results = [f.result(timeout=60) for f in futures]
        code = serve.wait(timeout=60)
    cut = 0
    for status, lines in results:
        if status == 503:
            cut += 1
            assert "the server is shutting down" in lines[0], lines  # queued, or sent after SIGTERM
            continue
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        events = [json.loads(line[6:]) for line in lines[:-1]]
        if "error" in events[-1]:
            cut += 1
            assert "grace period of 1 s ended" in events[-1]["error"]["message"], events[-1]
        else:
            assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert cut >= n - 2, results  # one at a time, 240 tokens each: most cannot finish in 1 s
    assert code != 0, serve.log[-3000:]
    assert "frontend (pid" in serve.log and "exited with code 3" in serve.log, serve.log[-3000:]


def test_supervisor_command_serves_the_same_plan(tiny_llama, tmp_path):
    """``loom-supervisor serve MODEL ...`` asks Python for the plan, then supervises it."""
    import os
    import shutil
    import signal
    import subprocess
    import sys

    from serve_utils import Serve, free_port, wait_ready

    exe = shutil.which("loom-supervisor", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    assert exe, "the loom-supervisor command is not installed"
    port = free_port()
    log_path = tmp_path / "supervisor.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([exe, "serve", str(tiny_llama), "--max-model-len", "128", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    serve = Serve(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_ready(serve)
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="none")
        r = client.completions.create(model=str(tiny_llama), prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, serve.log[-2000:]


def test_chat_template_echo_and_penalties_across_processes(tiny_llama, tmp_path):
    template = tmp_path / "qa.jinja"
    template.write_text("Q: {{ messages[-1]['content'] }}\nA:")
    with serving([str(tiny_llama), "--max-model-len", "128", "--chat-template", str(template)], tmp_path) as serve:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model=str(tiny_llama), max_tokens=2,
                                           messages=[{"role": "system", "content": "not in this template"},
                                                     {"role": "user", "content": "two plus two"}])
        # prompt logprobs and penalties travel through the engine-core and worker processes
        echoed = client.completions.create(model=str(tiny_llama), prompt="Hello there", echo=True, logprobs=1,
                                           max_tokens=4, temperature=0, frequency_penalty=-2, presence_penalty=-2,
                                           extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith("Hello there") and echoed.usage.completion_tokens == 4
    num_prompt = echoed.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 4 and lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert len(set(lp.tokens[num_prompt:])) == 1  # a negative penalty rewards repeating the first token
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    assert r.usage.prompt_tokens == len(tokenizer.encode("Q: two plus two\nA:", add_special_tokens=False))


def test_overlapped_steps_across_processes_give_the_tokens_of_llm(tiny_llama, tmp_path):
    """``--async-scheduling on``: the engine core schedules each step before the worker process has
    sampled the previous one's tokens, which the worker fills in. Three concurrent greedy streams of
    different lengths (one ending on a stop token, one with a repetition penalty) equal ``loom.LLM``'s."""
    model = str(tiny_llama)
    llm = LLM(model, dtype="float32", max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = llm.generate(PROMPTS[0], greedy)[0].outputs[0]
    stop = first.token_ids[5]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop]),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]
    want = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    bodies = [dict(stop_token_ids=[stop]), dict(repetition_penalty=1.3), {}]
    with serving([model, "--max-model-len", "256", "--dtype", "float32", "--async-scheduling", "on"],
                 tmp_path) as serve:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="none", max_retries=0)

        def complete(i: int) -> str:
            stream = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=params[i].max_tokens,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True, **bodies[i]})
            return "".join(c.choices[0].text for c in stream if c.choices)

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(complete, range(3)))
        log = serve.log
    assert got == [o.text for o in want]
    assert want[0].token_ids[-1] == stop and len(want[0].token_ids) == first.token_ids.index(stop) + 1
    assert "steps overlapped (async scheduling)" in log
