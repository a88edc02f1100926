"""The plugin on pools that are not cache-coherent across hosts.

On the sidecar's "noncoherent-test" backend every process (and every
`PoolMap`, even two in one process) keeps a private copy of the pool: a
store reaches the pool file only through the plugin's flushes, and a load
sees what others wrote only through its invalidations. Two adapters in one
process are then two hosts; a restarted sidecar knows only what was flushed.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cxlkv_lmcache import client as cl
from cxlkv_testkit import Sidecar, make_adapter, wait_for

from cxlkv_testkit.l2 import bits, key, load, lookup, obj, store

NONCOHERENT = ("--backend", "noncoherent-test")
# Under the copy routine's streaming threshold, over it, odd sizes; a long
# cache_salt puts the record's name after the payload, in its last line.
SIZES = [4096, 100_003, 600_000, (1 << 20) + 77]
SALTS = ["", "s" * 40]


def objects():
    return [(key(i, salt=salt), obj(n, seed=i)) for i, (n, salt) in enumerate((n, s) for s in SALTS for n in SIZES)]


def loaded_bytes(a, items):
    """Lookup-and-lock (until all hit: an adapter reconnects after a
    restart), load into fresh buffers, unlock; the loaded tensors."""
    keys = [k for k, _ in items]
    assert wait_for(lambda: bits(lookup(a, keys), len(keys)) == [True] * len(keys), timeout=15)
    outs = [obj(o.get_size(), seed=999) for _, o in items]
    assert bits(load(a, keys, outs), len(keys)) == [True] * len(keys)
    a.submit_unlock(keys)
    return outs


def opened(stack, adapter):
    stack.callback(adapter.close)
    return adapter


def test_stores_reach_another_host_and_a_restarted_sidecar(tmp_path):
    s = Sidecar(tmp_path, extra=NONCOHERENT).start()
    with contextlib.ExitStack() as stack:
        stack.callback(s.kill)
        reader = opened(stack, make_adapter(s.socket))  # maps the pool now: its copy predates every store
        writer = opened(stack, make_adapter(s.socket))
        assert reader._conn.pool.software and reader._conn.pool._private
        items = objects()
        assert store(writer, [k for k, _ in items], [o for _, o in items]).is_successful()
        for (k, want), got in zip(items, loaded_bytes(reader, items)):
            assert torch.equal(got.tensor, want.tensor), f"{k.cache_salt!r}/{want.get_size()}: another host read other bytes"
        # The sidecar streams the same bytes inline: it invalidates before reading.
        inline = opened(stack, make_adapter(s.socket, mode="inline"))
        for (k, want), got in zip(items, loaded_bytes(inline, items)):
            assert torch.equal(got.tensor, want.tensor), f"{want.get_size()}: the sidecar read other bytes"
        s.kill()  # kill -9: the rebuilt registry and the bytes come from what was flushed
        s.start()
        fresh = opened(stack, make_adapter(s.socket, verify_payload=True))
        for (k, want), got in zip(items, loaded_bytes(fresh, items)):
            assert torch.equal(got.tensor, want.tensor), f"{want.get_size()}: other bytes after the restart"
        # The old reader keeps its mapping (same pool): the region's new
        # generation reaches it only through its invalidations.
        for (k, want), got in zip(items, loaded_bytes(reader, items)):
            assert torch.equal(got.tensor, want.tensor), f"{want.get_size()}: the old reader after the restart"


@pytest.mark.skipif(cl.FLUSH is None, reason="built without cache-line flushes")
def test_software_coherence_on_real_memory_round_trips(tmp_path):
    """A plain shm pool told it is not coherent: the plugin copies with the
    real write-back and eviction instructions (this host is coherent, so the
    bytes are the same either way; the instructions must not change them)."""
    s = Sidecar(tmp_path, extra=("--coherence", "software")).start()
    with contextlib.ExitStack() as stack:
        stack.callback(s.kill)
        a, b = opened(stack, make_adapter(s.socket)), opened(stack, make_adapter(s.socket))
        assert a._conn.info.coherence == "software" and not a._conn.pool._private
        items = objects()
        assert store(a, [k for k, _ in items], [o for _, o in items]).is_successful()
        for (_, want), got in zip(items, loaded_bytes(b, items)):
            assert torch.equal(got.tensor, want.tensor)


def test_without_a_flush_routine_a_noncoherent_pool_is_not_mapped(tmp_path, monkeypatch):
    """Plain copies would stay in this host's cache: the adapter uses the
    inline path instead (mode auto) or refuses to start (mode mmap)."""
    s = Sidecar(tmp_path, extra=("--coherence", "software")).start()
    monkeypatch.setattr(cl, "FLUSH", None)
    with contextlib.ExitStack() as stack:
        stack.callback(s.kill)
        a = opened(stack, make_adapter(s.socket))
        assert a._conn.inline and a._conn.pool is None
        items = objects()[:2]
        assert store(a, [k for k, _ in items], [o for _, o in items]).is_successful()
        for (_, want), got in zip(items, loaded_bytes(a, items)):
            assert torch.equal(got.tensor, want.tensor)
        with pytest.raises(RuntimeError, match="not cache-coherent"):
            make_adapter(s.socket, mode="mmap")
