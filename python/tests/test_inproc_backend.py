"""cxlkv under LMCache's in-process engine (vLLM's LMCacheConnectorV1), seen
through LMCache's own StorageManager on CPU with its LocalCPUBackend as L1
and the cxlkv backend loaded as a storage plugin (`storage_plugins:
["cxlkv"]`, settings under extra_config): chunks stored, L1 cleared, hits
with identical bytes viewed in the pool; two engine processes share chunks;
a hit through a follower node; a sidecar kill -9 and restart; a holder
killed while viewing a chunk; faults that must end in misses and skipped
puts within the deadline, never an exception."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import os
import signal
import textwrap
import threading
import time

import pytest
import torch

from cxlkv_lmcache import client as cl
from cxlkv_testkit import (Sidecar, clear_l1, engine_chunk, engine_key, engine_put, engine_storage_manager,
                           kill_holder, run_engine, same_chunk, settled_roles, sidecar_stats, wait_for)

TESTS = os.path.dirname(os.path.abspath(__file__))


def hits(sm, seeds: list[int], salt: str = "") -> list:
    """The engine's retrieve path: batched_contains decides where each chunk
    is, batched_get reads it there. Every hit is byte-checked; returns the
    objects (L1 keeps a reference to each, as LMCache's write-back does)."""
    keys = [engine_key(s, salt) for s in seeds]
    n, where = sm.batched_contains(keys)
    assert n == len(keys), f"{n}/{len(keys)} found: {where}"
    assert list(where) == ["cxlkv"], f"expected every chunk in cxlkv, got {list(where)}"
    objs = sm.batched_get(keys, location="cxlkv")
    assert all(o is not None for o in objs)
    for o, s in zip(objs, seeds):
        assert same_chunk(o, s), f"chunk {s} came back with other bytes"
    return objs


def release(objs) -> None:
    for o in objs:
        o.ref_count_down()


@contextlib.contextmanager
def viewing(sidecar, seed: int, **params):
    """An engine on `sidecar` (`params` as engine_storage_manager's) that
    stored chunk `seed`, cleared its L1 and holds a view of the chunk in
    cxlkv: yields its backend and the view. At the end of the block the view
    is given back and its key's lock must go."""
    sm = engine_storage_manager(sidecar.socket, **params)
    try:
        be = sm.storage_backends["cxlkv"]
        engine_put(sm, [seed])
        clear_l1(sm)
        obj = be.get_blocking(engine_key(seed))
        yield be, obj
        obj.ref_count_down()
        assert wait_for(lambda: sidecar_stats(sidecar.socket).locked_keys == 0)
    finally:
        sm.close()


@contextlib.contextmanager
def unlocks_late(be, seconds: float):
    """Every unlock the backend sends reaches the sidecar `seconds` late
    (a slow wire): what a put sent right after it may overtake it. On
    leaving the block the wire is fast again: the unlocks still held back
    go at once and are answered before it ends (none may outlive the
    engine's channel)."""
    stub = be._core.link.stub
    real = stub.Unlock
    fast = threading.Event()
    sending: list[threading.Thread] = []

    class Late:
        def __call__(self, *a, **k):
            return real(*a, **k)

        def future(self, req, timeout=None):
            fut = concurrent.futures.Future()

            def go():
                fast.wait(seconds)
                try:
                    fut.set_result(real(req, timeout=timeout))
                except Exception as e:
                    fut.set_exception(e)

            sending.append(threading.Thread(target=go, daemon=True))
            sending[-1].start()
            return fut

    stub.Unlock = Late()
    try:
        yield
    finally:
        stub.Unlock = real
        fast.set()
        for t in sending:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in sending), "an unlock held back did not end"


@pytest.fixture
def engine(sidecar):
    sm = engine_storage_manager(sidecar.socket)
    yield sm
    sm.close()


def test_loaded_as_lmcache_storage_plugin_with_lmcache_l1(engine):
    assert list(engine.storage_backends) == ["LocalCPUBackend", "cxlkv"]
    be = engine.storage_backends["cxlkv"]
    # LMCache's own allocator stays the engine's: cxlkv is a tier, not the L1;
    # and the backend names L1 as its allocator, so a put hands it L1's own
    # objects (no allocation in the backend, no second copy).
    l1 = engine.storage_backends["LocalCPUBackend"]
    assert type(be).__name__ == "CxlKvBackend" and be.get_allocator_backend() is l1
    assert engine.allocator_backend is l1


