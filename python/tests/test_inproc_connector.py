"""cxlkv as a remote connector of LMCache's in-process engine (seed 001's
RemoteConnector family), loaded by LMCache as `remote_storage_plugins:
["cxlkv"]` and wrapped in its own RemoteBackend, and through the older
`external://` URL: chunks stored, L1 cleared, hits with identical bytes
copied once from the pool into L1; two engine processes; a hit through a
follower; kill -9 and restart; a holder killed mid-read frees its lock;
faults as misses within the deadline."""

from __future__ import annotations

import asyncio
import functools
import signal
import textwrap
import time

import pytest

from cxlkv_testkit import (Sidecar, clear_l1, engine_chunk, engine_config, engine_extra, engine_key,
                           engine_metadata, engine_storage_manager, kill_holder, run_engine, same_chunk, sidecar_stats, wait_for)
from test_inproc_backend import TESTS

RB = "RemoteBackend-cxlkv"


def conn_of(sm):
    """The CxlKvConnector inside LMCache's RemoteBackend (and its
    InstrumentedRemoteConnector wrapper)."""
    c = sm.storage_backends[RB].connection
    return getattr(c, "connector", None) or getattr(c, "_connector", None) or c


def run(sm, coro, timeout: float = 10.0):
    return asyncio.run_coroutine_threadsafe(coro, sm.loop).result(timeout=timeout)


def put(sm, seeds: list[int]) -> None:
    keys = [engine_key(s) for s in seeds]
    sm.batched_put(keys, [engine_chunk(sm, s) for s in seeds])
    settled(sm, keys)


def settled(sm, keys) -> None:
    """LMCache's RemoteBackend does not track batched puts: wait for the
    connector's own count, then check the chunks are there."""
    c = conn_of(sm)
    assert wait_for(lambda: c.puts_in_flight() == 0 and c.batched_contains(keys) == len(keys), timeout=10)


def hits(sm, seeds: list[int]) -> None:
    keys = [engine_key(s) for s in seeds]
    n, where = sm.batched_contains(keys)
    assert n == len(keys) and list(where) == [RB], where
    objs = sm.batched_get(keys, location=RB)
    assert all(o is not None and same_chunk(o, s) for o, s in zip(objs, seeds))
    lcb = sm.storage_backends["LocalCPUBackend"]
    # One copy: the hit landed in a buffer of LMCache's L1 allocator, not a view of the pool.
    pool = conn_of(sm)._core.conn.pool
    assert all(not pool.contains(o.data_ptr) for o in objs)
    assert all(o.parent() is lcb.get_memory_allocator() for o in objs)


@pytest.fixture
def engine(sidecar):
    sm = engine_storage_manager(sidecar.socket, backend=False, connector=True)
    yield sm
    sm.close()


def test_loaded_as_a_remote_storage_plugin(engine):
    assert list(engine.storage_backends) == ["LocalCPUBackend", RB]
    assert type(conn_of(engine)).__name__ == "CxlKvConnector"


def test_stored_l1_cleared_hits_with_identical_bytes(engine, sidecar):
    put(engine, list(range(6)))
    assert sidecar_stats(sidecar.socket).keys == 6
    clear_l1(engine)
    hits(engine, list(range(6)))
    # Every lock the reads took is given back.
    assert wait_for(lambda: sidecar_stats(sidecar.socket).locked_keys == 0)


def test_every_connector_call(engine, sidecar):
    c = conn_of(engine)
    keys = [engine_key(s) for s in range(3)]
    objs = [engine_chunk(engine, s) for s in range(3)]
    run(engine, c.put(keys[0], objs[0]))
    run(engine, c.batched_put(keys[1:], objs[1:]))
    assert run(engine, c.exists(keys[0])) and c.exists_sync(keys[2]) and not c.exists_sync(engine_key(99))
    assert c.batched_contains([*keys, engine_key(99)]) == 3
    assert run(engine, c.batched_async_contains("l", [keys[0], engine_key(99), keys[1]])) == 1
    got = run(engine, c.get(keys[1]))
    assert got is not None and same_chunk(got, 1)
    got.ref_count_down()
    many = run(engine, c.batched_get([keys[0], engine_key(99), keys[2]]))
    assert many[1] is None and same_chunk(many[0], 0) and same_chunk(many[2], 2)
    prefix = run(engine, c.batched_get_non_blocking("l", [keys[0], engine_key(99), keys[2]]))
    assert len(prefix) == 1 and same_chunk(prefix[0], 0)
    for o in [*prefix, many[0], many[2]]:
        o.ref_count_down()
    assert sorted(run(engine, c.list())) == sorted(k.to_string() for k in keys)
    assert c.support_ping() and run(engine, c.ping()) == 0
    assert c.remove_sync(keys[0]) and not c.remove_sync(keys[0])
    assert sidecar_stats(sidecar.socket).keys == 2 and sidecar_stats(sidecar.socket).locked_keys == 0


def test_a_short_last_chunk(engine):
    key = engine_key(70)
    engine.batched_put([key], [engine_chunk(engine, 70, tokens=16)])
    settled(engine, [key])
    clear_l1(engine)
    got = engine.batched_get([key], location=RB)[0]
    assert got is not None and got.tensor.shape[2] == 16 and same_chunk(got, 70)


