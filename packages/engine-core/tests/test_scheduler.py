from __future__ import annotations

import random

import pytest
from loom.config import CacheConfig, SchedulerConfig
from loom.engine.block_manager import BlockManager
from loom.engine.request import Request, RequestStatus
from loom.engine.scheduler import Scheduler
from loom_plugin_api import LoRARequest, SamplingParams
from loom_plugin_api.step import (
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SampledLogprobs,
    SchedulerOutput,
)

BS = 4
VOCAB = 1000


def make_scheduler(
    num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 16, max_model_len: int = 256,
    chunked: bool = True, prefix_caching: bool = True,
) -> Scheduler:
    cache = CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    return Scheduler(sched, cache, max_model_len, BlockManager(num_blocks, BS, prefix_caching))


_arrivals = iter(range(1 << 30))


def make_request(req_id: str, prompt: list[int], eos: int | None = None, **params) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(req_id, None, prompt, SamplingParams(**params), next(_arrivals), eos_token_id=eos)


def fake_model(sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """Next token from the whole context, so a wrong chunk or position changes the output."""
    req_ids, tokens = [], []
    for r in out.scheduled:
        req = sched.requests[r.req_id]
        end = r.num_computed_tokens + len(r.token_ids)
        assert req.all_token_ids[r.num_computed_tokens:end] == r.token_ids
        assert len(r.block_ids) * BS >= end
        if r.sample:
            assert end == req.num_tokens
            req_ids.append(r.req_id)
            tokens.append(sum((i + 1) * t for i, t in enumerate(req.all_token_ids)) % VOCAB)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=tokens)


def run(sched: Scheduler, requests: list[Request], max_steps: int = 10_000) -> tuple[dict, list[SchedulerOutput]]:
    for req in requests:
        sched.add_request(req)
    outputs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        outputs.append(out)
        sched.update_from_output(out, fake_model(sched, out))
    assert not sched.has_unfinished_requests()
    return {r.request_id: list(r.output_token_ids) for r in requests}, outputs


def random_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_budget_and_max_num_seqs_respected():
    sched = make_scheduler(budget=32, max_num_seqs=5)
    reqs = [make_request(f"r{i}", p) for i, p in enumerate(random_prompts(20))]
    results, outputs = run(sched, reqs)
    assert all(len(v) == 8 for v in results.values())
    for out in outputs:
        assert out.total_num_scheduled_tokens <= 32
        assert len(out.scheduled) <= 5
    assert sched.block_manager.num_free_blocks == 64


def test_chunked_prefill_of_long_prompt():
    sched = make_scheduler(budget=16)
    prompt = list(range(1, 51))
    sched.add_request(make_request("long", prompt))
    chunks = []
    for _ in range(4):
        out = sched.schedule()
        (r,) = out.scheduled
        chunks.append((r.num_computed_tokens, len(r.token_ids), r.sample))
        sched.update_from_output(out, fake_model(sched, out))
    assert chunks == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True)]
    assert sched.requests["long"].num_output_tokens == 1


def test_without_chunking_a_long_prompt_waits_for_room():
    sched = make_scheduler(budget=20, chunked=False)
    sched.add_request(make_request("a", list(range(1, 10)), max_tokens=2))
    out = sched.schedule()
    sched.update_from_output(out, fake_model(sched, out))
    sched.add_request(make_request("b", list(range(101, 121))))  # 20 tokens: no room beside a's decode
    out = sched.schedule()
    assert [r.req_id for r in out.scheduled] == ["a"]
    sched.update_from_output(out, fake_model(sched, out))
    out = sched.schedule()  # a finished last step: b goes whole
    assert [(r.req_id, len(r.token_ids)) for r in out.scheduled] == [("b", 20)]


