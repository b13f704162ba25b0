"""Per-request block tables on top of the block pool: allocation, prefix-cache lookups,
forks for n > 1 sampling and copy-on-write.

Block table of one request (block_size 4), 10 tokens computed:

    tokens   [t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 __ __]
    table    [   b5       |    b2       |    b9      ]
    hashes   [   h0       |    h1       ]              h1 = H(h0, t4..t7, adapter)

Only full blocks are hashed, and each hash chains its predecessor and the adapter's
identity, so a hit means "same adapter, same tokens from position 0". The first block
also chains the request's cache salt (one per tenant, as vLLM's `cache_salt`), so
requests with different salts never share a block or learn of each other's prompts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from loraplex.platform.block_pool import Block, BlockPool
from loraplex.platform.request import Request


def hash_block(parent: bytes | None, token_ids: list[int], adapter_key: bytes | None) -> bytes:
    """Prefix-cache key of one full block: chains the previous block's key, the block's
    token ids and the identity of the adapter that produced its K/V."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent or b"root")
    digest.update(adapter_key or b"base")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def _salted_root(salt: bytes | None) -> bytes | None:
    """The parent key of a request's first block: its cache salt, if any."""
    return None if salt is None else b"salt:" + salt


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0
        self.prefix_hits = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._tables.get(request_id, ())]

    def tables(self) -> dict[str, list[Block]]:
        return self._tables

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """Hashes of the request's first `num_full_blocks` blocks, computed once each."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        size = self.block_size
        while len(hashes) < num_full_blocks:
            index = len(hashes)
            parent = hashes[-1] if hashes else _salted_root(request.cache_salt)
            chunk = tokens[index * size : (index + 1) * size]
            hashes.append(hash_block(parent, chunk, request.adapter_key))
        return hashes

    def find_cached_prefix(self, request: Request, count: bool = True) -> list[Block]:
        """Longest run of cached full blocks matching the request's tokens. At least one
        token is always left to compute, so the model yields logits for sampling.
        `count=False` leaves the prefix-hit counters alone (a look, not an admission)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in self._block_hashes(request, max_blocks):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        if count:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(hits) * self.block_size
        return hits

    def allocate(self, request: Request, num_new_tokens: int, cached: list[Block] = ()) -> bool:
        """Makes room for `num_new_tokens` more tokens after the `cached` prefix blocks
        (given only when the request is admitted). Returns False, changing nothing, when
        the pool is short."""
        if not cached and self._fits_in_own_blocks(request, num_new_tokens):
            return True
        if not self.can_allocate(request, num_new_tokens, cached):
            return False
        table = self._tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached) * self.block_size
        total = num_computed + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(table) - len(cached)
        cow = self._needs_copy_on_write(table, num_computed)
        if cached:
            self.pool.acquire(cached)
            table = table + list(cached)
        if cow:
            table = self._copy_last_block(table)
        if num_new_blocks > 0:
            table = table + self.pool.allocate(num_new_blocks)
        self._tables[request.request_id] = table
        self._publish_full_blocks(request, table, num_computed, total)
        return True

    def _fits_in_own_blocks(self, request: Request, num_new_tokens: int) -> bool:
        """`allocate`'s common case, a decode inside its last block: when the tokens fit
        in the blocks the request holds and the block it writes into is its own (not
        shared, so no copy-on-write), nothing is taken from the pool. Caches a block the
        tokens fill, as `allocate` does. False: nothing done, take the general path."""
        table = self._tables.get(request.request_id)
        if not table:
            return False
        size = self.block_size
        num_computed = request.num_computed_tokens
        total = num_computed + num_new_tokens
        if total > len(table) * size:
            return False
        if num_computed % size != 0 and table[-1].ref_count > 1:
            return False
        if total // size > num_computed // size:
            self._publish_full_blocks(request, table, num_computed, total)
        return True

    def can_allocate(
        self, request: Request, num_new_tokens: int, cached: Sequence[Block] = ()
    ) -> bool:
        """Whether `allocate` with these arguments would succeed now."""
        table = self._tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached) * self.block_size
        num_new_blocks = self.blocks_needed(num_computed + num_new_tokens) - len(table)
        num_new_blocks -= len(cached)
        cow = self._needs_copy_on_write(table, num_computed)
        room_needed = max(num_new_blocks, 0) + cow + self.pool.num_evictable_among(cached)
        return room_needed <= self.pool.num_free

    def _needs_copy_on_write(self, table: list[Block], num_computed: int) -> bool:
        """A shared, partly filled last block must be copied before this request writes."""
        return bool(table) and num_computed % self.block_size != 0 and table[-1].ref_count > 1

    def _copy_last_block(self, table: list[Block]) -> list[Block]:
        shared = table[-1]
        (private,) = self.pool.allocate(1)
        self.pool.release([shared])
        self._pending_copies.append((shared.block_id, private.block_id))
        return table[:-1] + [private]

    def _publish_full_blocks(
        self, request: Request, table: list[Block], num_computed: int, num_tokens: int
    ) -> None:
        """Caches the blocks this step fills (those before `num_computed` already are).
        The step writes every token's K/V before any attention reads, so same-step hits
        are safe."""
        if not self.enable_prefix_caching:
            return
        first = num_computed // self.block_size
        num_full = num_tokens // self.block_size
        hashes = self._block_hashes(request, num_full)
        for index in range(first, num_full):
            self.pool.cache(table[index], hashes[index])

    def allocate_draft_slots(self, request: Request, num_drafts: int) -> bool:
        """Grows the table of a request scheduled to compute its newest token so that
        `num_drafts` speculative tokens after it have cache slots too. The new blocks
        are fresh and never published (drafts are not the request's tokens yet). Returns
        False, changing nothing, when the free queue is short (the caller then drops
        the drafts: nothing is preempted for them)."""
        table = self._tables[request.request_id]
        needed = self.blocks_needed(request.num_computed_tokens + 1 + num_drafts) - len(table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            return False
        table.extend(self.pool.allocate(needed))
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Rollback after verification: releases the blocks wholly past the request's
        first `num_tokens` tokens (those held only rejected drafts' K/V; never
        published, so nothing leaves the prefix cache)."""
        table = self._tables.get(request.request_id)
        keep = self.blocks_needed(num_tokens)
        if table is None or len(table) <= keep:
            return
        self.pool.release(reversed(table[keep:]))
        del table[keep:]

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent's table (copy-on-write later)."""
        table = self._tables[parent.request_id]
        self.pool.acquire(table)
        self._tables[child.request_id] = list(table)
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, ()))

    def free(self, request: Request, uncache: bool = False) -> None:
        """Releases the request's blocks; `uncache` also withdraws those no other table
        holds from the prefix cache (a failed request's K/V is not trusted)."""
        table = self._tables.pop(request.request_id, [])
        self._hashes.pop(request.request_id, None)
        self.pool.release(reversed(table))
        if uncache:
            for block in table:
                if block.ref_count == 0:
                    self.pool.uncache(block)

    def unpublish_uncomputed(self, request: Request) -> None:
        """Withdraws from the prefix cache the blocks this step published for tokens
        it then did not compute (the step was abandoned before the model ran)."""
        table = self._tables.get(request.request_id, ())
        for block in table[request.num_computed_tokens // self.block_size :]:
            self.pool.uncache(block)

    def forget_hashes(self, request: Request) -> None:
        """Drops memoized hashes (a preempted request is recomputed from scratch)."""
        self._hashes.pop(request.request_id, None)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def check_invariants(self) -> None:
        """Ref counts equal the number of tables holding each block; free + used = total."""
        holders: dict[int, int] = {}
        for table in self._tables.values():
            for block in table:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            expected = holders.get(block.block_id, 0)
            if block.ref_count != expected:
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count}, held by {expected} tables"
                )
        used = sum(1 for block in self.pool.blocks if block.ref_count > 0)
        if used + self.pool.num_free != self.pool.num_blocks:
            raise AssertionError(
                f"{used} used + {self.pool.num_free} free != {self.pool.num_blocks} blocks"
            )
