"""Leases (leases.py) and pipelined commits (mapped.py): a store's Reserve
taken ahead of need and its keys bound at commit; a large batch's first
half committed while its second half copies. Against a real sidecar."""

from __future__ import annotations

import threading

import torch

from cxlkv_lmcache import copies, keys as keycodec, leases as leases_mod, mapped
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_testkit import make_adapter, sidecar_stats, wait_for
from cxlkv_testkit.l2 import bits, key, load, lookup, obj, store

CHUNK = 64 << 10


def reserves(core) -> list[int]:
    """Count the store path's Reserve calls (one entry per call: its items)."""
    calls: list[int] = []
    real = core.rides.reserve

    def counted(task, tenant, items, rides):
        calls.append(len(items))
        return real(task, tenant, items, rides)

    core.rides.reserve = counted
    return calls


def stocked(core, n: int) -> bool:
    return wait_for(lambda: core.leases.stock_size() == n, timeout=5)


def same(reader, keys, objs) -> bool:
    outs = [obj(o.get_size(), seed=999) for o in objs]
    found = bits(load(reader, keys, outs), len(keys))
    return all(found) and all(torch.equal(a.tensor, b.tensor) for a, b in zip(outs, objs))


def test_the_next_store_copies_into_leases_and_binds_its_keys_at_commit(sidecar):
    a, reader = make_adapter(sidecar.socket), make_adapter(sidecar.socket)
    try:
        calls = reserves(a._core)
        first = [key(i) for i in range(4)]
        assert store(a, first, [obj(CHUNK, seed=i) for i in range(4)]).is_successful()
        assert calls == [4], "the first store reserves: no lease yet"
        assert stocked(a._core, 4), "four chunks stored: four leased for the next store"
        assert sidecar_stats(sidecar.socket).reserved == 4
        second, objs = [key(10 + i) for i in range(4)], [obj(CHUNK, seed=10 + i) for i in range(4)]
        assert store(a, second, objs).is_successful()
        assert calls == [4], "the second store sent no Reserve"
        assert a._core.leases.bound == 4
        assert same(reader, second, objs) and same(reader, first, [obj(CHUNK, seed=i) for i in range(4)])
        # The lease names are nobody's keys: only the eight chunks are stored.
        assert sidecar_stats(sidecar.socket).keys == 8
    finally:
        a.close()
        reader.close()
    # Closing gives the stock back at once (not after reservation_timeout_ms).
    assert sidecar_stats(sidecar.socket).reserved == 0


def test_leases_hold_no_more_than_their_byte_limit(sidecar):
    a = make_adapter(sidecar.socket, lease_ahead_bytes=3 * CHUNK)
    try:
        assert store(a, [key(i) for i in range(8)], [obj(CHUNK, seed=i) for i in range(8)]).is_successful()
        assert stocked(a._core, 3)
        assert sidecar_stats(sidecar.socket).reserved == 3
        calls = reserves(a._core)
        assert store(a, [key(20 + i) for i in range(8)], [obj(CHUNK, seed=i) for i in range(8)]).is_successful()
        assert calls == [5] and a._core.leases.bound == 3, "three from leases, five reserved"
    finally:
        a.close()


def test_no_leases_where_the_sidecar_does_not_bind_or_when_turned_off(sidecar):
    info = pb.PoolInfoReply(commit_as_name_bytes=0, capacity_bytes=1 << 30)
    assert leases_mod.limit(64 << 20, info) == 0, "a cluster's node binds nothing: no leases"
    info.commit_as_name_bytes = 76
    info.max_client_pinned_bytes = 64 << 20
    assert leases_mod.limit(64 << 20, info) == 16 << 20, "a quarter of the pin budget"
    a = make_adapter(sidecar.socket, lease_ahead_bytes=0)
    try:
        calls = reserves(a._core)
        for r in range(2):
            assert store(a, [key(r * 10 + i) for i in range(4)], [obj(CHUNK) for _ in range(4)]).is_successful()
        assert calls == [4, 4] and sidecar_stats(sidecar.socket).reserved == 0
    finally:
        a.close()