def test_prefill_and_decode_in_one_step():
    sched = make_scheduler()
    sched.add_request(make_request("a", [5, 6, 7]))
    out = sched.schedule()
    sched.update_from_output(out, fake_model(sched, out))
    sched.add_request(make_request("b", [8, 9, 10, 11, 12]))
    out = sched.schedule()
    assert [(r.req_id, len(r.token_ids), r.sample) for r in out.scheduled] == [("a", 1, True), ("b", 5, True)]
    assert [n.req_id for n in out.new_requests] == ["b"]
    assert out.scheduled[0].num_output_tokens == 1


def test_preemption_recomputes_and_gives_same_outputs():
    prompts = random_prompts(12, seed=1, lo=5, hi=20)
    params = dict(max_tokens=24)
    expected, _ = run(make_scheduler(num_blocks=256), [make_request(f"r{i}", p, **params) for i, p in enumerate(prompts)])
    sched = make_scheduler(num_blocks=14)  # 56 tokens: a few requests at a time
    got, outputs = run(sched, [make_request(f"r{i}", p, **params) for i, p in enumerate(prompts)])
    assert got == expected
    assert sched.num_preemptions > 0
    # A preempted request is announced to the workers again when it comes back.
    announced = [n.req_id for out in outputs for n in out.new_requests]
    assert len(announced) == 12 + sched.num_preemptions
    assert sched.block_manager.num_free_blocks == 14


def test_preempts_the_most_recent_arrival():
    sched = make_scheduler(num_blocks=4, max_model_len=16)
    a, b = make_request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=9), make_request("b", [9, 9, 9, 9, 9], max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    while b.status != RequestStatus.PREEMPTED:
        out = sched.schedule()
        sched.update_from_output(out, fake_model(sched, out))
        assert a.status == RequestStatus.RUNNING
    assert sched.waiting[0] is b and b.block_ids == [] and b.num_computed_tokens == 0


def test_prefix_cache_hit_for_shared_prefix():
    sched = make_scheduler()
    shared = list(range(100, 120))  # 5 full blocks
    sched.add_request(make_request("a", shared + [1, 2]))
    out = sched.schedule()
    sched.update_from_output(out, fake_model(sched, out))
    sched.add_request(make_request("b", shared + [3, 4, 5]))
    out = sched.schedule()
    rb = next(r for r in out.scheduled if r.req_id == "b")
    assert rb.num_computed_tokens == 20 and rb.token_ids == [3, 4, 5]
    assert sched.requests["b"].num_cached_tokens == 20
    assert rb.block_ids[:5] == sched.requests["a"].block_ids[:5]


def test_same_step_siblings_share_prompt_blocks():
    sched = make_scheduler()
    prompt = list(range(1, 18))
    for i in range(3):
        sched.add_request(make_request(f"p_{i}", prompt, seed=i, temperature=1.0))
    out = sched.schedule()
    assert [r.num_computed_tokens for r in out.scheduled] == [0, 16, 16]
    assert sched.block_manager.num_free_blocks == 64 - (5 + 1 + 1)


def test_abort_frees_blocks_and_tells_workers():
    sched = make_scheduler(num_blocks=16)
    sched.add_request(make_request("a", list(range(1, 30))))
    sched.add_request(make_request("b", list(range(1, 10))))
    out = sched.schedule()
    sched.update_from_output(out, fake_model(sched, out))
    sched.add_request(make_request("c", [1, 2]))
    aborted = sched.abort_requests(["a", "c", "missing"])
    assert [r.request_id for r in aborted] == ["a", "c"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    assert sched.block_manager.num_free_blocks == 16 - 3  # b's 3 blocks
    out = sched.schedule()
    assert out.finished_req_ids == ["a", "c"]
    assert [r.req_id for r in out.scheduled] == ["b"]


def test_stop_conditions():
    sched = make_scheduler(max_model_len=12)
    probe = make_request("probe", [1, 2, 3], max_tokens=8)
    expected, _ = run(sched, [probe])
    seq = expected["probe"]
    eos = seq[2]
    cases = {
        "eos": (dict(), eos, seq[:3], "stop", None),
        "ignore_eos": (dict(ignore_eos=True), eos, seq, "length", None),
        # EOS at the second token does not count under min_tokens (the sampler masks it too).
        "min_tokens": (dict(min_tokens=4), seq[1], seq if seq[1] not in seq[3:] else None, None, None),
        "stop_id": (dict(stop_token_ids=[seq[4]]), None, seq[:5], "stop", seq[4]),
        "max_tokens": (dict(max_tokens=2), None, seq[:2], "length", None),
        "max_model_len": (dict(max_tokens=None), None, None, "length", None),
    }
    for name, (params, eos_id, want, reason, stop_reason) in cases.items():
        params.setdefault("max_tokens", 8)
        req = make_request(name, [1, 2, 3], eos=eos_id, **params)
        got, outputs = run(sched, [req])
        if want is not None:
            assert got[name] == want, name
        if reason is not None:
            assert req.finish_reason == reason, name
        assert req.stop_reason == stop_reason, name
        assert outputs[-1].finished_req_ids == [] or name in outputs[-1].finished_req_ids
    # max_model_len 12: a 3-token prompt gets 9 tokens at most.
    long = make_request("long", [1, 2, 3], max_tokens=None)
    got, _ = run(sched, [long])
    assert len(got["long"]) == 9 and long.finish_reason == "length"


def test_finished_ids_reach_the_next_output():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=1))
    out = sched.schedule()
    updated = sched.update_from_output(out, fake_model(sched, out))
    assert [r.request_id for r in updated] == ["a"] and updated[0].is_finished
    assert sched.schedule().finished_req_ids == ["a"]
    assert sched.schedule().finished_req_ids == []


