"""Physical KV blocks: reference counts, the free queue and the prefix-cache map.

A block is free when no block table holds it (ref_count 0). A free block may still
carry a cached prefix (its hash): it stays findable through `lookup` until it is
handed out again, and the free queue hands out the least recently freed block
first, so popular prefixes survive longest.

    free queue (LRU head -> tail):  [b7 b3 b9 ... b12]
                                     ^ next allocation evicts b7 (and its hash)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV cache needs at least one block, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, Block] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks published in the prefix cache (free or in use)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, count: int) -> list[Block]:
        """Takes `count` free blocks (evicting their cached hashes); caller checked room."""
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} KV blocks, {self.num_free} free")
        taken = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            taken.append(block)
        return taken

    def acquire(self, blocks: Iterable[Block]) -> None:
        """Adds a reference to blocks another table (or the prefix cache) already holds."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drops one reference from each block; blocks reaching zero join the free queue's
        tail in the order given (pass a table tail-first so its prefix outlives its tail)."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def lookup(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash)

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Publishes a full block under its prefix hash (first writer wins)."""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, block)

    def uncache(self, block: Block) -> None:
        """Withdraws a block from the prefix cache (its K/V is not, or no longer, trusted)."""
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def num_evictable_among(self, blocks: Iterable[Block]) -> int:
        """How many of `blocks` sit in the free queue (acquiring them uses up free room)."""
        return sum(1 for block in blocks if block.ref_count == 0)
