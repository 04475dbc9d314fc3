"""BlockManager: the KV-cache block pool, with prefix caching (vLLM v1's KVCacheManager, small).

A fixed pool of ``num_blocks`` blocks of ``block_size`` tokens. Each block has a
reference count; a block at zero is free. With prefix caching, a block whose tokens are
all computed is registered under a hash chained over (parent hash, its token ids), so a
later request with the same prefix maps the same block instead of computing it again.
A free block keeps its hash and contents until it is reused: the free queue is in LRU
order and a cached block leaves the cache only when the allocator takes it (eviction).
The chain of a request with a LoRA adapter starts from its adapter's id, and a block records
that id beside its tokens: KV computed under one adapter never serves another, or the base model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .request import Request

_ROOT_HASH = 0


def _key(request: Request, tokens: Sequence[int]) -> tuple[int, ...]:
    """What a cached block must hold to serve ``request``: its adapter's id, then its tokens."""
    return (request.lora_id, *tokens)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Parallel lists indexed by block id: faster than one object per block in Python.
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        # Free blocks, least recently freed first; allocation takes from the front. An
        # OrderedDict so a cache hit on a free block can pull it out of the middle in O(1).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}
        """Block hash -> block id of every registered block (in use or free)."""
        self.prefix_queries = 0
        """Tokens looked up in the prefix cache (prompts as they are first scheduled)."""
        self.prefix_hits = 0
        """Of those, tokens found cached."""

    # ---- stats ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached but free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # ---- prefix cache -----------------------------------------------------------------------
    def _hash_blocks(self, request: Request, num_full_blocks: int) -> list[int]:
        """Extend the request's hash chain to ``num_full_blocks`` blocks; each block is hashed once."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else (hash(("lora", request.lora_id)) if request.lora_id else _ROOT_HASH)
        for i in range(len(hashes), num_full_blocks):
            parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of a request about to be scheduled from the waiting queue.

        Returns the block ids and the number of tokens they hold. Reference counts do not
        change until ``allocate_slots`` takes the blocks. The last token is never served from
        the cache: the model must run on it to produce the logits to sample from. A request
        that asks for prompt logprobs gets no hits: it needs the logits of every prompt position.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self._hash_blocks(request, max_blocks)
        tokens = request.all_token_ids
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self.cached.get(hashes[i])
            # Compare the tokens too: a hash collision must never serve another prompt's KV.
            if block_id is None or self.block_tokens[block_id] != _key(request, tokens[i * bs:(i + 1) * bs]):
                break
            hits.append(block_id)
        return hits, len(hits) * bs

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that ``num_tokens`` computed tokens fill."""
        num_full = num_tokens // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        bs = self.block_size
        hashes = self._hash_blocks(request, num_full)
        tokens = request.all_token_ids
        for i in range(request.num_cached_blocks, num_full):
            h = hashes[i]
            # Another request may have computed the same block at the same time; the first
            # one registered stays, this copy is freed as an ordinary block later.
            if h not in self.cached:
                block_id = request.block_ids[i]
                self.cached[h] = block_id
                self.block_hash[block_id] = h
                self.block_tokens[block_id] = _key(request, tokens[i * bs:(i + 1) * bs])
        request.num_cached_blocks = num_full

    # ---- allocation -------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens of the request; False when blocks run out.

        ``new_computed_blocks`` are prefix-cache hits from ``get_computed_blocks`` for a
        request leaving the waiting queue (its ``num_computed_tokens`` is 0); they come before
        the new tokens. On False nothing changes. Blocks filled by this step's tokens are
        registered in the prefix cache at once: attention writes the whole step's K/V before
        it reads, so a request scheduled later in the same step may already share them.
        """
        computed = new_computed_blocks or ()
        bs = self.block_size
        num_computed = request.num_computed_tokens + len(computed) * bs
        total = num_computed + num_new_tokens
        num_required = -(-total // bs) - len(request.block_ids) - len(computed)
        ref_cnt = self.ref_cnt
        # Hits on free blocks leave the free queue too, so they count against it.
        num_free_hits = sum(1 for b in computed if ref_cnt[b] == 0)
        if num_required + num_free_hits > len(self.free_queue):
            return False
        block_ids = request.block_ids
        for block_id in computed:
            if ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
            ref_cnt[block_id] += 1
            block_ids.append(block_id)
        for _ in range(max(num_required, 0)):
            block_id, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[block_id]
            if h is not None:  # evict: the block gets new contents
                self._uncache(block_id, h)
            ref_cnt[block_id] = 1
            block_ids.append(block_id)
        if new_computed_blocks is not None and self.enable_prefix_caching:
            request.num_cached_blocks = len(computed)
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(computed) * bs
        if self.enable_prefix_caching:  # not a pending token's block (overlapped steps): its token is unknown
            self._cache_full_blocks(request, min(total, request.num_tokens))
        return True

    def cache_computed(self, request: Request) -> None:
        """Register the blocks a pending token just filled (overlapped steps), as ``allocate_slots``
        registers every other block when its tokens are scheduled."""
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, min(request.num_computed_tokens, request.num_tokens))

    def forget(self, block_ids: Sequence[int]) -> None:
        """Blocks a failed step was to write leave the prefix cache, those no request holds now (a
        holder is preempted or ended with ``invalidate``, which drops them when it lets go)."""
        for block_id in block_ids:
            h = self.block_hash[block_id]
            if self.ref_cnt[block_id] == 0 and h is not None:
                self._uncache(block_id, h)
                self.free_queue.move_to_end(block_id, last=False)

    def _uncache(self, block_id: int, h: int) -> None:
        """The block, registered under ``h``, leaves the prefix cache."""
        if self.cached.get(h) == block_id:
            del self.cached[h]
        self.block_hash[block_id] = None
        self.block_tokens[block_id] = None

    def free(self, request: Request, invalidate: bool = False) -> None:
        """Drop the request's references; its cached blocks stay reusable until evicted.

        ``invalidate``: the step that was to fill these blocks failed, so blocks no other
        request holds leave the prefix cache (their contents were never written).
        """
        ref_cnt = self.ref_cnt
        free_queue = self.free_queue
        # Reversed, so a request's last blocks are evicted before its first ones: prefixes
        # are what other requests share.
        for block_id in reversed(request.block_ids):
            ref_cnt[block_id] -= 1
            if ref_cnt[block_id] == 0:
                free_queue[block_id] = None
                h = self.block_hash[block_id]
                if invalidate and h is not None:
                    self._uncache(block_id, h)
                if self.block_hash[block_id] is None:
                    # Nothing to keep in it: reuse it before any cached block.
                    free_queue.move_to_end(block_id, last=False)
        # A new list, not clear(): a SchedulerOutput still in flight holds the old one.
        request.block_ids = []
        request.num_cached_blocks = 0
