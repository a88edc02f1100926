"""A cluster seen from LMCache: three real sidecars on one pool file (node a
the primary, b and c followers that forward registry calls to it), and
LMCache's StorageManager (the L1/L2 core that `lmcache server` runs) with the
plugin as its L2. Chunks stored through one node's socket are L2 hits through
another node's socket with identical bytes, on the mapped path and the
inline one.

Every node starts before anything is stored, so the hits can only come from
the primary's registry: two sidecars without the cluster flags on one pool
would each answer from a registry of their own and miss."""

from __future__ import annotations


import pytest
import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc

from cxlkv_testkit import storage_manager, upstream, wait_for
from cxlkv_testkit.l2 import key

# 64 KiB per chunk: 16 pages of the kit's 4 KiB pages, so a chunk spans
# pages and its bytes are not all in one line of the pool.
SHAPE, DTYPE = torch.Size([2, 16, 1024]), torch.bfloat16
CHUNK_BYTES = SHAPE.numel() * 2


def chunk(seed: int) -> torch.Tensor:
    """Known, distinct contents per chunk (not a constant fill, so a chunk
    read from the wrong place or half-written cannot pass)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(DTYPE)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def store(socket: str, seeds: list[int], **params) -> None:
    """Store one chunk per seed (key = seed) through this socket and wait
    until the adapter has committed them all."""
    layout = MemoryLayoutDesc(shapes=[SHAPE], dtypes=[DTYPE])
    keys = [key(s) for s in seeds]
    sm = storage_manager(socket, poll_interval_ms=100, **params)
    try:
        adapter = sm._l2_adapters[0]
        expected_mode = params.get("mode", "mmap")
        assert adapter.report_status()["mode"] == expected_mode
        reserved = sm.reserve_write(keys, layout)
        for s, k in zip(seeds, keys):
            reserved[k].tensor.copy_(chunk(s))
        sm.finish_write(keys)
        assert wait_for(lambda: adapter.get_usage().total_bytes_used == len(seeds) * CHUNK_BYTES, timeout=10), \
            f"stores through {socket} never completed: {adapter.report_status()}"
    finally:
        sm.close()


def prefetch(socket: str, seeds: list[int], **params) -> tuple[int, int]:
    """A fresh StorageManager on this socket prefetches the chunks; returns
    (L2 hits, of which with the stored bytes). Its L1 starts empty, so every
    hit is a lookup and a load through this node."""
    single_row_spec = upstream("tests.v1.distributed.utils").single_row_spec

    layout = MemoryLayoutDesc(shapes=[SHAPE], dtypes=[DTYPE])
    keys = [key(s) for s in seeds]
    sm = storage_manager(socket, **params)
    try:
        assert sm._l2_adapters[0].report_status()["mode"] == params.get("mode", "mmap")
        handle = sm.submit_prefetch_task(single_row_spec(keys, layout))
        assert sm.wait_prefetch_status(handle, timeout=10.0)
        status = sm.query_prefetch_status(handle)
        assert status.l1_hit_cells[0].count_leading_ones() == 0, "a fresh L1 cannot hold them"
        hits = status.l2_hit_cells[0].count_leading_ones()
        good = 0
        if hits:
            with sm.read_prefetched_results(keys[:hits]) as results:
                assert results is not None
                good = sum(same_bytes(r.tensor.view(SHAPE), chunk(s)) for r, s in zip(results, seeds))
            sm.finish_read_prefetched(keys[:hits])
        return hits, good
    finally:
        sm.close()


# None: the adapter's default ('auto'), which maps the pool here.
@pytest.mark.parametrize("mode", [None, "inline"], ids=["mapped", "inline"])
def test_chunks_stored_through_one_follower_are_hits_through_the_other(cluster, mode):
    params = {} if mode is None else {"mode": mode}
    b, c = cluster["b"].socket, cluster["c"].socket
    stored_on_b = list(range(1, 7))
    store(b, stored_on_b, **params)
    assert prefetch(c, stored_on_b, **params) == (6, 6), "all six chunks stored through b are hits through c, " \
                                                         "byte for byte"
    # And the other way round.
    store(c, [100], **params)
    assert prefetch(b, [100], **params) == (1, 1), "a chunk stored through c is a hit through b"
    # The primary answers for both: its own clients see every chunk too.
    assert prefetch(cluster["a"].socket, [*stored_on_b, 100], **params) == (7, 7)