def test_chunks_with_token_ids_reserve_as_before(sidecar):
    """The event plane takes a chunk's token ids with its Reserve: such a
    chunk is never stored through a lease (its event keeps its tokens)."""
    a = make_adapter(sidecar.socket)
    try:
        core = a._core
        assert store(a, [key(i) for i in range(4)], [obj(CHUNK) for _ in range(4)]).is_successful()
        assert stocked(core, 4)
        calls = reserves(core)
        keys = [key(10 + i) for i in range(4)]
        from cxlkv_lmcache import keys as keycodec
        core.add_token_fields([keycodec.encode(k) for k in keys[:2]], [{"token_ids": [1, 2, 3]}] * 2)
        assert store(a, keys, [obj(CHUNK) for _ in range(4)]).is_successful()
        assert calls == [2] and core.leases.bound == 2
    finally:
        a.close()


def test_a_bound_key_already_stored_is_a_stored_chunk_and_its_lease_is_given_back(sidecar):
    a, other = make_adapter(sidecar.socket), make_adapter(sidecar.socket, lease_ahead_bytes=0)
    try:
        assert store(a, [key(i) for i in range(4)], [obj(CHUNK) for _ in range(4)]).is_successful()
        assert stocked(a._core, 4)
        theirs = obj(CHUNK, seed=77)
        assert store(other, [key(50)], [theirs]).is_successful()
        r = store(a, [key(50), key(51)], [obj(CHUNK, seed=1), obj(CHUNK, seed=2)])
        assert r.is_successful(), "stored by someone is done, as a Reserve's ALREADY_EXISTS is"
        assert a._core.leases.bound == 1
        assert same(other, [key(50)], [theirs]), "the stored key kept its own bytes"
        # Two leases taken, the one refused given back: what is still
        # reserved is the stock, and nothing else.
        assert stocked(a._core, 2)
        assert wait_for(lambda: sidecar_stats(sidecar.socket).reserved == 2, timeout=5)
    finally:
        a.close()
        other.close()


def test_a_restart_voids_the_leases_and_no_copy_lands_in_another_keys_pages(sidecar):
    a = make_adapter(sidecar.socket)
    try:
        assert store(a, [key(i) for i in range(4)], [obj(CHUNK, seed=i) for i in range(4)]).is_successful()
        assert stocked(a._core, 4)
        sidecar.kill()
        sidecar.start()
        # Another client fills the pool at once; then the engine stores,
        # before or after it noticed the restart.
        other = make_adapter(sidecar.socket, lease_ahead_bytes=0)
        theirs = [obj(CHUNK, seed=100 + i) for i in range(64)]
        store(other, [key(100 + i) for i in range(64)], theirs)
        mine = [obj(CHUNK, seed=200 + i) for i in range(4)]
        for _ in range(2):
            store(a, [key(200 + i) for i in range(4)], mine)
        kept = [i for i, f in enumerate(bits(lookup(other, [key(100 + i) for i in range(64)]), 64)) if f]
        assert kept, "the other client stored something"
        assert same(other, [key(100 + i) for i in kept], [theirs[i] for i in kept]), "another key's bytes changed"
        found = [i for i, f in enumerate(bits(lookup(other, [key(200 + i) for i in range(4)]), 4)) if f]
        assert same(other, [key(200 + i) for i in found], [mine[i] for i in found])
        # Stores go on after the restart.
        assert wait_for(lambda: store(a, [key(300)], [obj(CHUNK, seed=300)]).is_successful(), timeout=10)
        other.close()
    finally:
        a.close()


def test_a_large_batch_commits_its_first_half_while_the_second_copies(sidecar, monkeypatch):
    monkeypatch.setattr(mapped, "PIPELINE_MIN_BYTES", 4 * CHUNK)
    a = make_adapter(sidecar.socket, lease_ahead_bytes=0)
    reader = make_adapter(sidecar.socket)
    keys, objs = [key(i) for i in range(8)], [obj(CHUNK, seed=i) for i in range(8)]
    seen: list[list[bool]] = []
    copied = 0
    lock = threading.Lock()

    def hook(event: str, n: int) -> None:
        nonlocal copied
        if event != "copy":
            return
        with lock:
            copied += n
            second_half = copied > 4 * CHUNK and not seen
            if second_half:
                seen.append([])
        if second_half:  # the first half's commit was sent: it lands while this copy waits
            wait_for(lambda: all(bits(lookup(reader, keys[:4]), 4)), timeout=5)
            seen[0] = bits(lookup(reader, keys), 8)

    monkeypatch.setattr(copies, "HOOK", hook)
    try:
        assert store(a, keys, objs).is_successful()
        assert seen and seen[0] == [True] * 4 + [False] * 4, seen
        assert same(reader, keys, objs)
    finally:
        a.close()
        reader.close()