def test_stored_l1_cleared_hits_with_identical_bytes_viewed_in_the_pool(engine, sidecar):
    be = engine.storage_backends["cxlkv"]
    reserves = []
    real = be._core.stub.Reserve
    be._core.stub.Reserve = lambda req, **kw: (reserves.append(cl.reserve_keys(req)), real(req, **kw))[1]
    try:
        engine_put(engine, list(range(8)))
    finally:
        be._core.stub.Reserve = real
    # The StorageManager's put loop was served with one Reserve of the whole
    # batch under the chunks' own keys: each chunk copied once from L1 into
    # its reserved pages (no placeholder, no second copy), then committed.
    # (Pages leased ahead of the next put, after the commit, are not this
    # put's: leases.py.)
    reserves = [r for r in reserves if not all(k.startswith(b"\x00lease/") for k in r)]
    assert len(reserves) == 1 and len(reserves[0]) == 8
    assert all(k[:1] == b"\x02" for k in reserves[0])
    assert sidecar_stats(sidecar.socket).keys == 8
    clear_l1(engine)
    assert engine.batched_contains([engine_key(i) for i in range(8)])[1].keys() == {"cxlkv"}
    objs = hits(engine, list(range(8)))
    pool = be._core.conn.pool
    for o in objs:
        # The load path made no copy: the object's bytes are the pool's pages.
        assert pool.base <= o.data_ptr and o.data_ptr + o.get_size() <= pool.base + pool.size
        assert o.tensor.shape == engine.metadata.get_shapes()[0]
    # Each view holds the sidecar's lock while it lives: another client
    # cannot delete the chunk under it.
    assert sidecar_stats(sidecar.socket).locked_keys == 8
    assert not be.remove(engine_key(0))
    # A single get works the same way.
    one = engine.get(engine_key(3))
    assert one is not None and same_chunk(one, 3)
    release([one, *objs])
    clear_l1(engine)  # L1 let go of its references too: the last ones
    assert wait_for(lambda: sidecar_stats(sidecar.socket).locked_keys == 0)
    assert be.report_status()["live_views"] == 0
    assert be.remove(engine_key(0))


def test_load_returns_memory_inside_the_pool_mapping(engine):
    be = engine.storage_backends["cxlkv"]
    engine_put(engine, [1])
    obj = be.get_blocking(engine_key(1))
    try:
        pool = be._core.conn.pool
        assert pool.contains(obj.data_ptr) and pool.contains(obj.data_ptr + obj.get_size() - 1)
        # Writing through the view writes the pool: the same bytes, not a copy.
        before = ctypes.c_uint8.from_address(obj.data_ptr).value
        assert ctypes.string_at(obj.data_ptr, 64) == bytes(obj.byte_array[:64])
        assert ctypes.c_uint8.from_address(pool.addr(be._core.location(obj._cxlkv.enc))).value == before
    finally:
        obj.ref_count_down()


def test_allocations_are_never_pool_pages_and_a_put_of_them_stores_what_was_written(engine, sidecar):
    """Nothing the backend hands out for writing is pool memory: a writer
    cannot outlive a reservation and write into pages that became another
    key's. Its allocations are LMCache's L1 memory; a put copies them in."""
    be = engine.storage_backends["cxlkv"]
    shapes, dtypes = engine.metadata.get_shapes(), engine.metadata.get_dtypes()
    objs = be.batched_allocate(shapes, dtypes, 3)
    pool = be._core.conn.pool
    assert not any(pool.contains(o.data_ptr) for o in objs)
    assert sidecar_stats(sidecar.socket).reserved == 0, "an allocation reserves nothing"
    for i, o in enumerate(objs[:2]):
        o.tensor.copy_(engine_chunk(engine, 40 + i).tensor)
    futs = be.batched_submit_put_task([engine_key(40), engine_key(41)], objs[:2])
    for f in futs:
        f.result(timeout=10)
    release(objs)
    # Nothing reserved but the pages leased ahead of the next put (leases.py).
    assert wait_for(lambda: sidecar_stats(sidecar.socket).reserved == be._core.leases.stock_size(), timeout=5)
    clear_l1(engine)
    release(hits(engine, [40, 41]))