def test_cache_too_small_for_a_long_generation_ends_it_as_length():
    sched = make_scheduler(num_blocks=3, max_model_len=100)  # 12 tokens of KV at most
    req = make_request("a", [1, 2, 3, 4, 5], max_tokens=50)
    got, _ = run(sched, [req])
    assert len(got["a"]) == 7 and req.finish_reason == "length"


def test_finish_requests_keeps_or_drops_their_cached_prefix():
    prompt = list(range(1, 10))  # two full blocks and one token
    for invalidate, hits in ((False, 2), (True, 0)):
        sched = make_scheduler()
        a, b = make_request("a", prompt), make_request("b", [7, 7])
        sched.add_request(a)
        sched.add_request(b)
        sched.schedule()  # the prefill fills and registers a's full blocks
        kwargs = {"invalidate_cache": True} if invalidate else {}
        finished = sched.finish_requests(["missing", "a", "b"], RequestStatus.FINISHED_ABORTED, **kwargs)
        assert [r.request_id for r in finished] == ["a", "b"]  # an unknown id does not stop the rest
        assert sched.finished_req_ids == ["a", "b"] and not sched.has_unfinished_requests()
        again = make_request("again", prompt)
        assert len(sched.block_manager.get_computed_blocks(again)[0]) == hits


def test_preempting_the_tail_still_schedules_the_earlier_request_this_step():
    sched = make_scheduler(num_blocks=4, max_model_len=16)
    a, b = make_request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=9), make_request("b", [9, 9, 9, 9, 9], max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    while True:
        out = sched.schedule()
        if b.status == RequestStatus.PREEMPTED:
            assert [r.req_id for r in out.scheduled] == ["a"]  # a got b's blocks in the same step
            break
        sched.update_from_output(out, fake_model(sched, out))


def test_finished_requests_leave_running_and_keep_their_cached_prefix():
    sched = make_scheduler()
    prompt = list(range(1, 10))
    a = make_request("a", prompt, max_tokens=1)
    sched.add_request(a)
    out = sched.schedule()
    sched.update_from_output(out, fake_model(sched, out))
    assert a.status == RequestStatus.FINISHED_LENGTH and sched.num_running == 0
    assert len(sched.block_manager.get_computed_blocks(make_request("again", prompt))[0]) == 2


def test_eos_stops_once_min_tokens_are_out():
    sched = make_scheduler()
    a = make_request("a", [1, 2, 3], eos=5, min_tokens=2, max_tokens=10)
    sched.add_request(a)
    for expected in (RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED):
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[5]))
        assert a.status == expected
    assert a.output_token_ids == [5, 5]


