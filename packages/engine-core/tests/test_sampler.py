from __future__ import annotations

import pytest
import torch
from loom.layers.sampler import Sampler, SamplingMetadata
from loom_plugin_api import SamplingParams

V = 64
EOS = 3


def sample(logits: torch.Tensor, params: list[SamplingParams], generators=None, num_output=None, seen=None):
    generators = generators if generators is not None else [None] * len(params)
    num_output = num_output if num_output is not None else [0] * len(params)
    md = SamplingMetadata.from_requests(params, generators, num_output, EOS, seen)
    return Sampler()(logits.clone(), md)


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def random_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=gen(seed)) * 3


def test_greedy_is_argmax_fast_path():
    logits = random_logits(5)
    tokens, logprobs = sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs is None


def test_mixed_greedy_and_random_rows():
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=5) for i in range(6)]
    tokens, _ = sample(logits, params)
    for i in range(1, 6, 2):
        assert tokens[i] == int(logits[i].argmax())
    for i in range(0, 6, 2):  # top-5 keeps the draw among the 5 best
        assert tokens[i] in logits[i].topk(5).indices.tolist()


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = random_logits(8)
    greedy = logits.argmax(-1).tolist()
    for _ in range(3):
        assert sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8)[0] == greedy
        assert sample(logits, [SamplingParams(temperature=1.5, top_p=1e-6)] * 8)[0] == greedy
        assert sample(logits, [SamplingParams(temperature=1.5, top_p=1e-6, top_k=10)] * 8)[0] == greedy


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)]))
    seen = set()
    for seed in range(200):
        seen.add(sample(logits, [SamplingParams(temperature=1.0, top_p=0.7)], [gen(seed)])[0][0])
    assert seen == {0, 1}


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = random_logits(6, seed=1)
    params = SamplingParams(temperature=1.0, seed=7)
    alone = [sample(logits[2:3], [params], [gen(7)])[0][0] for _ in range(2)]
    assert alone[0] == alone[1]
    for batch_seed in range(5):
        batch = torch.cat([random_logits(2, seed=10 + batch_seed), logits[2:3], random_logits(3, seed=20)])
        ps = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0), params] + [SamplingParams()] * 3
        gens = [None, None, gen(7), gen(99), None, None]
        assert sample(batch, ps, gens)[0][2] == alone[0]
    # And a sequence of draws from one generator repeats with the same seed.
    g1, g2 = gen(3), gen(3)
    seq1 = [sample(logits, [params] * 6, [g1] + [None] * 5)[0][0] for _ in range(10)]
    seq2 = [sample(logits, [params] * 6, [g2] + [None] * 5)[0][0] for _ in range(10)]
    assert seq1 == seq2 and len(set(seq1)) > 1


def test_random_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (V - 3))
    logits = torch.log(probs.clamp_min(1e-12)).expand(4000, V).contiguous()
    tokens, _ = sample(logits, [SamplingParams(temperature=1.0)] * 4000)
    counts = torch.bincount(torch.tensor(tokens), minlength=V).float() / 4000
    assert torch.allclose(counts[:3], probs[:3], atol=0.04)


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(3, V)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 5] = 8.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, min_tokens=2),
    ]
    tokens, _ = sample(logits, params, num_output=[1, 0, 2])
    assert tokens == [7, 5, EOS]  # the third row reached min_tokens
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sample(logits[:1], [ignore], num_output=[0])[0] == [EOS]


def test_logprobs_match_log_softmax_of_raw_logits():
    logits = random_logits(4, seed=3)
    ref = torch.log_softmax(logits, -1)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.7, top_k=4, logprobs=0, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, logprobs=5, repetition_penalty=1.3),
    ]
    tokens, lps = sample(logits, params, [None, gen(1), None, None], seen=[[], [], [], [1, 2, 3]])
    assert lps[2] is None
    for i in (0, 1, 3):
        lp = lps[i]
        assert lp.token_id == tokens[i]
        assert abs(lp.logprob - float(ref[i, tokens[i]])) < 1e-5
        assert lp.rank == int((ref[i] > ref[i, tokens[i]]).sum()) + 1
        k = params[i].logprobs
        top = ref[i].topk(k) if k else None
        assert lp.top_token_ids == (top.indices.tolist() if k else [])
        if k:
            assert torch.allclose(torch.tensor(lp.top_logprobs), top.values, atol=1e-5)
    assert lps[0].rank == 1