def test_leased_chunks_are_committed_as_their_copy_ends_not_when_the_store_finishes(sidecar):
    # The in-process backend returns to LMCache after the copy and finishes
    # the store on another thread: a commit that binds leases leaves with
    # the copy, not after that thread's wake-up.
    a, reader = make_adapter(sidecar.socket), make_adapter(sidecar.socket)
    try:
        assert store(a, [key(i) for i in range(4)], [obj(CHUNK, seed=i) for i in range(4)]).is_successful()
        assert stocked(a._core, 4)
        core = a._core
        keys, objs = [key(10 + i) for i in range(4)], [obj(CHUNK, seed=10 + i) for i in range(4)]
        items = [(k, e, o.data_ptr, o.get_size()) for k, e, o in zip(keys, keycodec.encode_many(keys), objs)]
        finish = core.store_begin(core.task("store", 4), [("", items)])
        assert wait_for(lambda: all(bits(lookup(reader, keys), 4)), timeout=5), "committed before finish()"
        reader.submit_unlock(keys)
        ok, written, new = finish()
        assert ok and written == 4 * CHUNK and len(new) == 4 and core.leases.bound == 4
        assert same(reader, keys, objs)
    finally:
        a.close()
        reader.close()


def test_leases_past_their_time_are_never_copied_into(tmp_path):
    """An engine idle past the reservation timeout: its leases lapsed and
    their pages went to another client's chunks. Its next store reserves
    afresh; the other client's bytes stay its own."""
    from cxlkv_testkit import Sidecar
    sc = Sidecar(tmp_path, pool_size="4MiB",
                 extra=("--reservation-timeout-ms", "600", "--max-client-pinned-bytes", "4MiB")).start()
    a = make_adapter(sc.socket)
    other = make_adapter(sc.socket, lease_ahead_bytes=0)
    try:
        assert store(a, [key(i) for i in range(4)], [obj(CHUNK, seed=i) for i in range(4)]).is_successful()
        assert stocked(a._core, 4)
        assert wait_for(lambda: sidecar_stats(sc.socket).reserved == 0, timeout=5), "the leases lapsed"
        # The other client takes every free page, the lapsed leases' too.
        theirs = [obj(CHUNK, seed=100 + i) for i in range(60)]
        assert store(other, [key(100 + i) for i in range(60)], theirs).is_successful()
        assert sidecar_stats(sc.socket).pages_free == 0
        calls = reserves(a._core)
        mine = [obj(CHUNK, seed=200 + i) for i in range(4)]
        assert store(a, [key(200 + i) for i in range(4)], mine).is_successful()
        assert calls == [4] and a._core.leases.bound == 0, "lapsed leases are not used"
        found = [i for i, f in enumerate(bits(lookup(other, [key(100 + i) for i in range(60)]), 60)) if f]
        assert same(other, [key(100 + i) for i in found], [theirs[i] for i in found])
        assert same(other, [key(200 + i) for i in range(4)], mine)
    finally:
        a.close()
        other.close()
        sc.kill()


def test_a_lease_void_at_its_bind_is_stored_again_through_a_reserve(sidecar, monkeypatch):
    """Leases that stop being this session's between the take and the bind
    (here aborted while the copy runs, as a restart under the copy or a
    reconnect of a connection's session would): the store is not lost, its
    chunks go through a Reserve once more."""
    a, reader = make_adapter(sidecar.socket), make_adapter(sidecar.socket, lease_ahead_bytes=0)
    try:
        core = a._core
        assert store(a, [key(i) for i in range(4)], [obj(CHUNK, seed=i) for i in range(4)]).is_successful()
        assert stocked(core, 4)
        ids = [lease.reservation_id for s in core.leases._stock.values() for lease in s]
        aborted = []

        def hook(event: str, n: int) -> None:
            if event == "copy" and not aborted:
                aborted.append(core.stub.Abort(pb.AbortRequest(reservation_ids=ids), timeout=5))

        monkeypatch.setattr(copies, "HOOK", hook)
        calls = reserves(core)
        keys, objs = [key(10 + i) for i in range(4)], [obj(CHUNK, seed=10 + i) for i in range(4)]
        assert store(a, keys, objs).is_successful()
        monkeypatch.setattr(copies, "HOOK", None)
        assert aborted and calls == [4] and core.leases.bound == 0, "the void binds went through a Reserve"
        assert same(reader, keys, objs)
    finally:
        a.close()
        reader.close()
