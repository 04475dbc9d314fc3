"""InprocAsyncLLM over a model-free executor: streams, aborts, failed steps, a dead engine, stat loggers."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from loom.config import CacheConfig, LoRAConfig, SchedulerConfig
from loom.engine.errors import EngineDeadError, RequestFailedError
from loom.engine.executor import Executor
from loom.engine.inproc import InprocAsyncLLM
from loom.metrics import load_stat_loggers
from loom_plugin_api import PluginError, SamplingParams
from loom_plugin_api.step import ModelRunnerOutput, SchedulerOutput

TOKEN = 11  # never the EOS below, so max_tokens ends every request


class CountingExecutor(Executor):
    """Samples TOKEN for every request that samples; ``fail_next`` makes the next step raise."""

    def __init__(self, num_blocks: int = 64) -> None:
        self.num_blocks = num_blocks
        self.fail_next = False
        self.delay = 0.0

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device fell over")
        if self.delay:
            time.sleep(self.delay)
        ids = [r.req_id for r in out.scheduled if r.sample]
        return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[TOKEN] * len(ids))

    def shutdown(self) -> None:
        pass


class Recorder:
    def __init__(self) -> None:
        self.stats = []
        self.logs = 0

    def record(self, stats) -> None:
        self.stats.append(stats)

    def log(self) -> None:
        self.logs += 1


def make_client(executor: CountingExecutor | None = None, **kwargs) -> InprocAsyncLLM:
    config = SimpleNamespace(
        lora_config=LoRAConfig(),
        cache_config=CacheConfig(block_size=4),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        model_config=SimpleNamespace(max_model_len=64, hf_config=SimpleNamespace(eos_token_id=7),
                                     get_vocab_size=lambda: 50257),
    )
    kwargs.setdefault("stat_loggers", [])
    return InprocAsyncLLM(config, executor or CountingExecutor(), None, **kwargs)


async def collect(client: InprocAsyncLLM, request_id: str, params: SamplingParams) -> list:
    return [out async for out in client.generate(request_id, None, [1, 2, 3], params)]


def test_streams_deltas_and_routes_concurrent_requests() -> None:
    recorder = Recorder()
    client = make_client(stat_loggers=[recorder], log_stats_interval=0.0)

    async def main():
        params = [SamplingParams(max_tokens=k, temperature=0) for k in (3, 5, 8)]
        results = await asyncio.gather(*(collect(client, f"r{i}", p) for i, p in enumerate(params)))
        await client.shutdown()
        return results

    results = asyncio.run(main())
    for outs, k in zip(results, (3, 5, 8)):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        tokens = [t for o in outs for c in o.outputs for t in c.token_ids]
        assert tokens == [TOKEN] * k
        assert outs[-1].outputs[0].finish_reason == "length"
    assert recorder.stats and recorder.stats[-1].num_generation_tokens == 16
    assert recorder.logs >= 1
    assert client.dead_error is not None and "shut down" in client.dead_error


def test_n_streams_by_index() -> None:
    client = make_client()

    async def main():
        outs = await collect(client, "r", SamplingParams(n=3, max_tokens=4, seed=1))
        await client.shutdown()
        return outs

    outs = asyncio.run(main())
    per_index = {}
    for out in outs:
        for c in out.outputs:
            per_index[c.index] = per_index.get(c.index, 0) + len(c.token_ids)
    assert per_index == {0: 4, 1: 4, 2: 4}


def test_leaving_the_stream_aborts_and_external_abort_ends_it() -> None:
    executor = CountingExecutor()
    executor.delay = 0.01
    client = make_client(executor)

    async def main():
        stream = client.generate("early", None, [1, 2], SamplingParams(max_tokens=50))
        first = await stream.__anext__()
        await stream.aclose()  # the consumer left: the request must be aborted
        deadline = time.monotonic() + 5
        while client.engine.has_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        left_after_close = client.engine.has_unfinished_requests()

        outs = []
        async for out in client.generate("other", None, [1, 2], SamplingParams(max_tokens=50)):
            if not outs:  # in flight (it has a token, 49 to go): abort it from outside the stream
                await client.abort("other")
            outs.append(out)
        await client.shutdown()
        return first, left_after_close, outs

    first, left_after_close, outs = asyncio.run(main())
    assert first.outputs[0].token_ids
    assert not left_after_close
    assert not outs[0].finished
    assert outs[-1].finished  # the abort ends the stream (a final output with no completion)
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) < 50


def test_engine_rejection_is_a_value_error() -> None:
    client = make_client()

    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in client.generate("long", None, list(range(100)), SamplingParams(max_tokens=2)):
                pass
        # the engine goes on
        outs = await collect(client, "ok", SamplingParams(max_tokens=2))
        await client.shutdown()
        return outs

    assert asyncio.run(main())[-1].finished


def test_failed_step_fails_only_its_requests() -> None:
    executor = CountingExecutor()
    client = make_client(executor)

    async def main():
        executor.fail_next = True
        with pytest.raises(RequestFailedError, match="device fell over"):
            await collect(client, "a", SamplingParams(max_tokens=3))
        outs = await collect(client, "b", SamplingParams(max_tokens=3))
        await client.shutdown()
        return outs

    assert asyncio.run(main())[-1].finished
    assert not client.engine.has_unfinished_requests()


def test_dead_engine_fails_every_request_and_names_the_cause() -> None:
    executor = CountingExecutor()
    executor.delay = 0.01
    client = make_client(executor)

    def broken_step():
        raise KeyError("scheduler state is corrupt")

    async def main():
        stream = client.generate("a", None, [1, 2], SamplingParams(max_tokens=50))
        await stream.__anext__()
        client.engine.start_step = broken_step  # what the engine loop calls each step
        with pytest.raises(EngineDeadError) as in_flight:
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError) as later:
            await collect(client, "b", SamplingParams(max_tokens=2))
        return str(in_flight.value), str(later.value)

    in_flight, later = asyncio.run(main())
    assert "engine thread of process" in in_flight and "KeyError" in in_flight and "corrupt" in in_flight
    assert later == in_flight
    assert not client.is_ready and client.errored


def test_stat_logger_factory_without_record_is_a_clear_error(monkeypatch) -> None:
    import loom.metrics as metrics

    monkeypatch.setattr(metrics, "load_plugins_strict",
                        lambda group, *, kind: {"no_record": lambda config: object()})
    with pytest.raises(TypeError, match="'no_record'.*no record"):
        load_stat_loggers(SimpleNamespace())

    def boom(config):
        raise RuntimeError("no config for me")

    monkeypatch.setattr(metrics, "load_plugins_strict", lambda group, *, kind: {"boom": boom})
    with pytest.raises(PluginError, match="'boom'.*no config for me"):
        load_stat_loggers(SimpleNamespace())


def test_a_stuck_engine_core_makes_adds_wait_off_the_loop_then_refuses_them():
    """The writer thread blocks on a full socket; the caller never does: past the limit, a 503-able refusal."""
    import threading

    from loom.engine.core_client import ProcCoreConnection
    from loom.engine.errors import EngineOverloadedError
    from loom.ipc.messages import AbortRequests, AddRequest

    class StuckChannel:
        def __init__(self) -> None:
            self.release, self.sent = threading.Event(), []

        def send(self, dst, msg) -> None:
            self.release.wait(30)  # the engine core reads nothing until released
            self.sent.append(msg)

    channel = StuckChannel()
    conn = ProcCoreConnection(channel, max_queued_adds=3)
    add = lambda i: AddRequest(request_id=str(i), prompt=None, prompt_token_ids=[1], sampling_params=SamplingParams())  # noqa: E731
    started = time.monotonic()
    for i in range(3):
        conn.add_request(add(i))
    conn.abort_requests(["1"])  # aborts always queue
    with pytest.raises(EngineOverloadedError, match="3 are waiting to reach it"):
        conn.add_request(add(3))
    assert time.monotonic() - started < 1  # nothing blocked the caller
    channel.release.set()
    deadline = time.monotonic() + 10
    while len(channel.sent) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [getattr(m, "request_id", None) or m.request_ids for m in channel.sent] == ["0", "1", "2", ["1"]]
    conn.add_request(add(4))  # room again
    while len(channel.sent) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(channel.sent[3], AbortRequests) and channel.sent[4].request_id == "4"


@pytest.mark.parametrize("first", ["start", "write"])
def test_a_write_that_fails_ends_the_engine_for_the_front_end(first):
    """The writer thread cannot go quietly: a request queued behind it would never reach the
    engine nor hear why. Its failure is reported as the engine's end, naming the cause, also
    when it came before ``start`` gave the connection a client to tell."""
    import threading

    from loom.engine.core_client import ProcCoreConnection
    from loom.ipc.messages import AddRequest

    class BrokenChannel:
        nonblocking = False  # the reader runs on a thread of its own

        def __init__(self) -> None:
            self.closed = threading.Event()

        def send(self, dst, msg) -> None:
            raise BrokenPipeError(32, "Broken pipe")

        def recv(self):
            self.closed.wait(30)  # nothing ever arrives
            raise EOFError("closed")

    heard: list[str] = []

    class Listener:
        def on_engine_dead(self, message, *, expected=False):
            heard.append(message)

    channel = BrokenChannel()
    conn = ProcCoreConnection(channel)
    add = AddRequest(request_id="0", prompt=None, prompt_token_ids=[1], sampling_params=SamplingParams())
    if first == "start":
        conn.start(Listener())
        conn.add_request(add)
    else:
        conn.add_request(add)
        conn._writer.join(10)
        assert not conn._writer.is_alive() and not heard
        conn.start(Listener())
    deadline = time.monotonic() + 10
    while not heard and time.monotonic() < deadline:
        time.sleep(0.01)
    channel.closed.set()
    assert heard and heard[0] == "the front end could not write to the supervisor (BrokenPipeError: [Errno 32] Broken pipe)"


def test_the_process_connection_reads_on_the_event_loop_and_hears_the_supervisor_go():
    """Frames are handled on the loop's thread, those read ahead before ``start`` too (CONFIG
    arrives that way), and a closed supervisor socket ends the engine with a reason."""
    import socket
    import threading

    from loom.engine.core_client import ProcCoreConnection
    from loom.ipc.channel import Channel
    from loom.ipc.messages import EngineOutputs, EngineReady
    from loom_supervisor.client import Client

    ours, theirs = socket.socketpair()
    channel, core = Channel(Client(ours, "frontend"), "frontend"), Channel(Client(theirs, "engine_core"), "engine_core")
    heard: list[tuple[str, object, int]] = []

    class Listener:
        kv_cache_tokens = None

        def on_outputs(self, outputs):
            heard.append(("outputs", outputs, threading.get_ident()))

        def on_engine_ready(self):
            heard.append(("ready", self.kv_cache_tokens, threading.get_ident()))

        def on_shutdown_requested(self):
            heard.append(("shutdown", None, threading.get_ident()))

        def on_engine_dead(self, message, *, expected=False):
            heard.append(("dead", message, threading.get_ident()))

    async def main() -> int:
        core._conn.send("frontend", "SHUTDOWN")  # a supervisor frame, sent as the supervisor would
        core.send("frontend", EngineReady(num_blocks=4, block_size=16))
        assert (await asyncio.to_thread(channel.recv)).kind.value == "SHUTDOWN"  # reads both frames
        ProcCoreConnection(channel).start(Listener())
        for _ in range(100):  # nothing more arrives on the socket: the frame read ahead must be heard alone
            await asyncio.sleep(0.01)
            if heard:
                break
        assert [what for what, _, _ in heard] == ["ready"]
        core.send("frontend", EngineOutputs())
        for _ in range(200):
            await asyncio.sleep(0.01)
            if len(heard) == 2 and theirs.fileno() >= 0:
                theirs.close()
            if len(heard) == 3:
                break
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert [(what, thread) for what, _, thread in heard] == [("ready", loop_thread), ("outputs", loop_thread),
                                                           ("dead", loop_thread)]
    assert heard[0][1] == 64 and isinstance(heard[1][1], EngineOutputs)
    assert "the supervisor connection closed (EOFError" in heard[2][1]


def test_the_process_connection_reads_on_a_thread_without_a_loop_or_a_nonblocking_client():
    """No running loop, or a supervisor client built before ``recv_nowait``: a reader thread."""
    from loom.engine.core_client import ProcCoreConnection
    from loom_supervisor.client import Client

    class OldClient:  # what an older wheel's Client offers
        def __init__(self, sock):
            new = Client(sock, "frontend")
            self.recv, self.send, self.fileno = new.recv, new.send, new.fileno

    assert _reader_thread(lambda sock: Client(sock, "frontend"), on_loop=False) == ProcCoreConnection.thread_name
    assert _reader_thread(OldClient, on_loop=True) == ProcCoreConnection.thread_name


def _reader_thread(make_client, on_loop: bool) -> str:
    """The name of the thread an ENGINE_READY is heard on, the connection started with or without a loop."""
    import socket
    import threading

    from loom.engine.core_client import ProcCoreConnection
    from loom.ipc.channel import Channel
    from loom.ipc.messages import EngineReady
    from loom_supervisor.client import Client

    ours, theirs = socket.socketpair()
    channel = Channel(make_client(ours), "frontend")
    heard = threading.Event()
    threads: list[str] = []

    class Listener:
        kv_cache_tokens = None

        def on_engine_ready(self):
            threads.append(threading.current_thread().name)
            heard.set()

        def on_engine_dead(self, message, *, expected=False):  # at the end: the socket closes
            pass

    async def start() -> None:
        ProcCoreConnection(channel).start(Listener())

    if on_loop:
        assert not channel.nonblocking
        asyncio.run(start())  # a running loop, but nothing to read on it without blocking
    else:
        ProcCoreConnection(channel).start(Listener())
    Channel(Client(theirs, "engine_core"), "engine_core").send("frontend", EngineReady(num_blocks=1, block_size=16))
    assert heard.wait(10)
    theirs.close()
    return threads[0]


def test_a_slow_log_never_blocks_record_and_reports_keep_their_order():
    """``record()`` may run on the event loop: while a logger's ``log()`` holds the loggers, the
    report waits and is passed on, in order, before the next ``log()``; never two at once."""
    import threading

    from loom.stats import EngineStats

    inside = threading.Lock()
    logging_now, release = threading.Event(), threading.Event()

    class Slow(Recorder):
        def record(self, stats) -> None:
            assert inside.acquire(blocking=False), "record() beside log()"
            super().record(stats)
            inside.release()

        def log(self) -> None:
            assert inside.acquire(blocking=False), "log() beside record()"
            super().log()
            logging_now.set()
            release.wait(10)
            inside.release()

    slow = Slow()
    client = make_client(stat_loggers=[slow], log_stats_interval=3600)  # only the last log(), below
    stats = [EngineStats(num_running=i, num_waiting=0, kv_cache_usage=0.0, prefix_cache_hit_rate=0.0,
                         num_prompt_tokens=0, num_generation_tokens=i, num_preemptions=0) for i in range(6)]
    client._record_stats(stats[0])
    assert slow.stats == stats[:1]  # the lock is free: at once
    client._stats_wake.set()  # the stats thread's last log(), as at shutdown
    assert logging_now.wait(10)  # the stats thread is inside log() now, holding the loggers
    started = time.monotonic()
    for s in stats[1:5]:
        client._record_stats(s)
    assert time.monotonic() - started < 1  # nothing waited for log()
    assert slow.stats == stats[:1]
    release.set()
    client._stats_thread.join(10)
    assert not client._stats_thread.is_alive()
    assert slow.stats == stats[:5]  # passed on by the stats thread after its last log(), in order
    client._record_stats(stats[5])
    assert slow.stats == stats and slow.logs == 1
    asyncio.run(client.shutdown())
