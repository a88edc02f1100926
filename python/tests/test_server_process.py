"""Restart survival and cross-node hits through real `lmcache server`
processes (LMCache's multiprocess server) with the plugin as their L2, driven
the way an inference worker drives them: KV caches registered with the
server, LOOKUP / STORE / RETRIEVE sent through LMCache's own client.

A hit must come from L2, not from the server's L1 (its own DRAM), so every
retrieval below starts with an L1 that holds nothing: either a fresh server
process, or one whose L1 was cleared through its HTTP API, and the L1
object count is checked to be zero first. Bytes are compared in full."""

from __future__ import annotations

import pytest

from cxlkv_testkit import (
    LMCACHE_CHUNK_BYTES,
    LMCACHE_CHUNK_TOKENS,
    KVWorker,
    LMCacheServer,
    expected,
    same_bytes,
    wait_for,
)

CHUNKS = 6
# Stored from blocks 0.., retrieved into blocks 32.. (zeros until then), so a
# retrieval that wrote nothing cannot leave the right bytes behind.
SRC_BLOCK, DST_BLOCK = 0, 32


def store_chunks(server: LMCacheServer, seed: int) -> tuple:
    """A worker of `server` stores CHUNKS chunks of known bytes; returns their
    tokens once the server has written them all to L2 (it writes L1 first and
    hands them to L2 in the background)."""
    tokens = KVWorker.tokens(seed, CHUNKS)
    with KVWorker(server.rpc_url) as w:
        assert w.lookup_and_retrieve(tokens, DST_BLOCK) == 0, "nothing is stored yet"
        w.fill(SRC_BLOCK, tokens, seed)
        assert w.store(tokens, SRC_BLOCK)
    assert wait_for(lambda: len(server.l2_entries()) == CHUNKS, timeout=20), \
        f"the server never wrote the chunks to L2: {server.status()}"
    assert [e["size_bytes"] for e in server.l2_entries()] == [LMCACHE_CHUNK_BYTES] * CHUNKS
    return tokens


def hits_with_bytes(worker: KVWorker, server: LMCacheServer, tokens: tuple, seed: int) -> int:
    """LOOKUP + RETRIEVE through `worker` with nothing in `server`'s L1:
    returns the hit chunks, after checking they came back byte for byte."""
    assert server.l1_objects() == 0, "L1 must be empty, or a hit could come from it"
    hits = worker.lookup_and_retrieve(tokens, DST_BLOCK)
    n = hits * LMCACHE_CHUNK_TOKENS
    if hits:
        assert same_bytes(worker.read(DST_BLOCK, tokens[:n]),
                          [t[:, :hits * KVWorker.blocks_per_chunk] for t in expected(seed, len(tokens))]), \
            "a hit came back with other bytes"
    return hits


def test_chunks_stored_through_lmcache_server_survive_a_sidecar_kill_9(sidecar, tmp_path):
    with LMCacheServer(tmp_path, sidecar.socket, "server-1").start() as server:
        tokens = store_chunks(server, seed=11)

        sidecar.kill()
        assert wait_for(lambda: server.l2_healthy() is False, timeout=10), server.tail()
        sidecar.start()
        assert wait_for(lambda: server.l2_healthy() is True, timeout=10), server.tail()
        assert len(server.l2_entries()) == CHUNKS, "the restarted sidecar lists the chunks to LMCache"

        # The same server process: L1 emptied, so every hit is a load from L2
        # through the restarted sidecar.
        assert server.post("/cache/clear", {"tier": "l1"}) is not None
        with KVWorker(server.rpc_url) as w:
            assert hits_with_bytes(w, server, tokens, seed=11) == CHUNKS, server.tail()
            # A sequence never stored is a miss: the lookup is not trivially true.
            assert server.post("/cache/clear", {"tier": "l1"}) is not None
            assert hits_with_bytes(w, server, KVWorker.tokens(99, CHUNKS), seed=99) == 0

    # A fresh server process on the same sidecar: its L1 starts empty.
    with LMCacheServer(tmp_path, sidecar.socket, "server-2").start() as fresh, KVWorker(fresh.rpc_url) as w:
        assert hits_with_bytes(w, fresh, tokens, seed=11) == CHUNKS, fresh.tail()
    assert server.errors() == fresh.errors() == []


# None: the plugin's default ('auto'), which maps the pool here; 'inline'
# moves the bytes through the sidecar's gRPC stream instead.
@pytest.mark.parametrize("mode", [None, "inline"], ids=["mapped", "inline"])
def test_chunks_stored_by_lmcache_server_on_node_a_are_hits_for_another_on_node_c(cluster, tmp_path, mode):
    """Every node is up before anything is stored, so node c can only find
    the chunks through the primary's registry: sidecars without the cluster
    flags on one pool each answer from a registry of their own and miss."""
    params = {} if mode is None else {"mode": mode}
    with LMCacheServer(tmp_path, cluster["a"].socket, "server-a", **params).start() as on_a, \
            LMCacheServer(tmp_path, cluster["c"].socket, "server-c", **params).start() as on_c:
        assert on_a.l2_status()["mode"] == on_c.l2_status()["mode"] == (mode or "mmap")
        tokens = store_chunks(on_a, seed=21)
        with KVWorker(on_c.rpc_url) as w:
            assert hits_with_bytes(w, on_c, tokens, seed=21) == CHUNKS, on_c.tail()
    assert on_a.errors() == on_c.errors() == []
