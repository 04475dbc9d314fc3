from __future__ import annotations

import pytest
from loom.engine.block_manager import BlockManager
from loom.engine.request import Request
from loom_plugin_api import LoRARequest, SamplingParams

BS = 4


def make_request(tokens: list[int], req_id: str = "r", arrival: int = 0) -> Request:
    return Request(req_id, None, tokens, SamplingParams(), arrival)


def schedule_prompt(bm: BlockManager, req: Request) -> bool:
    """What the scheduler does for a waiting request: look up the prefix, allocate the rest."""
    hits, num_cached = bm.get_computed_blocks(req)
    ok = bm.allocate_slots(req, req.num_tokens - num_cached, hits)
    if ok:
        req.num_computed_tokens = req.num_tokens
    return ok


def test_allocate_and_free_counts_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_request(list(range(10)))
    assert schedule_prompt(bm, req)
    assert len(req.block_ids) == 3  # ceil(10 / 4)
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    # Two decode tokens fit the third block's free slots; a third one needs a new block.
    for expected in (3, 3, 4):
        req.append_output_token(99)
        assert bm.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        assert len(req.block_ids) == expected
    bm.free(req)
    assert req.block_ids == []
    assert bm.num_free_blocks == 8
    assert bm.usage == 0.0


def test_allocate_fails_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=BS)
    req = make_request(list(range(12)))
    assert not bm.allocate_slots(req, 12)
    assert req.block_ids == []
    assert bm.num_free_blocks == 2


def test_prefix_hit_shares_full_blocks_only():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request(list(range(10)), "a")
    assert schedule_prompt(bm, a)
    b = make_request(list(range(8)) + [50, 51, 52], "b")
    hits, num_cached = bm.get_computed_blocks(b)
    assert hits == a.block_ids[:2] and num_cached == 8
    assert schedule_prompt(bm, b)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert bm.ref_cnt[a.block_ids[0]] == 2
    assert bm.prefix_hits == 8 and bm.prefix_queries == 21


def test_never_serves_the_whole_prompt_from_cache():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request(list(range(8)), "a")
    assert schedule_prompt(bm, a)
    b = make_request(list(range(8)), "b")
    hits, num_cached = bm.get_computed_blocks(b)
    # 8 tokens = 2 full blocks, but the last token must run through the model.
    assert len(hits) == 1 and num_cached == 4


def test_freed_cached_blocks_are_reused_until_evicted():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request(list(range(9)), "a")
    assert schedule_prompt(bm, a)
    a_blocks = list(a.block_ids)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = make_request(list(range(9)), "b")
    hits, num_cached = bm.get_computed_blocks(b)
    assert hits == a_blocks[:2] and num_cached == 8
    bm.free(b)  # never allocated: nothing happens
    # A different prompt takes every block: the cached ones are evicted.
    c = make_request(list(range(100, 116)), "c")
    assert schedule_prompt(bm, c)
    assert bm.get_computed_blocks(make_request(list(range(9)), "d")) == ([], 0)


def test_uncached_free_blocks_are_reused_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request(list(range(6)), "a")  # one full (cached) block, one partial
    assert schedule_prompt(bm, a)
    full, partial = a.block_ids
    bm.free(a)
    b = make_request([7, 7, 7], "b")
    assert schedule_prompt(bm, b)
    assert b.block_ids == [partial]
    assert bm.get_computed_blocks(make_request(list(range(6)), "c"))[0] == [full]


def test_generated_tokens_fill_cached_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request([1, 2, 3], "a")
    assert schedule_prompt(bm, a)
    for t in (4, 5, 6):  # the block fills as decode steps compute the generated tokens
        a.append_output_token(t)
        assert bm.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    b = make_request([1, 2, 3, 4, 5, 6], "b")
    assert bm.get_computed_blocks(b) == ([a.block_ids[0]], 4)


def test_hit_on_free_blocks_counts_against_free_pool():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_request(list(range(9)), "a")
    assert schedule_prompt(bm, a)
    bm.free(a)
    b = make_request(list(range(8)) + [40, 41, 42, 43, 44], "b")  # 2 hits + 2 new blocks > 3
    hits, num_cached = bm.get_computed_blocks(b)
    assert len(hits) == 2
    assert not bm.allocate_slots(b, b.num_tokens - num_cached, hits)
    assert bm.num_free_blocks == 3 and b.block_ids == []


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_request(list(range(9)), "a")
    assert schedule_prompt(bm, a)
    assert bm.get_computed_blocks(make_request(list(range(9)), "b")) == ([], 0)
    assert bm.cached == {} and bm.prefix_queries == 0