def test_the_external_url_loads_it_too(sidecar):
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    cfg = engine_config(engine_extra(sidecar.socket, backend=False), backend=False,
                        remote_url="external://localhost:0/cxlkv_lmcache.connector/?connector_name=CxlKvConnector")
    sm = StorageManager(cfg, engine_metadata(), EventManager())
    try:
        assert "RemoteBackend" in sm.storage_backends
        keys = [engine_key(s) for s in (1, 2)]
        sm.batched_put(keys, [engine_chunk(sm, s) for s in (1, 2)])
        assert wait_for(lambda: sidecar_stats(sidecar.socket).keys == 2)
        clear_l1(sm)
        objs = sm.batched_get(keys, location="RemoteBackend")
        assert all(o is not None and same_chunk(o, s) for o, s in zip(objs, (1, 2)))
    finally:
        sm.close()


ENGINE = textwrap.dedent("""
    import sys, time
    import cxlkv_testkit as k
    sock, action, seeds = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    sm = k.engine_storage_manager(sock, backend=False, connector=True)
    keys = [k.engine_key(s) for s in seeds]
    if action == "store":
        sm.batched_put(keys, [k.engine_chunk(sm, s) for s in seeds])
        c = sm.storage_backends["RemoteBackend-cxlkv"].connection._connector
        assert k.wait_for(lambda: c.puts_in_flight() == 0 and c.batched_contains(keys) == len(keys), timeout=10)
        print("STORED", flush=True)
    elif action == "hit":
        n, where = sm.batched_contains(keys)
        objs = sm.batched_get(keys, location="RemoteBackend-cxlkv") if n == len(keys) else []
        print("HITS", n, sum(o is not None and k.same_chunk(o, s) for o, s in zip(objs, seeds)), flush=True)
    elif action == "stall":
        # A read that stalls in its copy, holding the keys' locks.
        from cxlkv_lmcache import client as cl
        real = cl.copy
        def stalled(d, s, n):
            print("COPYING", flush=True)
            time.sleep(600)
        cl.copy = stalled
        sm.batched_get(keys, location="RemoteBackend-cxlkv")
    sm.close()
""").format(tests=TESTS)


engine_process = functools.partial(run_engine, ENGINE)


def test_two_engine_processes_share_chunks(sidecar):
    assert engine_process(sidecar.socket, "store", [1, 2, 3]) == ["STORED"]
    assert engine_process(sidecar.socket, "hit", [1, 2, 3]) == ["HITS 3 3"]


def test_a_hit_through_a_follower_node(cluster):
    assert engine_process(cluster["b"].socket, "store", [5, 6]) == ["STORED"]
    assert engine_process(cluster["c"].socket, "hit", [5, 6]) == ["HITS 2 2"]
    assert engine_process(cluster["a"].socket, "hit", [5, 6]) == ["HITS 2 2"]


def test_kill_9_and_restart_the_same_and_a_fresh_engine_hit_every_chunk(sidecar):
    sm = engine_storage_manager(sidecar.socket, backend=False, connector=True, poll_interval_ms=100)
    try:
        put(sm, list(range(5)))
        sidecar.kill()
        c = conn_of(sm)
        assert wait_for(lambda: not c._core.healthy(), timeout=10)
        sidecar.start()
        assert wait_for(lambda: c._core.healthy(), timeout=15)
        clear_l1(sm)
        hits(sm, list(range(5)))
    finally:
        sm.close()
    assert engine_process(sidecar.socket, "hit", list(range(5))) == ["HITS 5 5"]


def test_a_holder_killed_mid_read_frees_its_lock(sidecar):
    assert engine_process(sidecar.socket, "store", [8, 9]) == ["STORED"]
    kill_holder(ENGINE, sidecar.socket, "stall", [8, 9], "COPYING")


DEADLINE_MS = 800
LATE_S = 1.0


def test_faults_are_misses_within_the_deadline(tmp_path):
    s = Sidecar(tmp_path).start()
    sm = engine_storage_manager(s.socket, backend=False, connector=True, deadline_ms=DEADLINE_MS)
    try:
        put(sm, [1])
        c = conn_of(sm)
        keys = [engine_key(1), engine_key(2)]
        for fault in ("stop", "kill"):
            if fault == "stop":
                s.signal(signal.SIGSTOP)
            else:
                s.signal(signal.SIGCONT)
                s.kill()
            calls = {
                "exists_sync": lambda: c.exists_sync(keys[0]),
                "batched_contains": lambda: c.batched_contains(keys),
                "get": lambda: run(sm, c.get(keys[0])),
                "batched_get": lambda: run(sm, c.batched_get(keys)),
                "batched_get_non_blocking": lambda: run(sm, c.batched_get_non_blocking("l", keys)),
                "put": lambda: run(sm, c.put(keys[1], engine_chunk(sm, 2))),
                # Not the stored key: a delete the client gave up on may
                # still run when the stopped sidecar resumes (SIGCONT before
                # the kill), and the check below is that key 1 survived.
                "remove": lambda: c.remove_sync(keys[1]),
                "ping": lambda: run(sm, c.ping()),
            }
            for name, call in calls.items():
                t = time.monotonic()
                got = call()
                took = time.monotonic() - t
                assert took < DEADLINE_MS / 1000 + LATE_S, f"{fault}: {name} took {took:.2f} s"
                assert got in (None, False, 0, 1, []) or got == [None, None], f"{fault}: {name} answered {got!r}"
        s.start()
        assert wait_for(lambda: c._core.healthy(), timeout=15)
        clear_l1(sm)
        hits(sm, [1])
    finally:
        s.signal(signal.SIGCONT) if s.proc and s.proc.poll() is None else None
        sm.close()
        s.kill()
