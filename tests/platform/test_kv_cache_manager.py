"""Block pool and block tables: prefix hits, adapter-keyed hashes, forks, copy-on-write."""

from pathlib import Path

import pytest

from loraplex.adapters.peft_format import LoRAAdapter
from loraplex.platform.block_pool import BlockPool
from loraplex.platform.kv_cache_manager import KVCacheManager, hash_block
from loraplex.platform.request import Request, SamplingParams


def make_request(request_id: str, tokens: list[int], adapter_key: bytes | None = None) -> Request:
    """A request; with `adapter_key`, it runs an (empty) adapter of that identity."""
    lora = None if adapter_key is None else LoRAAdapter("a", Path("."), adapter_key, {})
    return Request(request_id, list(tokens), SamplingParams(max_tokens=4), lora=lora)


def admit(manager: KVCacheManager, request: Request) -> int:
    """Admits a request like the scheduler does; returns the number of cached tokens."""
    cached = manager.find_cached_prefix(request)
    num_cached = len(cached) * manager.block_size
    assert manager.allocate(request, request.num_tokens - num_cached, cached)
    request.num_computed_tokens = request.num_tokens
    return num_cached


def test_allocate_and_free_restore_pool():
    manager = KVCacheManager(BlockPool(8), block_size=4, enable_prefix_caching=True)
    request = make_request("a", list(range(10)))
    admit(manager, request)
    assert len(manager.block_ids("a")) == 3
    assert manager.pool.num_free == 5
    manager.check_invariants()
    manager.free(request)
    assert manager.pool.num_free == 8
    manager.check_invariants()


def test_allocation_fails_without_side_effects_when_short():
    manager = KVCacheManager(BlockPool(2), block_size=4, enable_prefix_caching=True)
    request = make_request("a", list(range(12)))
    assert not manager.allocate(request, 12)
    assert manager.pool.num_free == 2
    assert manager.block_ids("a") == []


def test_prefix_hit_reuses_full_blocks_and_leaves_one_token():
    manager = KVCacheManager(BlockPool(16), block_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(12)))
    admit(manager, first)
    second = make_request("b", list(range(12)))
    # 12 tokens = 3 full blocks, but the last token must be computed: 2 blocks hit.
    assert admit(manager, second) == 8
    assert manager.block_ids("b")[:2] == manager.block_ids("a")[:2]
    assert manager.block_ids("b")[2] != manager.block_ids("a")[2]
    manager.check_invariants()


def test_freed_blocks_stay_cached_until_reused():
    manager = KVCacheManager(BlockPool(4), block_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(9)))
    admit(manager, first)
    manager.free(first)
    second = make_request("b", list(range(9)))
    assert admit(manager, second) == 8
    manager.check_invariants()


def test_adapter_identity_separates_prefix_cache():
    manager = KVCacheManager(BlockPool(16), block_size=4, enable_prefix_caching=True)
    admit(manager, make_request("base", list(range(9))))
    assert admit(manager, make_request("lora", list(range(9)), adapter_key=b"adapter-1")) == 0
    assert admit(manager, make_request("lora2", list(range(9)), adapter_key=b"adapter-1")) == 8
    assert admit(manager, make_request("other", list(range(9)), adapter_key=b"adapter-2")) == 0
    assert hash_block(None, [1, 2], b"x") != hash_block(None, [1, 2], None)


def test_prefix_caching_off_never_hits():
    manager = KVCacheManager(BlockPool(16), block_size=4, enable_prefix_caching=False)
    admit(manager, make_request("a", list(range(9))))
    assert admit(manager, make_request("b", list(range(9)))) == 0


def test_fork_shares_blocks_and_copy_on_write_on_partial_block():
    manager = KVCacheManager(BlockPool(8), block_size=4, enable_prefix_caching=True)
    parent = make_request("p", list(range(6)))
    admit(manager, parent)
    child = make_request("c", list(range(6)))
    manager.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    assert manager.block_ids("c") == manager.block_ids("p")
    manager.check_invariants()
    # Child writes token 6 into the shared, half-full second block: it gets a copy.
    child.append_output_token(7, None)
    assert manager.allocate(child, 1)
    copies = manager.take_pending_copies()
    assert copies == [(manager.block_ids("p")[1], manager.block_ids("c")[1])]
    assert manager.block_ids("c")[0] == manager.block_ids("p")[0]
    manager.check_invariants()
    # The parent is now the only holder of its last block: it writes in place.
    parent.append_output_token(9, None)
    assert manager.allocate(parent, 1)
    assert manager.take_pending_copies() == []
    manager.free(parent)
    manager.free(child)
    assert manager.pool.num_free == 8
    manager.check_invariants()


def test_release_more_than_acquired_is_an_error():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([block])


def test_decodes_inside_a_block_take_nothing_and_the_one_that_fills_it_caches_it():
    """A decode inside the request's last block takes no block; the decode whose token
    fills the block publishes it, so a later prompt of the same tokens hits it."""
    manager = KVCacheManager(BlockPool(8), block_size=4, enable_prefix_caching=True)
    first = make_request("a", [1, 2, 3, 4, 5])
    admit(manager, first)
    free_after_prompt = manager.pool.num_free
    for token in (6, 7, 8):
        first.append_output_token(token, None)
        assert manager.allocate(first, 1)
        first.num_computed_tokens += 1
    assert manager.pool.num_free == free_after_prompt
    manager.check_invariants()
    second = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(manager, second) == 8
    assert manager.block_ids("b")[:2] == manager.block_ids("a")[:2]
    manager.check_invariants()