def test_repetition_penalty_hf_semantics():
    logits = torch.zeros(2, V)
    logits[:, 1] = 4.0   # seen, positive: divided
    logits[:, 2] = -2.0  # seen, negative: multiplied
    logits[:, 9] = 3.0   # unseen
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams(temperature=0.0)]
    md = SamplingMetadata.from_requests(params, [None, None], [0, 0], EOS, [[1, 2, 1], [1, 2]])
    out = logits.clone()
    tokens, _ = Sampler()(out, md)
    assert tokens == [9, 1]
    assert out[0, 1] == 2.0 and out[0, 2] == -4.0 and out[0, 9] == 3.0
    assert out[1, 1] == 4.0  # no penalty on the second row


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0] + [-30.0] * (V - 2)]).expand(2000, V).contiguous()
    cold = sample(logits, [SamplingParams(temperature=0.1)] * 2000)[0]
    hot = sample(logits, [SamplingParams(temperature=1.0)] * 2000)[0]
    assert cold.count(1) < 5 < hot.count(1)


def test_top_k_per_row():
    logits = random_logits(4, seed=5)
    params = [SamplingParams(temperature=1.0, top_k=k) for k in (0, 2, 1, V + 5)]
    for seed in range(20):
        tokens, _ = sample(logits, params, [gen(seed), gen(seed + 1), None, None])
        assert tokens[1] in logits[1].topk(2).indices.tolist()
        assert tokens[2] == int(logits[2].argmax())


def test_frequency_and_presence_penalties_change_the_greedy_choice():
    logits = torch.zeros(4, V)
    logits[:, 1] = 5.0  # generated twice so far
    logits[:, 2] = 4.0  # never generated
    logits[:, 3 + 1] = 3.5  # generated once
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=0.6),  # 1: 5 - 1.2 = 3.8 < 4
        SamplingParams(temperature=0.0, presence_penalty=1.5),  # 1: 3.5 < 4, and 4: 3.5 - 1.5
        SamplingParams(temperature=0.0, frequency_penalty=0.4),  # 1: 4.2 still wins
        SamplingParams(temperature=0.0, frequency_penalty=-1.0, presence_penalty=-1.0),  # negative: a boost
    ]
    output = [[1, 4, 1], [1, 4, 1], [1, 4, 1], [4]]
    md = SamplingMetadata.from_requests(params, [None] * 4, [3, 3, 3, 1], EOS, None, output)
    out = logits.clone()
    tokens, _ = Sampler()(out, md)
    assert tokens == [2, 2, 1, 4]
    assert torch.allclose(out[0, [1, 2, 4]], torch.tensor([3.8, 4.0, 2.9]))  # 4: 3.5 - 0.6
    assert torch.allclose(out[1, [1, 2, 4]], torch.tensor([3.5, 4.0, 2.0]))
    assert torch.allclose(out[3, [1, 2, 4]], torch.tensor([5.0, 4.0, 5.5]))


def test_zero_output_penalties_and_no_output_are_no_ops():
    logits = random_logits(3, seed=4)
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, presence_penalty=0.0)]
    md = SamplingMetadata.from_requests(params, [None] * 3, [0, 2, 2], EOS, None, [[], [5, 5], [7]])
    assert md.output_penalty_rows is None and md.no_processing  # the fast greedy path stays open
    out = logits.clone()
    assert Sampler()(out, md)[0] == logits.argmax(-1).tolist()
    assert torch.equal(out, logits)