def test_hash_collision_is_not_a_hit():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request(list(range(9)), "a")
    assert schedule_prompt(bm, a)
    b = make_request([9, 9, 9, 9, 9], "b")
    bm._hash_blocks(b, 1)
    b.block_hashes[0] = a.block_hashes[0]  # force a collision
    assert bm.get_computed_blocks(b) == ([], 0)


def test_block_hash_depends_on_the_prefix_before_it():
    """A block equal to another request's block, but after a different prefix, holds other K/V."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request([1, 1, 1, 1, 2, 2, 2, 2, 0], "a")  # blocks A, B
    c = make_request([3, 3, 3, 3, 4, 4, 4, 4, 0], "c")  # blocks C, D
    assert schedule_prompt(bm, a) and schedule_prompt(bm, c)
    b = make_request([3, 3, 3, 3, 2, 2, 2, 2, 0], "b")  # C, then B's tokens after C, not after A
    assert bm.get_computed_blocks(b) == ([c.block_ids[0]], 4)


def test_needs_at_least_one_block():
    with pytest.raises(ValueError, match=r"at least one block, got num_blocks=0"):
        BlockManager(num_blocks=0, block_size=BS)
    bm = BlockManager(num_blocks=1, block_size=BS)  # one block is enough for a short request
    assert schedule_prompt(bm, make_request([1, 2, 3]))
    assert bm.num_free_blocks == 0


def test_ref_counts_are_the_number_of_holders_and_zero_means_free():
    bm = BlockManager(num_blocks=8, block_size=BS)
    held = {}
    for name, tokens in (("a", list(range(9))), ("b", list(range(8)) + [70]), ("c", [5, 6])):
        held[name] = make_request(tokens, name)
        assert schedule_prompt(bm, held[name])
    bm.free(held.pop("c"))

    def check():
        holders = [sum(b in r.block_ids for r in held.values()) for b in range(bm.num_blocks)]
        assert bm.ref_cnt == holders
        assert sorted(bm.free_queue) == [b for b in range(bm.num_blocks) if holders[b] == 0]

    check()
    bm.free(held.pop("a"))
    check()


def test_hit_rate_counts_every_prompt_looked_up():
    bm = BlockManager(num_blocks=16, block_size=BS)
    assert bm.prefix_hit_rate == 0.0
    for name in ("a", "b", "c"):  # 9 tokens each; b and c find a's two full blocks
        assert schedule_prompt(bm, make_request(list(range(9)), name))
    assert (bm.prefix_hits, bm.prefix_queries) == (16, 27)
    assert bm.prefix_hit_rate == pytest.approx(16 / 27)


def test_prompt_logprobs_request_gets_no_hits():
    """It needs the logits of every prompt position, so every prompt token must run."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert schedule_prompt(bm, make_request(list(range(9)), "a"))
    b = Request("b", None, list(range(9)), SamplingParams(prompt_logprobs=1), 1)
    assert bm.get_computed_blocks(b) == ([], 0)


def test_block_filled_by_decode_is_chained_on_the_prompt_before_it():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request([1, 1, 1, 1, 2], "a")
    assert schedule_prompt(bm, a)
    for t in (2, 2, 2):  # the second block fills in a later step: its hash extends the chain
        a.append_output_token(t)
        assert bm.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    # The same tokens at the root are another block (other K/V): no hit.
    assert bm.get_computed_blocks(make_request([2, 2, 2, 2, 9], "d")) == ([], 0)
    assert bm.get_computed_blocks(make_request([1, 1, 1, 1, 2, 2, 2, 2, 5], "e")) == (a.block_ids[:2], 8)


