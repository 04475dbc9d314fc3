from __future__ import annotations

import pytest
from loom.engine.block_manager import BlockManager
from loom.engine.request import Request
from loom.sampling_params import SamplingParams

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