def test_output_penalties_only_touch_their_rows_and_mix_with_random_rows():
    logits = torch.zeros(3, V)
    logits[:, 6] = 10.0
    logits[:, 8] = 9.0
    params = [SamplingParams(temperature=1.0, top_k=2, presence_penalty=2.0, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, frequency_penalty=1.0)]
    md = SamplingMetadata.from_requests(params, [gen(1), None, None], [1, 1, 2], EOS, None, [[6], [6], [6, 6]])
    out = logits.clone()
    tokens, _ = Sampler()(out, md)
    assert tokens[1:] == [6, 8]
    assert out[1, 6] == 10.0 and out[2, 6] == 8.0


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
def test_output_penalty_ranges(name):
    for value in (-2.0, 0, 1.5, 2):
        SamplingParams(**{name: value})
    for value in (-2.01, 2.5, 100):
        with pytest.raises(ValueError, match=rf"{name} must be in \[-2, 2\], got {value}"):
            SamplingParams(**{name: value})
    with pytest.raises(ValueError, match=f"{name} must be a number"):
        SamplingParams(**{name: "1"})


MIXED_ROWS = [  # each row its own temperature, top-k, top-p, penalties and seed
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.2, frequency_penalty=0.5,
                   presence_penalty=0.3, seed=11),
    SamplingParams(temperature=1.3, top_p=0.6, presence_penalty=1.0, seed=12),
    SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.5, frequency_penalty=1.0, seed=13),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2, seed=14),
    SamplingParams(temperature=2.0, top_k=3, top_p=0.95, repetition_penalty=0.8, frequency_penalty=-0.5,
                   presence_penalty=-0.5, seed=15),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.5, frequency_penalty=1.5, seed=16),
]


def _decode(rows: list[int], steps: int) -> list[list[int]]:
    """``steps`` decode steps of the given rows of MIXED_ROWS batched together; each row's tokens."""
    params = [MIXED_ROWS[r] for r in rows]
    gens = [gen(p.seed) for p in params]
    prompts = [[r, r + 1, 2 * r + 7] for r in rows]
    outputs: list[list[int]] = [[] for _ in rows]
    for step in range(steps):
        logits = random_logits(len(MIXED_ROWS), seed=100 + step)[rows]
        md = SamplingMetadata.from_requests(params, gens, [len(o) for o in outputs], EOS,
                                            [p + o for p, o in zip(prompts, outputs)], outputs)
        tokens, _ = Sampler()(logits, md)
        for out, token in zip(outputs, tokens):
            out.append(token)
    return outputs


def test_mixed_batch_rows_sample_as_if_alone():
    batch = _decode(list(range(len(MIXED_ROWS))), steps=30)
    for row in range(len(MIXED_ROWS)):
        assert batch[row] == _decode([row], steps=30)[0], f"row {row} differs from the row run alone"
    assert all(len(set(tokens)) > 1 for tokens in batch)  # the penalties move every row off one token


def test_repetition_penalty_rows_with_seen_lists_of_different_lengths():
    logits = torch.zeros(3, V)
    logits[:, 1:6] = torch.tensor([4.0, -2.0, 3.0, 1.0, 2.5])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, repetition_penalty=4.0)]
    md = SamplingMetadata.from_requests(params, [None] * 3, [0] * 3, EOS, [[3], [1, 2], [1, 2, 4, 5]])
    out = logits.clone()
    tokens, _ = Sampler()(out, md)
    assert out[0, 1:6].tolist() == [4.0, -2.0, 1.5, 1.0, 2.5]  # only token 3 was seen
    assert out[1, 1:6].tolist() == [4.0, -2.0, 3.0, 1.0, 2.5]  # no penalty
    assert out[2, 1:6].tolist() == [1.0, -8.0, 3.0, 0.25, 0.625]
    assert tokens == [1, 1, 3]


def test_min_tokens_ignores_stop_ids_outside_the_vocabulary():
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0
    logits[0, 9] = 5.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[V, V + 7])]
    assert sample(logits, params, num_output=[0])[0] == [9]  # EOS masked, the stop ids can't occur