def test_a_put_stores_valid_tensor_chunks_and_skips_invalid_and_tensorless_ones(engine, sidecar):
    """A put takes a chunk only while it has a tensor: an object LMCache
    invalidated (freed memory) or one of bytes is skipped, never copied in;
    a valid chunk beside them is stored with its bytes."""
    from lmcache.v1.memory_management import BytesBufferMemoryObj
    be = engine.storage_backends["cxlkv"]
    shapes, dtypes = engine.metadata.get_shapes(), engine.metadata.get_dtypes()
    good, gone = be.batched_allocate(shapes, dtypes, 2)
    good.tensor.copy_(engine_chunk(engine, 50).tensor)
    gone.tensor.copy_(engine_chunk(engine, 51).tensor)
    gone.invalidate()
    raw = BytesBufferMemoryObj(bytes(engine_chunk(engine, 52).byte_array))
    futs = be.batched_submit_put_task([engine_key(s) for s in (50, 51, 52)], [good, gone, raw])
    for f in futs:
        f.result(timeout=10)
    release([good])
    clear_l1(engine)
    assert [be.contains(engine_key(s)) for s in (50, 51, 52)] == [True, False, False]
    release(hits(engine, [50]))


def test_pin_maps_to_the_sidecar_lock(engine, sidecar):
    be = engine.storage_backends["cxlkv"]
    engine_put(engine, [1, 2])
    clear_l1(engine)
    assert be.batched_contains([engine_key(1), engine_key(2), engine_key(99)], pin=True) == 2
    assert sidecar_stats(sidecar.socket).locked_keys == 2
    assert not be.remove(engine_key(1)), "a pinned chunk cannot be removed"
    be.batched_unpin([engine_key(1), engine_key(2)])
    assert not be.unpin(engine_key(1)), "nothing left to unpin"
    assert wait_for(lambda: sidecar_stats(sidecar.socket).locked_keys == 0)
    assert be.remove(engine_key(1)) and not be.contains(engine_key(1))
    assert be.contains(engine_key(2), pin=True) and be.pin(engine_key(2))
    assert sidecar_stats(sidecar.socket).locked_keys == 1
    assert be.unpin(engine_key(2)) and be.unpin(engine_key(2))


def test_a_retrieve_after_a_pinned_lookup_shares_its_locks(engine, sidecar):
    """vLLM's engine pins at lookup and retrieves later: the views share the
    pins' locks (no second lookup), and the keys stay locked until both the
    pins and the views are gone."""
    be = engine.storage_backends["cxlkv"]
    engine_put(engine, [1, 2])
    clear_l1(engine)
    keys = [engine_key(1), engine_key(2)]
    assert be.batched_contains(keys, pin=True) == 2
    lookups = []
    real = be._core.stub.LookupAndLock
    be._core.stub.LookupAndLock = lambda req, **kw: (lookups.append(len(req.keys)), real(req, **kw))[1]
    try:
        views = be.batched_get_blocking(keys)
    finally:
        be._core.stub.LookupAndLock = real
    assert lookups == [] and all(v is not None for v, s in zip(views, (1, 2)))
    assert same_chunk(views[0], 1) and same_chunk(views[1], 2)
    be.batched_unpin(keys)
    assert sidecar_stats(sidecar.socket).locked_keys == 2, "the views still hold them"
    assert not be.remove(engine_key(1))
    release(views)
    assert wait_for(lambda: sidecar_stats(sidecar.socket).locked_keys == 0)


def test_views_keep_their_lock_past_its_ttl(sidecar):
    """Renewal takes a second lock before giving the first back: a view
    held for several lock TTLs keeps its chunk from being deleted."""
    with viewing(sidecar, 5, lock_ttl_ms=900) as (be, obj):
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert sidecar_stats(sidecar.socket).locked_keys == 1, "the view's key was unlocked"
            time.sleep(0.1)
        assert not be.remove(engine_key(5))
        assert same_chunk(obj, 5)