def test_logprobs_and_prompt_logprobs_reach_their_requests():
    sched = make_scheduler()
    a, b = make_request("a", [1, 2, 3]), make_request("b", [4, 5, 6])
    sched.add_request(a)
    sched.add_request(b)
    lp = SampledLogprobs(token_id=7, logprob=-0.5, rank=1, top_token_ids=[], top_logprobs=[])
    chunk = PromptLogprobs(req_id="a", start=1, logprobs=[-1.0, -2.0], ranks=[1, 1], top_token_ids=[[], []],
                           top_logprobs=[[], []])
    for step in range(2):
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=["gone", "a", "b"], sampled_token_ids=[0, 7, 8], logprobs=[lp, lp, None],
            prompt_logprobs=[PromptLogprobs(req_id="gone", start=1, logprobs=[], ranks=[], top_token_ids=[],
                                            top_logprobs=[]), chunk] if step == 0 else []))
    assert a.output_token_ids == [7, 7] and b.output_token_ids == [8, 8]
    assert a.logprobs == [lp, lp] and a.cumulative_logprob == -1.0 and b.logprobs == []
    assert a.prompt_logprobs == [chunk] and b.prompt_logprobs == []


def test_duplicate_request_id_is_refused():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3]))
    with pytest.raises(ValueError, match=r"request id 'a' is already in use"):
        sched.add_request(make_request("a", [4, 5]))


def test_request_aborted_before_the_first_step_reaches_the_first_output():
    sched = make_scheduler()
    assert sched.schedule().finished_req_ids == []
    sched.add_request(make_request("a", [1, 2, 3]))
    assert [r.request_id for r in sched.abort_requests(["a"])] == ["a"]
    out = sched.schedule()
    assert out.finished_req_ids == ["a"] and out.scheduled == []


def test_new_request_data_carries_the_whole_prompt_even_when_cached():
    sched = make_scheduler()
    prompt = list(range(1, 10))
    run(sched, [make_request("a", prompt, max_tokens=1)])  # leaves its two full blocks cached
    b = make_request("b", prompt + [11, 12], eos=3, temperature=0.5)
    sched.add_request(b)
    out = sched.schedule()
    assert out.new_requests == [NewRequestData(req_id="b", sampling_params=b.sampling_params, prompt_len=11,
                                               prompt_token_ids=prompt + [11, 12], eos_token_id=3)]
    assert out.scheduled[0].num_computed_tokens == 8  # the cached tokens are not scheduled


def test_every_running_request_advances_each_step():
    sched = make_scheduler()
    for name in "abc":
        sched.add_request(make_request(name, [1, 2]))
    for want in (2, 1, 1):  # the prefill of all three, then one decode each, every step
        out = sched.schedule()
        assert [(r.req_id, len(r.token_ids)) for r in out.scheduled] == [(n, want) for n in "abc"]
        sched.update_from_output(out, fake_model(sched, out))


def test_waiting_request_gets_the_last_token_of_budget_and_none_past_it():
    for budget, want in ((5, [("a", 4), ("b", 1)]), (4, [("a", 4)])):
        sched = make_scheduler(budget=budget)
        sched.add_request(make_request("a", [1, 2, 3, 4]))
        sched.add_request(make_request("b", [5, 6, 7]))
        out = sched.schedule()
        assert [(r.req_id, len(r.token_ids)) for r in out.scheduled] == want
        assert [n.req_id for n in out.new_requests] == [name for name, _ in want]
        assert sched.num_waiting == 2 - len(want)