def test_top_p_drops_a_tail_whose_mass_is_exactly_1_minus_p():
    logits = torch.full((1, V), float("-inf"))
    logits[0, 10:14] = 0.0  # four tokens of probability 1/4: cumulative 0.25, 0.5, 0.75, 1 (exact)
    seen = {sample(logits, [SamplingParams(top_p=0.5)], [gen(seed)])[0][0] for seed in range(60)}
    assert len(seen) == 2 and seen <= {10, 11, 12, 13}  # the two whose tail mass is 0.5 = 1 - p are dropped


def test_top_p_below_float32_resolution_still_keeps_the_best_token():
    logits = random_logits(4, seed=6)  # 1 - 1e-9 rounds to 1.0 in float32: every cumulative sum is "in the tail"
    for seed in range(5):
        tokens, _ = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-9)] * 4, [gen(seed)] + [None] * 3)
        assert tokens == logits.argmax(-1).tolist()


def test_top_k_with_top_p_keeps_exactly_k_tokens():
    logits = torch.zeros(1, V)
    logits[0, [20, 30, 40]] = torch.tensor([8.0, 7.9, 7.8])
    for seed in range(10):  # top-k 1 is greedy under any top-p
        assert sample(logits, [SamplingParams(top_k=1, top_p=0.99)], [gen(seed)])[0] == [20]
    seen = {sample(logits, [SamplingParams(top_k=2, top_p=0.99)], [gen(seed)])[0][0] for seed in range(60)}
    assert seen == {20, 30}


def test_output_penalties_count_token_id_0():
    logits = torch.zeros(2, V)
    logits[:, 0] = 5.0
    logits[:, 1] = 4.0
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0), SamplingParams(temperature=0.0)]
    md = SamplingMetadata.from_requests(params, [None] * 2, [3, 0], EOS, None, [[0, 0], []])
    out = logits.clone()
    assert Sampler()(out, md)[0] == [1, 0]
    assert out[0, :3].tolist() == [3.0, 4.0, 0.0]  # token 0 seen twice, the padding counts for nothing


def test_logprobs_0_on_every_row_give_no_top_list():
    logits = random_logits(3, seed=7)
    params = [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=1.0, logprobs=0)]
    tokens, lps = sample(logits[:2], params, [None, gen(2)])
    ref = torch.log_softmax(logits[:2], -1)
    for i, lp in enumerate(lps):
        assert (lp.token_id, lp.top_token_ids, lp.top_logprobs) == (tokens[i], [], [])
        assert abs(lp.logprob - float(ref[i, tokens[i]])) < 1e-5


def test_random_rows_without_logprobs_return_none():
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0, repetition_penalty=1.5)]
    assert sample(random_logits(2), params, seen=[[1], [2]])[1] is None


def test_a_fully_seeded_batch_leaves_the_global_generator_alone():
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    sample(random_logits(2), [SamplingParams(seed=1), SamplingParams(seed=2)], [gen(1), gen(2)])
    assert torch.equal(torch.rand(3), expected)  # an unseeded request's draws don't shift


def test_metadata_leaves_out_what_no_row_needs():
    greedy = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=3)  # greedy ignores all of these
    plain = SamplingParams(temperature=0.8)
    md = SamplingMetadata.from_requests([greedy, SamplingParams(temperature=0.0)], [gen(3), None], [0, 0],
                                        EOS, [[1, 2], [3]], [[2], []])
    assert md.all_greedy is True and md.temperature is None and md.generators == {}
    assert md.no_processing  # no penalty, no min_tokens, no logprobs: the fast argmax path
    assert md.penalty_rows is None and md.min_tokens_rows is None and md.min_tokens_cols is None
    g = gen(4)
    md = SamplingMetadata.from_requests([greedy, plain, SamplingParams(seed=4)], [gen(3), None, g], [0] * 3,
                                        EOS, None)
    assert md.all_greedy is False and md.greedy_rows.tolist() == [True, False, False]
    assert md.top_k is None and md.top_p is None  # only the greedy row asked for them
    assert md.generators == {2: g}
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    md = SamplingMetadata.from_requests([penalised, penalised], [None] * 2, [0] * 2, EOS, [[], [5]])
    assert md.penalty_rows.tolist() == [1]  # the row that has seen nothing has nothing to penalise