def test_tenant_is_the_cache_salt(sidecar):
    sm = engine_storage_manager(sidecar.socket, tenant="team")
    try:
        engine_put(sm, [7], salt="alice")
        engine_put(sm, [8])
        tenants = {t.tenant: t.keys for t in sidecar_stats(sidecar.socket).tenants}
        assert tenants == {"team/alice": 1, "team": 1}
        clear_l1(sm)
        release(hits(sm, [7], salt="alice"))
        assert sm.batched_contains([engine_key(7)])[0] == 0, "another salt is another key"
    finally:
        sm.close()


def test_without_a_mapping_of_the_pool_bytes_go_through_the_sidecar(sidecar):
    """mode 'inline' (a process that cannot map the pool): stores stream
    through the sidecar and hits are copies in LMCache's L1, not views."""
    sm = engine_storage_manager(sidecar.socket, mode="inline")
    try:
        be = sm.storage_backends["cxlkv"]
        assert be.report_status()["mode"] == "inline"
        engine_put(sm, [1, 2])
        assert sidecar_stats(sidecar.socket).keys == 2
        clear_l1(sm)
        got = sm.batched_get([engine_key(1), engine_key(2)], location="cxlkv")
        assert same_chunk(got[0], 1) and same_chunk(got[1], 2)
        assert all(o.parent() is sm.storage_backends["LocalCPUBackend"].get_memory_allocator() for o in got)
        release(got)
        assert wait_for(lambda: sidecar_stats(sidecar.socket).locked_keys == 0)
    finally:
        sm.close()


def test_a_short_last_chunk_comes_back_with_its_shape(engine):
    key = engine_key(60)
    obj = engine_chunk(engine, 60, tokens=16)
    engine.batched_put([key], [obj])
    be = engine.storage_backends["cxlkv"]
    assert wait_for(lambda: not be.exists_in_put_tasks(key))
    clear_l1(engine)
    got = be.get_blocking(key)
    assert got is not None and got.tensor.shape[2] == 16 and same_chunk(got, 60)
    got.ref_count_down()


# ------------------------------------------------------ across processes

ENGINE = textwrap.dedent("""
    import os, sys, time
    import cxlkv_testkit as k
    sock, action, seeds = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    sm = k.engine_storage_manager(sock)
    if action == "store":
        k.engine_put(sm, seeds)
        print("STORED", flush=True)
    elif action == "hit":
        be = sm.storage_backends["cxlkv"]
        n, where = sm.batched_contains([k.engine_key(s) for s in seeds])
        objs = sm.batched_get([k.engine_key(s) for s in seeds], location="cxlkv") if n == len(seeds) else []
        good = sum(o is not None and k.same_chunk(o, s) for o, s in zip(objs, seeds))
        print("HITS", n, good, list(where), flush=True)
    elif action == "hold":
        be = sm.storage_backends["cxlkv"]
        objs = [be.get_blocking(k.engine_key(s)) for s in seeds]
        print("HOLDING", sum(o is not None for o in objs), flush=True)
        time.sleep(600)
    sm.close()
""").format(tests=TESTS)


engine_process = functools.partial(run_engine, ENGINE)


def test_two_engine_processes_on_one_sidecar_share_chunks(sidecar):
    assert engine_process(sidecar.socket, "store", [1, 2, 3, 4]) == ["STORED"]
    # A second engine process, with its own L1 (empty), hits all of them.
    assert engine_process(sidecar.socket, "hit", [1, 2, 3, 4]) == ["HITS 4 4 ['cxlkv']"]


def test_a_hit_through_a_follower_node(cluster):
    """Stored through follower b's sidecar, a hit through follower c's, and
    through the primary's: the chunks are in the one pool, found through the
    primary's registry."""
    b, c, a = cluster["b"].socket, cluster["c"].socket, cluster["a"].socket
    sm = engine_storage_manager(b)
    try:
        engine_put(sm, [11, 12, 13])
    finally:
        sm.close()
    for sock in (c, a):
        sm = engine_storage_manager(sock)
        try:
            release(hits(sm, [11, 12, 13]))
        finally:
            sm.close()