def test_evicted_prefix_is_no_hit_and_is_cached_again_when_recomputed():
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = make_request([1, 2, 3, 4, 5], "a")  # a full block (cached) and a partial one
    assert schedule_prompt(bm, a)
    bm.free(a)
    c = make_request([7, 7, 7, 7, 7], "c")  # takes both blocks: a's full block now holds c's 5th token
    assert schedule_prompt(bm, c)
    assert bm.get_computed_blocks(make_request([1, 2, 3, 4, 5], "d")) == ([], 0)
    bm.free(c)
    d = make_request([1, 2, 3, 4, 5], "d")
    assert schedule_prompt(bm, d)
    assert bm.get_computed_blocks(make_request([1, 2, 3, 4, 6], "e")) == (d.block_ids[:1], 4)


def test_evicted_block_freed_again_is_reused_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=BS)
    y, w = make_request([5, 5, 5, 5, 5], "y"), make_request([6, 6, 6, 6, 6], "w")
    assert schedule_prompt(bm, y) and schedule_prompt(bm, w)
    y_full = y.block_ids[0]
    bm.free(w)
    x = make_request([8, 8, 8, 8, 8], "x")  # its partial block is w's evicted full block
    assert schedule_prompt(bm, x)
    x_full = x.block_ids[0]
    bm.free(y)
    bm.free(x)
    for name in ("z1", "z2"):  # two one-block requests take the two blocks that cache nothing
        assert schedule_prompt(bm, make_request([9, 9], name))
    assert bm.get_computed_blocks(make_request([5, 5, 5, 5, 5], "y2")) == ([y_full], 4)
    assert bm.get_computed_blocks(make_request([8, 8, 8, 8, 8], "x2")) == ([x_full], 4)


def test_invalidated_blocks_are_reused_first_and_cached_again_when_recomputed():
    bm = BlockManager(num_blocks=4, block_size=BS)
    y, x = make_request([5, 5, 5, 5, 5], "y"), make_request([8, 8, 8, 8, 8], "x")
    assert schedule_prompt(bm, y) and schedule_prompt(bm, x)
    y_full = y.block_ids[0]
    bm.free(y)
    bm.free(x, invalidate=True)  # x's step failed: its full block was never written
    for name in ("z1", "z2", "z3"):  # three one-block requests: y's cached block is the last to go
        assert schedule_prompt(bm, make_request([9, 9], name))
    assert bm.get_computed_blocks(make_request([5, 5, 5, 5, 5], "y2")) == ([y_full], 4)

    bm = BlockManager(num_blocks=4, block_size=BS)
    x = make_request([8, 8, 8, 8, 8], "x")
    assert schedule_prompt(bm, x)
    bm.free(x, invalidate=True)
    x2 = make_request([8, 8, 8, 8, 8], "x2")
    assert schedule_prompt(bm, x2)
    assert bm.get_computed_blocks(make_request([8, 8, 8, 8, 1], "x3")) == (x2.block_ids[:1], 4)


def test_freed_request_allocated_again_from_scratch_registers_its_blocks_again():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_request(list(range(9)), "a")
    assert schedule_prompt(bm, a)
    bm.free(a)
    a.num_computed_tokens = 0
    assert bm.allocate_slots(a, 9)  # no lookup: it takes every block, evicting its own old copies
    assert bm.get_computed_blocks(make_request(list(range(9)), "b")) == (a.block_ids[:2], 8)


def test_blocks_are_keyed_by_lora_adapter():
    """The same tokens under another adapter (or none) hold other K/V: never a hit; under the same
    adapter, a hit. A forced hash collision across adapters is caught by the recorded adapter id."""
    bm = BlockManager(num_blocks=32, block_size=BS)
    prompt = list(range(9))  # two full blocks
    lora = [LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in (1, 2)]
    first = Request("a", None, prompt, SamplingParams(), 0, lora_request=lora[0])
    assert schedule_prompt(bm, first)
    assert bm.get_computed_blocks(Request("b", None, prompt, SamplingParams(), 1, lora_request=lora[1])) == ([], 0)
    assert bm.get_computed_blocks(make_request(prompt, "base")) == ([], 0)
    same = Request("c", None, prompt, SamplingParams(), 2, lora_request=lora[0])
    assert bm.get_computed_blocks(same) == (first.block_ids[:2], 8)
    other = Request("d", None, prompt, SamplingParams(), 3, lora_request=lora[1])
    bm._hash_blocks(other, 2)
    other.block_hashes[:] = first.block_hashes  # force a collision with adapter 1's chain
    assert bm.get_computed_blocks(other) == ([], 0)