def test_running_request_gets_the_last_token_of_budget_and_none_past_it():
    """Running requests are served in arrival order, as after a preemption an early request
    readmitted in chunks sits ahead of a later one already decoding."""
    sched = make_scheduler(budget=4)
    early = make_request("early", list(range(1, 11)))  # 10 tokens: chunks of 3, 4, 3
    late = make_request("late", [20])
    sched.add_request(late)
    sched.add_request(early)
    steps = []
    for _ in range(3):
        out = sched.schedule()
        steps.append([(r.req_id, len(r.token_ids)) for r in out.scheduled])
        sched.update_from_output(out, fake_model(sched, out))
    assert steps == [[("late", 1), ("early", 3)], [("early", 4)], [("early", 3), ("late", 1)]]


def test_no_request_is_admitted_in_a_step_that_preempted():
    """The preempted request would fit again with a small chunk, but it waits for the next step."""
    sched = make_scheduler(num_blocks=5, budget=8, prefix_caching=False)
    a, b = make_request("a", [1, 2, 3, 4], max_tokens=20), make_request("b", list(range(1, 17)))
    sched.add_request(a)
    sched.add_request(b)
    for want in ([("a", 4), ("b", 4)], [("a", 1), ("b", 7)], [("a", 1)], [("a", 1), ("b", 7)]):
        out = sched.schedule()  # third step: a's decode needs b's blocks
        assert [(r.req_id, len(r.token_ids)) for r in out.scheduled] == want
        sched.update_from_output(out, fake_model(sched, out))
    assert sched.num_preemptions == 1


# ---- failure isolation (Scheduler.isolate) ----------------------------------------------------


def step(sched: Scheduler) -> SchedulerOutput:
    """One step that succeeds: schedule, the fake model, update."""
    out = sched.schedule()
    sched.update_from_output(out, fake_model(sched, out))
    return out


def fail_step(sched: Scheduler) -> SchedulerOutput:
    """The next step fails as LLMEngine handles it: never updated (discarded), its requests isolated."""
    out = sched.schedule()
    sched.discard(out)
    sched.isolate(r.req_id for r in out.scheduled)  # a generator, as the engine passes it
    return out