def test_sidecar_kill_9_and_restart_the_same_and_a_fresh_engine_hit_every_chunk(sidecar):
    sm = engine_storage_manager(sidecar.socket, poll_interval_ms=100)
    try:
        be = sm.storage_backends["cxlkv"]
        engine_put(sm, list(range(6)))
        sidecar.kill()
        assert wait_for(lambda: not be.report_status()["is_healthy"], timeout=10)
        sidecar.start()
        assert wait_for(lambda: be.report_status()["is_healthy"], timeout=15)
        clear_l1(sm)
        release(hits(sm, list(range(6))))
    finally:
        sm.close()
    assert engine_process(sidecar.socket, "hit", list(range(6))) == ["HITS 6 6 ['cxlkv']"]


def test_views_held_across_a_restart_are_locked_again(sidecar):
    with viewing(sidecar, 21, poll_interval_ms=100) as (_, obj):
        sidecar.kill()
        sidecar.start()
        # The new instance lost every lock; the backend takes the view's again.
        assert wait_for(lambda: sidecar_stats(sidecar.socket).locked_keys == 1, timeout=15)
        assert same_chunk(obj, 21) and obj.is_valid()


def test_a_holder_killed_while_viewing_a_chunk_frees_its_lock(sidecar):
    assert engine_process(sidecar.socket, "store", [31, 32]) == ["STORED"]
    kill_holder(ENGINE, sidecar.socket, "hold", [31, 32], "HOLDING 2")
    sm = engine_storage_manager(sidecar.socket)
    try:
        assert sm.storage_backends["cxlkv"].remove(engine_key(31)), "nothing holds it any more"
    finally:
        sm.close()


# ------------------------------------------------------------------ faults

DEADLINE_MS = 800
LATE_S = 1.0  # a call may return this much after its deadline on a loaded 2-core VM


def every_call(sm, seeds: list[int]) -> None:
    """Every path LMCache takes into the backend, each a miss, a skipped put
    or False, within the deadline, never an exception."""
    be = sm.storage_backends["cxlkv"]
    keys = [engine_key(s) for s in seeds]
    calls = {
        "put": lambda: sm.batched_put(keys, [engine_chunk(sm, s) for s in seeds]),
        "contains": lambda: be.contains(keys[0]),
        "contains_pin": lambda: be.contains(keys[0], pin=True),
        "batched_contains": lambda: be.batched_contains(keys, pin=True),
        "get": lambda: be.get_blocking(keys[0]),
        "batched_get": lambda: be.batched_get_blocking(keys),
        "pin": lambda: be.pin(keys[0]),
        "unpin": lambda: be.unpin(keys[0]),
        "remove": lambda: be.remove(keys[0]),
    }
    for name, call in calls.items():
        t = time.monotonic()
        got = call()
        took = time.monotonic() - t
        assert took < DEADLINE_MS / 1000 + LATE_S, f"{name} took {took:.2f} s"
        assert got in (None, False, 0) or (isinstance(got, list) and not any(got)), f"{name} answered {got!r}"
    import asyncio

    fut = asyncio.run_coroutine_threadsafe(be.batched_get_non_blocking("x", keys), sm.loop)
    assert fut.result(timeout=DEADLINE_MS / 1000 + LATE_S) == []
    fut = asyncio.run_coroutine_threadsafe(be.batched_async_contains("x", keys, True), sm.loop)
    assert fut.result(timeout=DEADLINE_MS / 1000 + LATE_S) == 0
    assert wait_for(lambda: not any(be.exists_in_put_tasks(k) for k in keys), timeout=DEADLINE_MS / 1000 + LATE_S)
    # Allocating asks nothing of the sidecar: LMCache's L1 memory, never the pool's.
    o = be.allocate(sm.metadata.get_shapes(), sm.metadata.get_dtypes())
    assert o is not None and be.get_allocator_backend() is sm.storage_backends["LocalCPUBackend"]
    o.ref_count_down()


