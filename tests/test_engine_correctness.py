"""Engine answers on the real tiny models (fp32, the platform's real worker), where a fake
executor cannot see the bug: prefix-cache hits serve the right KV, each row of a mixed batch
samples with its own settings, preemption resumes exactly, and a seeded request's tokens do
not depend on what else is in the batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from loom import LLM, SamplingParams, envs

BS = 16
"""KV-cache block size of every engine here (the prefix cache works in whole blocks)."""
VOCAB = 50000


@pytest.fixture(scope="module")
def engines():
    """``engines(model_dir, **engine_args)``: one LLM per distinct set of arguments, for the module."""
    made: dict[tuple, LLM] = {}

    def get(model_dir, **kwargs) -> LLM:
        key = (str(model_dir), *sorted(kwargs.items()))
        if key not in made:
            defaults = {"dtype": "float32", "max_model_len": 256, "block_size": BS, "max_num_seqs": 16}
            made[key] = LLM(str(model_dir), **{**defaults, **kwargs})
        return made[key]

    yield get
    for llm in made.values():
        llm.shutdown()


@pytest.fixture(params=["tiny_llama", "tiny_opt"])
def model_dir(request) -> str:
    return str(request.getfixturevalue(request.param))


@pytest.fixture
def cached_llm(engines, model_dir) -> LLM:
    return engines(model_dir, enable_prefix_caching=True)


@pytest.fixture
def plain_llm(engines, model_dir) -> LLM:
    return engines(model_dir, enable_prefix_caching=False)


@pytest.fixture
def llama(engines, tiny_llama) -> LLM:
    return engines(tiny_llama, enable_prefix_caching=False)


def random_ids(seed: int, *lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def tokens(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


def assert_same_answers(got, want) -> None:
    """Same greedy tokens, and the same logprobs: a wrong KV shows even where argmax survives."""
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-3)


# ---- prefix caching ---------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [2048, 20], ids=["one_step_prefill", "chunked_prefill"])
def test_prefix_cache_hits_serve_the_right_prefix(engines, model_dir, plain_llm, budget):
    # Chunked, a row's hits include blocks that the row before fills in the same step.
    cached = engines(model_dir, enable_prefix_caching=True, max_num_batched_tokens=budget)
    a, b, c, d, e = random_ids(10, BS, BS, BS, BS, BS)
    t1, t2, t3 = random_ids(11, 5, 7, 3)
    # (prompt, prompt tokens the prefix cache must serve), sent as two batches in order.
    first_batch = [
        (a + b + c + t1, 0),
        (a + b + d + t2, 2 * BS),  # a + b, computed by the row before in this batch
        (e + b + c + t1, 0),  # Z+Y after X+Y: only the first block differs, nothing is reusable
    ]
    second_batch = [
        (b + c + t1, 0),  # blocks cached above, but at another position after another prefix
        (c + a + b + t1, 0),  # the same blocks in another order
        (a + b + c + t3, 3 * BS),  # across batches, diverging in the last partial block
        (a + d + t3, BS),  # a shared first block, then diverging
        (a + b + c, 2 * BS),  # fully cached: the last block is computed again to get logits
    ]
    for batch in (first_batch, second_batch):
        prompts = [p for p, _ in batch]
        got = run(cached, prompts, GREEDY)
        assert [o.num_cached_tokens for o in got] == [hits for _, hits in batch]
        assert_same_answers(got, run(plain_llm, prompts, GREEDY))


def test_follow_up_turn_reuses_blocks_filled_by_decoding(cached_llm, plain_llm):
    (prompt,) = random_ids(12, 21)
    params = dataclasses.replace(GREEDY, max_tokens=30)
    first = run(cached_llm, [prompt], params)[0]
    history = prompt + list(first.outputs[0].token_ids)  # 51 tokens; the last one has no KV yet
    (follow_up,) = random_ids(13, 9)
    got = run(cached_llm, [history + follow_up], GREEDY)
    assert got[0].num_cached_tokens == 3 * BS
    assert_same_answers(got, run(plain_llm, [history + follow_up], GREEDY))


# ---- a mixed batch -----------------------------------------------------------------------------


def row(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=6, ignore_eos=True, **kwargs)


MIXED = [
    row(temperature=0.8, top_p=0.3, seed=1),
    row(temperature=1.3, top_k=20, seed=2),
    row(temperature=0, repetition_penalty=1.5),
    row(temperature=1.0, top_k=50, top_p=0.8, frequency_penalty=1.0, seed=3),
    row(temperature=0.5, presence_penalty=1.5, repetition_penalty=1.2, seed=4),
    row(temperature=0, frequency_penalty=0.5, presence_penalty=0.5),
    row(temperature=1.0, seed=5),
    row(temperature=2.0, top_k=3, seed=6),
]


# Without top-p in the batch, top-k takes its own path (a partial topk instead of a sort).
TOP_K_ONLY = [MIXED[1], MIXED[2], MIXED[6], MIXED[7]]


@pytest.mark.parametrize("batch", [MIXED, TOP_K_ONLY], ids=["mixed", "top_k_only"])
def test_each_row_of_a_mixed_batch_samples_as_if_alone(llama, batch):
    prompts = random_ids(20, *(3 + 5 * i for i in range(len(batch))))
    together = tokens(run(llama, prompts, batch))
    alone = [tokens(run(llama, [p], params))[0] for p, params in zip(prompts, batch)]
    assert together == alone


# ---- preemption --------------------------------------------------------------------------------

PREEMPTED = [
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.5, seed=8,
                   max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.9, n=2, seed=9, max_tokens=16, ignore_eos=True),  # children share the prompt
]


def test_preempted_requests_resume_exactly(engines, tiny_llama, llama, monkeypatch):
    prompts = random_ids(30, 12, 9, 11, 20)
    want = tokens(run(llama, prompts, PREEMPTED))
    # Five blocks (80 tokens) for five sequences of 25 to 36 tokens: they preempt each other.
    block_bytes = llama.llm_engine.executor.worker.get_kv_cache_block_bytes()
    # LOOM_CPU_KVCACHE_SPACE would override the size asked here; the envs cache is restored afterwards.
    monkeypatch.delenv("LOOM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(envs, "_cache_enabled", False)
    monkeypatch.setattr(envs, "_cache", {})
    for prefix_caching in (True, False):
        small = engines(tiny_llama, max_model_len=64, kv_cache_memory_bytes=5 * block_bytes,
                        enable_prefix_caching=prefix_caching)
        assert small.llm_engine.block_manager.num_blocks == 5
        before = small.llm_engine.scheduler.num_preemptions
        got = tokens(run(small, prompts, PREEMPTED))
        assert small.llm_engine.scheduler.num_preemptions > before, "nothing was preempted: the test proves nothing"
        assert got == want, f"prefix caching {prefix_caching}"


# ---- seeded sampling and batch companions ------------------------------------------------------

SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=8, ignore_eos=True)


def test_seeded_request_ignores_its_batch_companions(llama):
    target, other, third = random_ids(40, 11, 6, 23)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    other_seed = dataclasses.replace(SEEDED, seed=99, max_tokens=12)
    fan_out = SamplingParams(temperature=0.9, n=3, seed=5, max_tokens=6, ignore_eos=True)
    fan_out_unseeded = dataclasses.replace(fan_out, seed=None)
    alone = tokens(run(llama, [target], SEEDED))[0]
    batches = [
        ([target, other, third], [SEEDED, greedy, unseeded]),
        ([other, third, target], [unseeded, other_seed, SEEDED]),
        ([other, target, third], [fan_out, SEEDED, fan_out_unseeded]),
        ([target, target], [other_seed, SEEDED]),
    ]
    for prompts, params in batches:
        outputs = run(llama, prompts, params)
        assert list(outputs[params.index(SEEDED)].outputs[0].token_ids) == alone, params.index(SEEDED)
    # n > 1: completion i is seeded with seed + i, as if sent alone with that seed
    fanned = run(llama, [target, other], [dataclasses.replace(SEEDED, n=2), unseeded])[0]
    shifted = tokens(run(llama, [target], dataclasses.replace(SEEDED, seed=SEEDED.seed + 1)))[0]
    assert [list(c.token_ids) for c in fanned.outputs] == [alone, shifted]
    assert shifted != alone  # the seed decides: the distribution is not too peaked to tell


# ---- decode steps, replayed ---------------------------------------------------------------------

def test_decode_steps_replay_to_the_eager_answer(engines, model_dir, expected_platform):
    """The CPU worker captures a decode step once per batch size and replays it
    (loom.worker.cpu_step_replay): greedy answers equal those of ``enforce_eager`` request after
    request (new block tables, contexts past block boundaries), and for batches whose size
    changes as requests finish (each size captured at its CAPTURE_AFTER-th step in a row), and for
    a batch whose size stays while its requests change (one finishes, a waiting one joins)."""
    replay = engines(model_dir, enable_prefix_caching=False)
    eager = engines(model_dir, enable_prefix_caching=False, enforce_eager=True)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = random_ids(50, 7, 30, 16)
    for prompt in prompts:  # one at a time: every decode step has a single request
        assert tokens(run(replay, [prompt], greedy)) == tokens(run(eager, [prompt], greedy))
    runner = replay.llm_engine.executor.worker.model_runner
    if expected_platform == "cpu":
        assert 1 in runner._graphs and runner._graphs[1].checked, "the decode step was not captured"
        assert not eager.llm_engine.executor.worker.model_runner._graphs
    else:  # the dummy platform's worker runs the contract's runner: every step eager
        assert not hasattr(runner, "_graphs")
    # a batch of 3 whose requests finish one after another (3, 2 then 1 request per step), then
    # the longest alone (replayed after batch steps), then a seeded sample
    lengths = [dataclasses.replace(greedy, max_tokens=n) for n in (12, 40, 25)]
    assert tokens(run(replay, prompts[:3], lengths)) == tokens(run(eager, prompts[:3], lengths))
    if expected_platform == "cpu":
        assert {1, 2, 3} <= set(runner._graphs) and all(runner._graphs[n].checked for n in (1, 2, 3))
        assert runner._replay, "a replay differed from its eager step"
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True)
    assert tokens(run(replay, [prompts[2]], seeded)) == tokens(run(eager, [prompts[2]], seeded))
    # two at a time (max_num_seqs 2): when the short one finishes, the third joins the replayed pairs
    pairs = engines(model_dir, enable_prefix_caching=False, max_num_seqs=2)
    lengths = [dataclasses.replace(greedy, max_tokens=n) for n in (10, 40, 30)]
    assert tokens(run(pairs, prompts[:3], lengths)) == tokens(run(eager, prompts[:3], lengths))
    if expected_platform == "cpu":
        paired = pairs.llm_engine.executor.worker.model_runner
        assert paired._graphs[2].checked and paired._replay


@pytest.mark.parametrize("how", ["fails", "differs"])
def test_a_replay_that_fails_or_differs_turns_replay_off(monkeypatch, engines, model_dir, expected_platform, how):
    """A graph's replay that fails (a kernel's error code) or whose first replay differs from the
    eager step answers with the eager step and turns replay off for every batch size: the
    answers stay the eager ones, no graph is kept and none is captured again."""
    from loom.worker.cpu_step_replay import StepGraph, StepReplayError

    taken: list[str] = []

    def fails(self, *args, **kwargs):
        taken.append("replay")
        raise StepReplayError("paged_decode failed in a replayed decode step")

    def differs(self, model, input_ids, positions, md):
        taken.append("check")
        eager, _ = original_check(self, model, input_ids, positions, md)
        return eager, False

    original_check = StepGraph.check
    if how == "fails":
        monkeypatch.setattr(StepGraph, "replay", fails)
    else:
        monkeypatch.setattr(StepGraph, "check", differs)
    replay = engines(model_dir, enable_prefix_caching=False, max_num_seqs=9 if how == "fails" else 10)  # fresh
    eager = engines(model_dir, enable_prefix_caching=False, enforce_eager=True)
    prompts = random_ids(52, 5, 30, 16)
    lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 40, 25)]
    for _ in range(2):  # the second run: nothing is captured again
        assert tokens(run(replay, prompts, lengths)) == tokens(run(eager, prompts, lengths))
        runner = replay.llm_engine.executor.worker.model_runner
        if expected_platform == "cpu":  # one graph's first replay failed or differed, and no other ran
            assert taken == ["replay" if how == "fails" else "check"]
            assert not runner._replay and not runner._graphs
        else:  # the dummy platform's worker runs the contract's runner: every step eager
            assert not hasattr(runner, "_graphs")


@pytest.mark.parametrize(("graphs", "memory", "kept"), [(2, 256 << 20, {2, 1}), (4, 0, set())])
def test_replay_keeps_few_graphs(monkeypatch, engines, model_dir, expected_platform, graphs, memory, kept):
    """At most ``REPLAY_GRAPHS`` captured steps within ``REPLAY_MEMORY`` are kept, the least
    recently replayed dropped first; answers stay the eager ones whichever graphs are kept."""
    from loom.worker import cpu_worker

    monkeypatch.setattr(cpu_worker, "REPLAY_GRAPHS", graphs)
    monkeypatch.setattr(cpu_worker, "REPLAY_MEMORY", memory)
    replay = engines(model_dir, enable_prefix_caching=False, max_num_seqs=8 - graphs)  # a fresh engine
    eager = engines(model_dir, enable_prefix_caching=False, enforce_eager=True)
    prompts = random_ids(51, 4, 30, 16, 9)
    lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 20, 30, 40)]
    assert tokens(run(replay, prompts, lengths)) == tokens(run(eager, prompts, lengths))  # 4, 3, 2, 1 a step
    runner = replay.llm_engine.executor.worker.model_runner
    if expected_platform == "cpu":
        assert set(runner._graphs) == kept and runner._replay
        # a step too large for REPLAY_MEMORY keeps its size and larger ones eager, not captured again
        assert runner._too_large == (1 if memory == 0 else None)
    else:  # the dummy platform's worker runs the contract's runner: every step eager
        assert not hasattr(runner, "_graphs")