def scheduled(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request, first position, number of tokens, samples) of each request in the step."""
    return [(r.req_id, r.num_computed_tokens, len(r.token_ids), r.sample) for r in out.scheduled]


def cached_tokens(sched: Scheduler, tokens: list[int]) -> int:
    return sched.block_manager.get_computed_blocks(make_request("probe", tokens + [0]))[1]


def test_after_a_failed_step_each_suspect_runs_alone_in_arrival_order_then_all_batch_again():
    """The failed step's requests are recomputed one per step, oldest first, each from scratch
    (the blocks they held leave the prefix cache) until it samples; a request waiting behind
    them and the suspects already cleared wait meanwhile; then everyone is batched again and
    ends as it would have without the failure."""
    prompt = list(range(1, 10))  # two full blocks and one token

    def requests() -> list[Request]:
        return [make_request("s0", prompt), make_request("s1", prompt), make_request("x", list(range(100, 110))),
                make_request("late", list(range(300, 306)))]

    expected, _ = run(make_scheduler(), requests())
    sched = make_scheduler()
    *suspects, late = requests()
    for req in suspects:
        sched.add_request(req)
    assert scheduled(step(sched)) == [("s0", 0, 9, True), ("s1", 8, 1, True), ("x", 0, 10, True)]
    assert scheduled(fail_step(sched)) == [("s0", 9, 1, True), ("s1", 9, 1, True), ("x", 10, 1, True)]
    sched.add_request(late)

    assert sched.suspects == {"s0", "s1", "x"}
    assert sched.num_running == 0 and all(r.status == RequestStatus.PREEMPTED for r in suspects)
    assert [r.request_id for r in sched.waiting] == ["s0", "s1", "x", "late"]
    assert sched.num_preemptions == 3 and sched.block_manager.num_free_blocks == 64
    assert cached_tokens(sched, prompt) == 0  # s0's blocks, shared by s1, were invalidated

    steps = [
        ([("s0", 0, 10, True)], ["s0"], {"s1", "x"}),
        ([("s1", 8, 2, True)], ["s1"], {"x"}),  # s0's prompt blocks, just recomputed alone, serve s1
        ([("x", 0, 11, True)], ["x"], set()),  # the budget has room for late: it waits all the same
        ([("s0", 10, 1, True), ("s1", 10, 1, True), ("x", 11, 1, True), ("late", 0, 6, True)], ["late"], set()),
    ]
    for want, new, left in steps:
        out = step(sched)
        assert (scheduled(out), [n.req_id for n in out.new_requests], sched.suspects) == (want, new, left)
    assert [r.request_id for r in sched.running] == ["s0", "s1", "x", "late"]
    while sched.has_unfinished_requests():
        step(sched)
    assert {r.request_id: r.output_token_ids for r in [*suspects, late]} == expected


def test_isolate_preempts_every_running_request_and_invalidates_only_the_suspects_blocks():
    """A running request the failed step did not name (the budget can leave one out) is
    preempted too but keeps its cached prefix; ids the scheduler no longer knows are ignored."""
    sched = make_scheduler()
    s, w, gone = (make_request(name, list(range(first, first + 9))) for name, first in (("s", 1), ("w", 20), ("gone", 40)))
    for req in (s, w, gone):
        sched.add_request(req)
    step(sched)
    sched.abort_requests(["gone"])
    sched.isolate(["s", "gone", "never-added"])
    assert sched.suspects == {"s"}
    assert [r.request_id for r in sched.waiting] == ["s", "w"] and w.status == RequestStatus.PREEMPTED
    assert (cached_tokens(sched, s.prompt_token_ids), cached_tokens(sched, w.prompt_token_ids)) == (0, 8)
    out = step(sched)
    assert (scheduled(out), out.finished_req_ids) == ([("s", 0, 10, True)], ["gone"])
    out = step(sched)  # w resumes from the blocks it kept
    assert (scheduled(out), [n.req_id for n in out.new_requests]) == ([("s", 10, 1, True), ("w", 8, 2, True)], ["w"])


def test_isolate_naming_no_known_request_only_preempts():
    sched = make_scheduler()
    for name in "ab":
        sched.add_request(make_request(name, [1, 2, 3]))
    step(sched)
    sched.abort_requests(["b"])
    sched.isolate(["b"])
    assert sched.suspects == set() and sched.num_running == 0
    assert scheduled(step(sched)) == [("a", 0, 4, True)]


def test_a_suspect_longer_than_the_budget_runs_alone_chunk_by_chunk():
    """Alone, a suspect gets the whole budget per step, and keeps the step to itself until it
    samples, though the next suspect would fit beside its last chunk."""
    sched = make_scheduler(budget=8)
    for req in (make_request("a", list(range(1, 11))), make_request("b", [20, 21, 22])):
        sched.add_request(req)
    assert scheduled(step(sched)) == [("a", 0, 8, False)]
    assert scheduled(fail_step(sched)) == [("a", 8, 2, True), ("b", 0, 3, True)]
    steps = [
        ([("a", 0, 8, False)], ["a"], {"a", "b"}),
        ([("a", 8, 2, True)], [], {"b"}),
        ([("b", 0, 3, True)], ["b"], set()),
        ([("a", 10, 1, True), ("b", 3, 1, True)], [], set()),
    ]
    for want, new, left in steps:
        out = step(sched)
        assert (scheduled(out), [n.req_id for n in out.new_requests], sched.suspects) == (want, new, left)


@pytest.mark.parametrize(("budget", "alone", "preempted_at"), [
    (9, [("a", 0, 9, True), ("c", 0, 9, False), ("c", 9, 3, True)], 1),  # room made to admit c
    (8, [("a", 0, 8, False), ("a", 8, 1, True), ("c", 0, 8, False), ("c", 8, 4, True)], 3),  # for c's next chunk
])
def test_a_suspect_alone_takes_the_blocks_of_the_ones_cleared_before_it(budget, alone, preempted_at):
    """Five blocks: a, cleared, holds three; c alone needs a third one while two are free. a is
    preempted (c is never the victim), keeps its cached prefix, and resumes from it."""
    sched = make_scheduler(num_blocks=5, budget=budget)
    a, c = make_request("a", list(range(1, 9))), make_request("c", list(range(10, 22)), max_tokens=1)
    sched.add_request(a)
    assert scheduled(step(sched)) == [("a", 0, 8, True)]
    sched.add_request(c)
    assert scheduled(fail_step(sched)) == [("a", 8, 1, True), ("c", 0, budget - 1, False)]
    for i, want in enumerate(alone):
        assert scheduled(step(sched)) == [want]
        assert a.status == (RequestStatus.PREEMPTED if i >= preempted_at else RequestStatus.RUNNING)
    assert c.status == RequestStatus.FINISHED_LENGTH and sched.num_preemptions == 3
    out = step(sched)
    assert (scheduled(out), [n.req_id for n in out.new_requests], out.finished_req_ids) == (
        [("a", 8, 2, True)], ["a"], ["c"])


def test_room_for_a_suspect_alone_is_taken_from_the_latest_arrival_first():
    """As in any step that runs out of blocks: of a and b, cleared, b (the later) is preempted
    for c, and a goes on holding its blocks."""
    sched = make_scheduler(num_blocks=5, budget=10)
    a, b = make_request("a", list(range(1, 8))), make_request("b", list(range(11, 14)))
    c = make_request("c", list(range(20, 32)), max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    sched.add_request(c)
    assert scheduled(fail_step(sched)) == [("a", 7, 1, True), ("b", 3, 1, True), ("c", 0, 8, False)]
    steps = [
        ([("a", 0, 8, True)], "RUNNING", "PREEMPTED"),
        ([("b", 0, 4, True)], "RUNNING", "RUNNING"),
        ([("c", 0, 10, False)], "RUNNING", "PREEMPTED"),  # c needs three blocks, two are free
        ([("c", 10, 2, True)], "RUNNING", "PREEMPTED"),
        ([("a", 8, 1, True), ("b", 0, 5, True)], "RUNNING", "RUNNING"),
    ]
    for want, a_status, b_status in steps:
        assert (scheduled(step(sched)), a.status.name, b.status.name) == (want, a_status, b_status)


def test_a_suspect_that_ends_before_it_samples_leaves_the_suspects():
    """A waiting suspect aborted by its client, and the one whose own step fails (LLMEngine
    aborts it), are dropped: the next suspect runs, and the workers hear of both."""
    sched = make_scheduler()
    for name in "abcd":
        sched.add_request(make_request(name, [1, 2, 3]))
    step(sched)
    fail_step(sched)
    sched.abort_requests(["c"])
    assert sched.suspects == {"a", "b", "d"}
    out = sched.schedule()
    assert (scheduled(out), out.finished_req_ids) == ([("a", 0, 4, True)], ["c"])
    sched.discard(out)  # a's step failed: LLMEngine discards it, then aborts a
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED, invalidate_cache=True)
    assert sched.suspects == {"b", "d"}
    for want, left in (("b", {"d"}), ("d", set())):
        out = step(sched)
        assert (scheduled(out), sched.suspects) == ([(want, 0, 4, True)], left)
        # c again: the failed step that carried it may not have reached the worker's bookkeeping
        assert out.finished_req_ids == (["c", "a"] if want == "b" else [])
    assert [r.req_id for r in step(sched).scheduled] == ["b", "d"]


def test_suspects_that_are_not_waiting_do_not_stall_the_queue():
    """Defensive (no public call leaves a suspect that is not waiting: isolate names only known
    requests and freeing one drops it): such suspects are given up and the step batched as usual."""
    sched = make_scheduler()
    for name in "ab":
        sched.add_request(make_request(name, [1, 2, 3]))
    sched.suspects.add("ghost")
    assert scheduled(sched.schedule()) == [("a", 0, 3, True), ("b", 0, 3, True)]
    assert sched.suspects == set()


def test_a_step_never_holds_more_than_max_loras_adapters():
    """Four adapters and the base model, two adapter slots: every step holds at most two adapters, a
    request of a third waits (keeping its place) while later requests of held adapters and of the
    base model start, and every request finishes with the tokens it gets alone."""
    prompts = random_prompts(12, seed=3)
    lora_ids = [1, 2, 3, 0, 4, 1, 2, 0, 3, 4, 1, 0]
    alone, _ = run(make_scheduler(), [make_request(f"r{i}", p) for i, p in enumerate(prompts)])
    sched = make_scheduler(budget=48)
    sched.max_loras = 2
    requests = []
    for i, (p, lid) in enumerate(zip(prompts, lora_ids)):
        req = make_request(f"r{i}", p)
        if lid:
            req.lora_request = LoRARequest(f"a{lid}", lid, f"/adapters/a{lid}")
            req.lora_id = lid
        requests.append(req)
    got, outputs = run(sched, requests)
    assert got == alone
    started_before = set()
    for out in outputs:
        held = {sched_req.lora_id for sched_req in out.scheduled} - {0}
        assert len(held) <= 2, held
        assert all(r.lora_id == sched.requests[r.req_id].lora_id for r in out.scheduled if r.req_id in sched.requests)
        for new in out.new_requests:
            lid = lora_ids[int(new.req_id[1:])]
            assert (new.lora_request.lora_int_id if new.lora_request else 0) == lid
        started_before.update(n.req_id for n in out.new_requests)
    # r2 (adapter 3) could not start with r0 and r1 (adapters 1 and 2) running; r3 (base) behind it did
    first = outputs[0]
    assert [n.req_id for n in first.new_requests][:3] == ["r0", "r1", "r3"]
    assert "r2" in started_before


def test_a_passed_over_adapter_request_is_not_starved_by_a_running_adapters_stream():
    """One slot: adapter 1 keeps getting requests while adapter 2's waits. Adapter 1's later
    requests queue behind it (base-model requests do not), so it starts once the earlier ones end."""
    sched = make_scheduler(budget=256, max_num_seqs=64)
    sched.max_loras = 1

    def req(i: int, lid: int, max_tokens: int = 4) -> Request:
        r = make_request(f"r{i}", [5, 6, 7], max_tokens=max_tokens)
        if lid:
            r.lora_request, r.lora_id = LoRARequest(f"a{lid}", lid, f"/a{lid}"), lid
        return r

    sched.add_request(req(0, 1, max_tokens=20))  # adapter 1 holds the slot for 20 steps
    sched.add_request(req(1, 2))
    started: list[str] = []
    for step in range(40):
        if step < 30:  # a steady stream of adapter 1's requests, and one base request
            sched.add_request(req(100 + step, 0 if step == 5 else 1))
        out = sched.schedule()
        started += [n.req_id for n in out.new_requests]
        assert len({r.lora_id for r in out.scheduled} - {0}) <= 1
        sched.update_from_output(out, fake_model(sched, out))
    assert "r1" in started
    assert started.index("r1") < started.index("r101")  # adapter 1's later requests waited behind it
    assert started.index("r105") < started.index("r1")  # the base-model request did not