def test_sidecar_down_misses_and_skipped_puts_never_an_exception(tmp_path):
    s = Sidecar(tmp_path).start()
    sm = engine_storage_manager(s.socket, deadline_ms=DEADLINE_MS, connect_timeout_ms=DEADLINE_MS)
    try:
        engine_put(sm, [1])
        s.kill()
        clear_l1(sm)
        every_call(sm, [1, 2])
        s.start()
        be = sm.storage_backends["cxlkv"]
        assert wait_for(lambda: be.report_status()["is_healthy"], timeout=15)
        engine_put(sm, [2])  # serving again: puts and hits work
        clear_l1(sm)
        release(hits(sm, [1, 2]))
    finally:
        sm.close()
        s.kill()


def test_an_engine_started_without_its_sidecar_serves_misses(tmp_path):
    s = Sidecar(tmp_path)
    sm = engine_storage_manager(s.socket, deadline_ms=DEADLINE_MS, connect_timeout_ms=200)
    try:
        assert "cxlkv" in sm.storage_backends
        every_call(sm, [1])
    finally:
        sm.close()


def test_a_hung_sidecar_costs_at_most_the_deadline(sidecar):
    sm = engine_storage_manager(sidecar.socket, deadline_ms=DEADLINE_MS)
    try:
        engine_put(sm, [1])
        clear_l1(sm)
        with sidecar.sigcont_on_exit():
            sidecar.signal(signal.SIGSTOP)
            every_call(sm, [1, 2])
    finally:
        sm.close()


@contextlib.contextmanager
def full_of_own_views(tmp_path):
    """A sidecar with one 2 MiB region, filled by an engine with 32 chunks of
    64 KiB that it then holds as views (nothing evictable): yields the
    StorageManager, its backend and the 32 views."""
    s = Sidecar(tmp_path, extra=("--max-regions", "1")).start()
    sm = engine_storage_manager(s.socket, deadline_ms=DEADLINE_MS, cpu_gb=0.1)
    try:
        be = sm.storage_backends["cxlkv"]
        engine_put(sm, list(range(32)))  # 32 x 64 KiB fill the region
        clear_l1(sm)
        held = be.batched_get_blocking([engine_key(i) for i in range(32)])
        assert all(o is not None for o in held), "a stored chunk missed"
        yield sm, be, held
    finally:
        sm.close()
        s.kill()


def test_a_full_pool_skips_puts(tmp_path):
    """One 2 MiB region for 64 KiB chunks whose keys are all locked: once
    nothing can be evicted, further puts are skipped (the StorageManager
    loop stops at the first chunk with no pages), never an exception. The
    engine then releases its views and stores at once, its unlocks reaching
    the sidecar 300 ms after its Reserve: the store waits for its own
    unlocks and takes the room they free."""
    with full_of_own_views(tmp_path) as (sm, be, held):
        engine_put(sm, [100, 101])
        assert sm.batched_contains([engine_key(100)])[1].get("cxlkv") is None
        with unlocks_late(be, 0.3):
            release(held)
            clear_l1(sm)
            engine_put(sm, [100])  # room again (evictable): stored
        clear_l1(sm)
        release(hits(sm, [100]))


def test_an_own_unlock_that_never_lands_holds_no_put_past_its_deadline(tmp_path):
    """The pool full of chunks this engine views; it releases them, but
    their unlocks stay on the wire (a stuck connection): a put that finds
    no room waits for them only within its deadline, then is skipped."""
    with full_of_own_views(tmp_path) as (sm, be, held):
        with unlocks_late(be, 30):
            release(held)
            clear_l1(sm)
            assert be._core.unlocks.in_flight() > 0
            t = time.monotonic()
            engine_put(sm, [100])
            took = time.monotonic() - t
        assert took < DEADLINE_MS / 1000 + LATE_S, f"the put took {took:.2f} s"
        assert sm.batched_contains([engine_key(100)])[1].get("cxlkv") is None


