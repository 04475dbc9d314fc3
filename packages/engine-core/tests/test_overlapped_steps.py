"""Overlapped steps: the engine loop schedules step N + 1 before step N's tokens are known.

The worker here is :class:`OverlapWorker`: each step crosses a msgpack round trip at dispatch
(as the supervisor relays it, so later scheduling cannot change it) and runs in order when
collected, its ``PENDING_TOKEN`` filled by the worker process's own :class:`SampledTokens`. Its
model is ``test_llm_engine``'s fake, whose next token is computed from the K/V it reads back
through the block table: a wrong pending token, position or block changes every later token.
Every test compares the overlapped loop with the engine stepped one step at a time.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Callable

import pytest
from loom.engine.core import EngineCore
from loom.engine.llm_engine import LLMEngine
from loom.ipc import codec, messages
from loom.ipc.messages import PENDING_TOKEN, AbortRequests, AddRequest
from loom.worker.sampled_tokens import SampledTokens
from loom_plugin_api import SamplingParams
from loom_plugin_api.step import ModelRunnerOutput, PromptLogprobs, SchedulerOutput
from test_llm_engine import FakeExecutor, ScriptedInbox, generate, make_engine, random_prompts


class OverlapWorker(FakeExecutor):
    """The worker process of an overlapped serve, in this process (see the module's docstring).

    ``fail(step)`` makes a step raise; then, as the worker process does, every step already
    queued behind it is answered unrun until ``resume``."""

    overlaps_steps = True

    def __init__(self, num_blocks: int, fail: Callable[[SchedulerOutput], bool] = lambda step: False) -> None:
        super().__init__(num_blocks)
        self.queue: deque[bytes] = deque()
        self.tokens = SampledTokens()
        self.fail = fail
        self.failed = False
        self.log: list[str] = []
        self.pending_fed = 0
        self.sampled: dict[str, int] = {}
        self.finished_seen: list[str] = []

    def dispatch(self, out: SchedulerOutput) -> None:
        self.log.append("dispatch")
        self.queue.append(messages.encode(out))

    def collect(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.log.append("collect")
        step = codec.decode(SchedulerOutput, self.queue.popleft())
        if self.failed:
            raise RuntimeError("not run: a step before it failed")
        self.pending_fed += sum(r.token_ids[-1:] == [PENDING_TOKEN] for r in step.scheduled)
        self.finished_seen += step.finished_req_ids
        for req_id in step.finished_req_ids:
            self.sampled.pop(req_id, None)
        for r in step.scheduled:  # what the sampler's min_tokens reads: the tokens sampled before this one
            assert not r.sample or r.num_output_tokens == self.sampled.get(r.req_id, 0), r
        try:
            self.tokens.fill(step)
            if self.fail(step):
                raise RuntimeError("device lost")
            output = self.execute_model(step)
        except Exception:
            self.failed = True
            raise
        self.tokens.record(output)
        for req_id in output.req_ids:
            self.sampled[req_id] = self.sampled.get(req_id, 0) + 1
        return output

    def resume(self) -> None:
        self.failed = False


def overlapped(fail: Callable[[SchedulerOutput], bool] = lambda step: False, **kwargs) -> LLMEngine:
    engine = make_engine(**kwargs)
    engine.executor = OverlapWorker(engine.executor.num_blocks, fail)
    engine.overlap = True
    return engine


class Inbox(ScriptedInbox):
    """Stops the loop once the script is done, the engine idle and no step out (as the supervisor's
    stop would, later)."""

    def get(self, block: bool):
        commands = super().get(block)
        if commands is None and self.engine.in_flight:
            return []
        return commands


def serve(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
          script: dict[int, list] | None = None) -> tuple[dict[str, list[list[int]]], dict[str, str]]:
    """Run ``EngineCore.run`` as the engine-core process does: every request added at once (plus
    ``script``'s commands by loop iteration); each request's final token ids, and the errors."""
    adds = [AddRequest(request_id=str(i), prompt=None, prompt_token_ids=p, sampling_params=sp)
            for i, (p, sp) in enumerate(zip(prompts, params))]
    reports = []
    EngineCore(engine).run(Inbox(engine, {1: adds, **(script or {})}), reports.append)
    streamed: dict[str, dict[int, list[int]]] = {}
    finished = set()
    for report in reports:
        for o in report.outputs:
            for c in o.outputs:
                streamed.setdefault(o.request_id, {}).setdefault(c.index, []).extend(c.token_ids)
            if o.finished:
                assert o.request_id not in finished
                finished.add(o.request_id)
    final = {i: [t for _, t in sorted(streamed[i].items())] for i in finished}
    errors = {e.request_id: e.message for r in reports for e in r.errors}
    assert not engine.in_flight and not engine.scheduler.in_flight
    assert engine.block_manager.usage == 0
    return final, errors


def reference(prompts: list[list[int]], params: list[SamplingParams], **kwargs) -> dict[str, list[list[int]]]:
    outs = generate(make_engine(**kwargs), prompts, params)
    return {o.request_id: [list(c.token_ids) for c in o.outputs] for o in outs}


def mixed_params(prompts: list[list[int]]) -> list[SamplingParams]:
    """Lengths from 1 to 14, a stop token each request meets (its reference's fourth token), min_tokens
    past it, n = 2 with seeds, logprobs."""
    plain = [SamplingParams(max_tokens=14, ignore_eos=True) for _ in prompts]
    ref = reference(prompts, plain)
    params = []
    for i in range(len(prompts)):
        first = ref[str(i)][0]
        stop = first[3] if first[3] not in first[:3] else None
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(max_tokens=1 + i % 14, ignore_eos=True))
        elif kind == 1 and stop is not None:
            params.append(SamplingParams(max_tokens=14, ignore_eos=True, stop_token_ids=[stop]))
        elif kind == 2 and stop is not None:
            params.append(SamplingParams(max_tokens=14, ignore_eos=True, stop_token_ids=[stop], min_tokens=6))
        elif kind == 3:
            params.append(SamplingParams(max_tokens=9, n=2, seed=i, temperature=1.0, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=7, logprobs=1))
    return params


def test_overlapped_steps_give_the_tokens_of_steps_one_at_a_time():
    prompts = random_prompts(30, seed=11, lo=2, hi=40, shared=5)
    params = mixed_params(prompts)
    want = reference(prompts, params, budget=48, max_num_seqs=12)
    engine = overlapped(budget=48, max_num_seqs=12)  # prompts of 40+ tokens take two chunks
    got, errors = serve(engine, prompts, params)
    assert errors == {} and got == want
    worker = engine.executor
    # the loop did overlap: a second step went out before the first came back, decodes fed pending tokens
    assert "dispatch,dispatch" in ",".join(worker.log) and worker.pending_fed > 100
    assert any(0 < len(t[0]) < 14 and params[int(i)].stop_token_ids for i, t in got.items())  # stopped on a token
    assert engine.get_stats().num_generation_tokens == sum(len(t) for ts in got.values() for t in ts)
    assert all(r.num_pending == 0 for r in engine.scheduler.requests.values())


def test_a_request_ending_on_a_pending_token_is_not_scheduled_past_its_length():
    """One request, max_tokens 5: the loop never schedules a sixth token (it knows the fifth is its
    last), and a stop token ends it with exactly one step computed for nothing."""
    prompt = random_prompts(1, seed=2, lo=6, hi=6)[0]
    engine = overlapped()
    got, _ = serve(engine, [prompt], [SamplingParams(max_tokens=5, ignore_eos=True)])
    assert len(got["0"][0]) == 5
    assert engine.executor.steps == 5  # prefill + 4 decodes: none for a sixth token
    stop = got["0"][0][2]
    engine = overlapped()
    got2, _ = serve(engine, [prompt], [SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[stop])])
    assert got2["0"][0] == got["0"][0][:got["0"][0].index(stop) + 1]
    assert engine.executor.steps == len(got2["0"][0]) + 1  # the step after the stop token ran, its token dropped


def test_overlapped_steps_under_preemption_give_the_same_tokens():
    """A pool too small for everyone: requests are preempted while a step of theirs is in flight."""
    prompts = random_prompts(16, seed=3, lo=4, hi=16)
    params = [SamplingParams(max_tokens=20, ignore_eos=True, seed=i) for i in range(16)]
    want = reference(prompts, params)
    engine = overlapped(num_blocks=12, max_model_len=48)
    got, errors = serve(engine, prompts, params)
    assert errors == {} and got == want
    assert engine.get_stats().num_preemptions > 0


def test_blocks_filled_by_pending_tokens_serve_later_prompts_from_the_prefix_cache():
    """A chat's next turn repeats the previous answer: the blocks the answer's decodes filled (each
    fed as a pending token) are in the prefix cache as they are when stepping one step at a time."""
    prompt = random_prompts(1, seed=6, lo=6, hi=6)[0]
    params = SamplingParams(max_tokens=11, ignore_eos=True)
    answer = reference([prompt], [params])["0"][0]
    turn2 = prompt + answer + [9, 10, 11]
    hits = []
    for engine in (make_engine(), overlapped()):
        serve(engine, [prompt], [params])
        before = engine.block_manager.prefix_hits
        got, _ = serve(engine, [turn2], [params])
        hits.append(engine.block_manager.prefix_hits - before)
    # 6 + 11 tokens, the last never fed: four full blocks of 4, the fourth filled by the last step
    assert hits[0] == hits[1] == 16


def test_an_abort_while_two_steps_are_out_ends_only_that_request():
    prompts = random_prompts(4, seed=8, lo=5, hi=9)
    params = [SamplingParams(max_tokens=12, ignore_eos=True) for _ in prompts]
    want = reference(prompts, params)
    engine = overlapped()
    got, errors = serve(engine, prompts, params, script={4: [AbortRequests(request_ids=["2"])]})
    assert errors == {} and "2" not in got
    assert got == {k: v for k, v in want.items() if k != "2"}


def test_an_id_aborted_and_added_again_while_steps_are_out_gets_only_its_own_tokens():
    prompts = random_prompts(3, seed=12, lo=5, hi=9)
    params = [SamplingParams(max_tokens=10, ignore_eos=True) for _ in prompts]
    want = reference(prompts, params)
    engine = overlapped()
    again = AddRequest(request_id="1", prompt=None, prompt_token_ids=prompts[2], sampling_params=params[2])
    got, errors = serve(engine, prompts[:2], params[:2], script={4: [AbortRequests(request_ids=["1"]), again]})
    assert errors == {} and got["0"] == want["0"]
    # under one id: the first request's tokens streamed before the abort, then the second's, all of them
    first, second = got["1"][0][:-10], got["1"][0][-10:]
    assert second == want["2"][0] and 0 < len(first) < 10 and first == want["1"][0][:len(first)]


@pytest.mark.parametrize("fail_at", [1, 3, 6])
def test_a_failed_overlapped_step_is_rerun_one_request_at_a_time(fail_at):
    """A transient failure while the next step is already out: that step comes back unrun, both
    steps' requests are recomputed (each alone, to find a culprit) and end as without it."""
    prompts = random_prompts(5, seed=5, lo=9, hi=30, shared=8)
    params = [SamplingParams(max_tokens=8, ignore_eos=True, seed=i) for i in range(5)]
    want = reference(prompts, params, budget=48)
    steps = iter(range(1 << 30))
    engine = overlapped(fail=lambda step: next(steps) == fail_at, budget=48)
    got, errors = serve(engine, prompts, params)
    assert errors == {} and got == want
    assert "dispatch,dispatch,collect" in ",".join(engine.executor.log[:fail_at * 3 + 6])  # it failed with a step behind it


def test_a_request_that_breaks_every_step_fails_alone_and_the_others_go_on():
    prompts = random_prompts(5, seed=9, lo=4, hi=40, shared=6)
    params = [SamplingParams(max_tokens=8, ignore_eos=True, seed=i) for i in range(5)]
    want = reference(prompts, params, budget=48)
    poisoned = prompts[2][-1]
    engine = overlapped(fail=lambda step: any(poisoned in r.token_ids and r.req_id == "2" for r in step.scheduled),
                        budget=48)
    got, errors = serve(engine, prompts, params)
    assert list(errors) == ["2"] and "device lost" in errors["2"]
    assert got == {k: v for k, v in want.items() if k != "2"}


def test_a_failed_step_of_one_request_ends_it_and_recomputes_the_step_behind_it():
    """Request 0's step fails while the step behind it (0's next decode, 1's prefill) is out: 0 ends
    with the error, the step behind comes back unrun and 1 is recomputed from its prompt."""
    prompts = random_prompts(2, seed=4, lo=6, hi=12)
    params = [SamplingParams(max_tokens=8, ignore_eos=True) for _ in prompts]
    want = reference(prompts[1:], params[1:])

    def fail(step: SchedulerOutput) -> bool:
        behind = [codec.decode(SchedulerOutput, b) for b in engine.executor.queue]
        return any(n.req_id == "1" for s in behind for n in s.new_requests)

    engine = overlapped(fail=fail)
    got, errors = serve(engine, prompts[:1], params[:1], script={3: [], 4: [
        AddRequest(request_id="1", prompt=None, prompt_token_ids=prompts[1], sampling_params=params[1])]})
    assert list(errors) == ["0"] and "device lost" in errors["0"]
    assert got == {"1": want["0"]}
    assert engine.get_stats().num_preemptions == 2  # both, from the step behind: 1 recomputed, 0 then ended


def cached_blocks_hold_their_tokens(engine: LLMEngine) -> bool:
    """Every block in the prefix cache holds, in the fake worker's K/V, the tokens it is cached for."""
    bm, kv = engine.block_manager, engine.executor.kv
    return all(kv[b] == list(bm.block_tokens[b][1:]) for b in bm.cached.values())


def fail_at_step(k: int) -> Callable[[SchedulerOutput], bool]:
    """A worker's ``fail``: the k-th step it runs (from 0) fails."""
    steps = itertools.count()
    return lambda step: next(steps) == k


@pytest.mark.parametrize("seed", range(12))
def test_random_failures_under_preemption_with_stops_and_an_abort(seed):
    """A step fails at each point of a run on a pool too small for everyone (preemptions with steps
    out), one request stops on a token, one is aborted: every other request gets the tokens of
    steps one at a time, the failed step's lone request (if it ran alone) the error, and no block
    in the prefix cache is one a failed step never wrote."""
    rng = random.Random(seed)
    prompts = random_prompts(6, seed=seed, lo=3, hi=20, shared=rng.choice([0, 4, 8]))
    params = [SamplingParams(max_tokens=rng.randint(2, 12), ignore_eos=True, seed=i) for i in range(6)]
    first = reference(prompts, params, budget=16)["1"][0]
    if len(first) > 2 and first[1] != first[0]:
        params[1] = SamplingParams(max_tokens=params[1].max_tokens, ignore_eos=True, seed=1, stop_token_ids=[first[1]])
    want = reference(prompts, params, budget=16)
    for fail_at, num_blocks in itertools.product(range(12), (10, 14)):
        engine = overlapped(fail=fail_at_step(fail_at), num_blocks=num_blocks, budget=16, max_model_len=48)
        got, errors = serve(engine, prompts, params, script={rng.randint(2, 10): [AbortRequests(request_ids=["5"])]})
        assert len(errors) <= 1 and all("device lost" in m for m in errors.values())
        for i, tokens in got.items():
            assert tokens == want[i] or i == "5" and tokens[0] == want[i][0][:len(tokens[0])], (fail_at, num_blocks, i)
        assert set(got) | set(errors) | {"5"} == set(want)
        assert cached_blocks_hold_their_tokens(engine), (fail_at, num_blocks)


def test_finished_ids_of_a_step_answered_unrun_reach_the_worker_later():
    """Request 0 ends; the step that would tell the worker is answered unrun (a step before it failed):
    the worker still hears of it, with the next step that runs."""
    prompts = random_prompts(3, seed=1, lo=6, hi=6)
    params = [SamplingParams(max_tokens=1, ignore_eos=True)] + [SamplingParams(max_tokens=6, ignore_eos=True)] * 2
    steps = itertools.count()
    engine = overlapped(fail=lambda step: next(steps) == 1 and not step.finished_req_ids)
    later = AddRequest(request_id="z", prompt=None, prompt_token_ids=prompts[1], sampling_params=params[1])
    got, _ = serve(engine, prompts, params, script={12: [later]})
    assert "0" in got and "0" in engine.executor.finished_seen and "0" not in engine.executor.seeds


class PromptLogprobsWorker(OverlapWorker):
    """Also scores the prompt, chunk by chunk, as the worker's prompt-logprobs service does."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.scored: dict[str, list[int]] = {}  # request -> [prompt length, positions scored]

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.scored.pop(req_id, None)
        for n in out.new_requests:
            if n.sampling_params.prompt_logprobs is not None and n.req_id not in self.scored:
                self.scored[n.req_id] = [len(n.prompt_token_ids), 0]
        output = super().execute_model(out)
        for r in out.scheduled:
            state = self.scored.get(r.req_id)
            if state is None:
                continue
            lo, hi = state[1], min(r.num_computed_tokens + len(r.token_ids), state[0] - 1)
            if lo < hi:
                k = hi - lo
                output.prompt_logprobs.append(PromptLogprobs(req_id=r.req_id, start=lo + 1, logprobs=[-1.0] * k,
                                                             ranks=[1] * k, top_token_ids=[[]] * k,
                                                             top_logprobs=[[]] * k))
                state[1] = hi
        return output


def test_an_id_reused_while_its_prompt_logprobs_chunk_is_out_gets_only_its_own():
    prompt = random_prompts(1, seed=1, lo=40, hi=40)[0]
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0)
    engine = overlapped(budget=8)  # five prefill chunks
    engine.executor = PromptLogprobsWorker(engine.executor.num_blocks)
    again = AddRequest(request_id="0", prompt=None, prompt_token_ids=prompt, sampling_params=params)
    got, errors = serve(engine, [prompt], [params], script={4: [AbortRequests(request_ids=["0"]), again]})
    assert errors == {} and len(got["0"][0]) >= 3


def test_the_worker_fills_each_pending_token_with_the_last_token_it_sampled():
    tokens = SampledTokens()
    tokens.record(ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[5, 6]))
    tokens.record(ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[9]))
    from loom_plugin_api.step import ScheduledRequest

    def req(req_id: str, token_ids: list[int]) -> ScheduledRequest:
        return ScheduledRequest(req_id=req_id, token_ids=token_ids, num_computed_tokens=3, block_ids=[0], sample=True)

    step = SchedulerOutput(scheduled=[req("a", [PENDING_TOKEN]), req("b", [4, PENDING_TOKEN]), req("c", [1])])
    tokens.fill(step)
    assert [r.token_ids for r in step.scheduled] == [[9], [4, 6], [1]]
    with pytest.raises(RuntimeError, match="'b' feeds a token this worker never sampled"):
        tokens.fill(SchedulerOutput(finished_req_ids=["b"], scheduled=[req("b", [PENDING_TOKEN])]))


def test_a_rank_s_error_about_a_step_already_failed_is_not_the_next_step_s():
    """Tensor parallel: every rank that fails a step says so; the second rank's error arrives after
    the engine has moved on and must not fail the next step. And rank 0 answers every step: when
    another rank failed, rank 0's output of that step is not taken for the next step's."""
    from loom.engine.multiproc_executor import MultiprocExecutor
    from loom.ipc.channel import Message
    from loom.ipc.messages import Kind, StepError

    ok = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[3])
    late = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[4])
    frames = deque([Message("worker:0", Kind.STEP_ERROR, StepError(rank=0, message="boom", step=0)),
                    Message("worker:1", Kind.STEP_ERROR, StepError(rank=1, message="boom", step=0)),
                    Message("worker:0", Kind.MODEL_OUTPUT, ok),
                    # rank 1 fails step 2 after rank 0's part of it: rank 0's output still comes, for step 2
                    Message("worker:1", Kind.STEP_ERROR, StepError(rank=1, message="late boom", step=2)),
                    Message("worker:0", Kind.MODEL_OUTPUT, late),
                    Message("worker:0", Kind.MODEL_OUTPUT, ok)])

    class Channel:
        def recv(self, timeout=None):
            return frames.popleft()

    executor = MultiprocExecutor.__new__(MultiprocExecutor)  # past the start-up handshake
    executor.channel, executor.pending, executor.answers, executor.step_timeout = Channel(), deque(), deque(), None
    with pytest.raises(Exception, match="worker:0: boom"):
        executor.collect(SchedulerOutput())
    assert executor.collect(SchedulerOutput()) is ok
    with pytest.raises(Exception, match="worker:1: late boom"):
        executor.collect(SchedulerOutput())  # takes rank 0's output of step 2 with it
    assert executor.collect(SchedulerOutput()) is ok and not frames