def test_cuda_registration_of_the_pool_mapping(sidecar, monkeypatch):
    """Where CUDA is present the whole mapping is registered (one DMA from
    the pool to the GPU per load) and unregistered at close; here, with no
    GPU, the CUDA runtime is stood in for when the mapping appears and only
    the calls are checked."""
    calls = []

    class Runtime:
        def cudaHostRegister(self, addr, size, flags):
            calls.append(("register", addr, size))
            return 0

        def cudaHostUnregister(self, addr):
            calls.append(("unregister", addr))
            return 0

    sm = engine_storage_manager(sidecar.socket)
    try:
        be = sm.storage_backends["cxlkv"]
        pool = be._core.conn.pool
        assert not be.report_status()["cuda_registered"]
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)
            m.setattr(torch.cuda, "cudart", lambda: Runtime())
            be._mapped(None, pool)  # what the link calls when it maps a pool
            assert calls == [("register", pool.base, pool.size)] and be.report_status()["cuda_registered"]
            sm.close()
        assert calls[-1] == ("unregister", pool.base)
    finally:
        sm.close()


def test_no_gpu_here_the_mapping_is_not_registered(engine):
    assert not torch.cuda.is_available()
    assert engine.storage_backends["cxlkv"].report_status()["cuda_registered"] is False



def test_a_primary_failover_is_misses_within_the_deadline_then_hits_again(elected_cluster):
    """Three nodes elected through etcd; an engine on a follower. The
    primary is killed (-9): while a new one is elected, every call the
    engine makes is a miss or a skipped put within the deadline, never an
    exception; within the election lease + 2 s (plus a margin for this VM)
    every chunk stored before is a hit again with its bytes."""
    from cxlkv_testkit import ELECTION_LEASE_S

    nodes = elected_cluster
    seen = settled_roles(nodes)
    primary = next(n for n, r in seen.items() if r[0] == "primary")
    follower = next(n for n in nodes if n != primary)
    sm = engine_storage_manager(nodes[follower].socket, deadline_ms=DEADLINE_MS, poll_interval_ms=100)
    try:
        engine_put(sm, [1, 2, 3])
        clear_l1(sm)
        release(hits(sm, [1, 2, 3]))
        clear_l1(sm)
        nodes[primary].kill()
        killed = time.monotonic()
        be = sm.storage_backends["cxlkv"]
        back, seed = None, 10
        while time.monotonic() - killed < ELECTION_LEASE_S + 2 + 5:
            t = time.monotonic()
            views = be.batched_get_blocking([engine_key(s) for s in (1, 2, 3)])
            engine_chunk_put = sm.batched_put([engine_key(seed)], [engine_chunk(sm, seed)])
            assert engine_chunk_put is None and time.monotonic() - t < 2 * (DEADLINE_MS / 1000 + LATE_S)
            good = [v is not None and same_chunk(v, s) for v, s in zip(views, (1, 2, 3))]
            assert not any(v is not None and not g for v, g in zip(views, good)), "wrong bytes"
            release([v for v in views if v is not None])
            stored = be.contains(engine_key(seed))
            seed += 1
            if all(good) and stored:  # hits, and a put went through the new primary
                back = time.monotonic() - killed
                break
            time.sleep(0.1)
        assert back is not None, "hits and stores never came back after the failover"
        clear_l1(sm)
        release(hits(sm, [1, 2, 3, seed - 1]))
    finally:
        sm.close()


def test_software_coherence_two_engines_are_two_hosts(tmp_path):
    """On the sidecar's noncoherent-test backend each pool mapping is a
    private copy (a host's cache): an engine's stores reach another engine
    only through the backend's write-backs before Commit, and a view shows
    them only through its invalidation before it is handed out. The reader
    maps the pool first, so its copy predates every store; both put paths
    are checked (LMCache's put loop, and objects allocated from the backend
    and submitted)."""
    s = Sidecar(tmp_path, extra=("--backend", "noncoherent-test")).start()
    reader = engine_storage_manager(s.socket)
    writer = engine_storage_manager(s.socket)
    try:
        rbe, wbe = reader.storage_backends["cxlkv"], writer.storage_backends["cxlkv"]
        assert rbe._core.conn.pool.software and rbe._core.conn.pool._private
        engine_put(writer, [1, 2])
        objs = wbe.batched_allocate(writer.metadata.get_shapes(), writer.metadata.get_dtypes(), 1)
        objs[0].tensor.copy_(engine_chunk(writer, 3).tensor)
        for f in wbe.batched_submit_put_task([engine_key(3)], objs):
            f.result(timeout=10)
        release(objs)
        release(hits(reader, [1, 2, 3]))
    finally:
        writer.close()
        reader.close()
        s.kill()
