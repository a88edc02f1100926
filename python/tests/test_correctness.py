"""The plugin never hands LMCache bytes it cannot vouch for: a copy that
outlived its lock, a payload that does not match its writer's checksum, a
reservation whose time is up, a pool layout it does not know."""

from __future__ import annotations

import ctypes
import os
import subprocess
import time

import grpc
import pytest
import torch

from cxlkv_lmcache import client as cl
from cxlkv_lmcache import keys as keycodec
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_testkit import Sidecar, make_adapter
from cxlkv_testkit.l2 import bits, key, load, lookup, obj, store

OBJ = 256 << 10


@pytest.fixture
def one_region(tmp_path):
    """A sidecar that may own one 2 MiB region: eight objects fill it."""
    s = Sidecar(tmp_path, extra=("--max-regions", "1")).start()
    yield s
    s.kill()


def raw_pool(socket: str):
    ch = cl.channel(socket)
    info = cl.stub(ch).PoolInfo(pb.PoolInfoRequest(), timeout=5)
    return ch, cl.PoolMap(info)


def test_a_copy_that_outlives_its_lock_is_a_miss(one_region, monkeypatch):
    # No pages leased ahead (leases.py): the writer must be able to fill the
    # whole region.
    reader = make_adapter(one_region.socket, lock_ttl_ms=300, lease_ahead_bytes=0)
    writer = make_adapter(one_region.socket, lease_ahead_bytes=0)
    try:
        want = obj(OBJ, seed=1)
        assert store(reader, [key(0)], [want]).is_successful()
        assert bits(lookup(reader, [key(0)]), 1) == [True]
        loc = reader._held[keycodec.encode(key(0))].loc
        real_copy = cl.copy
        stalled = []

        def stalled_copy(dst, src, n):
            if not stalled:  # the reader's load: it stalls past its lock...
                stalled.append(None)
                time.sleep(0.7)
                # ...while another client fills the region (eight objects fill
                # it), so the object is evicted and its pages reused.
                fill = [obj(OBJ, seed=100 + i) for i in range(8)]
                stalled[0] = store(writer, [key(100 + i) for i in range(8)], fill).is_successful()
            real_copy(dst, src, n)

        monkeypatch.setattr(cl, "copy", stalled_copy)
        out = obj(OBJ, seed=9)
        got = bits(load(reader, [key(0)], [out]), 1)
        monkeypatch.setattr(cl, "copy", real_copy)
        assert stalled == [True], "the load did not copy, or the region could not be refilled"
        # The bytes it copied belong to another object now...
        assert not torch.equal(out.tensor, want.tensor)
        _, pool = raw_pool(one_region.socket)
        assert not pool.still_there(loc)
        # ...and the load says miss instead of handing them to LMCache.
        assert got == [False]
    finally:
        reader.close()
        writer.close()


def test_verify_payload_turns_damaged_bytes_into_a_miss(sidecar):
    a = make_adapter(sidecar.socket, verify_payload=True)
    try:
        objs = [obj(OBJ, seed=i) for i in range(3)]
        keys = [key(i) for i in range(3)]
        assert store(a, keys, objs).is_successful()
        assert bits(lookup(a, keys), 3) == [True] * 3
        locs = [a._held[e].loc for e in keycodec.encode_many(keys)]
        _, pool = raw_pool(sidecar.socket)
        assert all(pool.crc(l) is not None for l in locs), "the commit carried no checksums"
        # One object's bytes are damaged in the pool (a stray writer, a bad DIMM).
        ctypes.memset(pool.addr(locs[1]) + 100, 0xAB, 8)
        outs = [obj(OBJ, seed=50 + i) for i in range(3)]
        assert bits(load(a, keys, outs), 3) == [True, False, True]
        assert torch.equal(outs[0].tensor, objs[0].tensor) and torch.equal(outs[2].tensor, objs[2].tensor)
    finally:
        a.close()


def test_a_reservation_whose_time_is_up_is_never_written(tmp_path, monkeypatch):
    s = Sidecar(tmp_path, extra=("--reservation-timeout-ms", "400")).start()
    a = make_adapter(s.socket)
    try:
        real_reserve = a._stub.Reserve

        def slow_reserve(req, **kw):
            rep = real_reserve(req, **kw)
            time.sleep(0.45)  # e.g. the process was descheduled right after the reply
            return rep

        monkeypatch.setattr(a._stub, "Reserve", slow_reserve)
        copies = []
        real_copy = cl.copy
        monkeypatch.setattr(cl, "copy", lambda d, s_, n: (copies.append(n), real_copy(d, s_, n)))
        r = store(a, [key(1)], [obj(OBJ, seed=1)])
        assert not r.is_successful()
        assert copies == [], "the adapter wrote into pages it no longer owned"
    finally:
        a.close()
        s.kill()


def test_an_unknown_pool_layout_is_refused(sidecar):
    ch = cl.channel(sidecar.socket)
    info = cl.stub(ch).PoolInfo(pb.PoolInfoRequest(), timeout=5)
    info.layout_version = 99
    with pytest.raises(RuntimeError, match="layout version 99 is not supported"):
        cl.PoolMap(info)
    ch.close()


def test_an_adapter_does_not_start_on_an_unknown_pool_layout(sidecar, monkeypatch):
    real_stub = cl.stub

    def stub(ch):  # a sidecar that reports another layout version
        s = real_stub(ch)
        pool_info = s.PoolInfo

        def other_layout(req, **kw):
            info = pool_info(req, **kw)
            info.layout_version = 99
            return info

        s.PoolInfo = other_layout
        return s

    monkeypatch.setattr(cl, "stub", stub)
    with pytest.raises(RuntimeError, match="layout version 99 is not supported"):
        make_adapter(sidecar.socket)


def test_pool_info_without_the_table_geometry_is_refused(sidecar):
    """Every offset and size the plugin reads comes from PoolInfo: one that
    does not give the region table's (an older sidecar) is not guessed at."""
    ch = cl.channel(sidecar.socket)
    info = cl.stub(ch).PoolInfo(pb.PoolInfoRequest(), timeout=5)
    assert info.region_table_offset > 0 and info.region_entry_bytes > 0
    info.region_entry_bytes = 0
    with pytest.raises(RuntimeError, match="region and page tables"):
        cl.PoolMap(info)
    ch.close()


def test_a_foreign_commit_is_refused(sidecar):
    a = make_adapter(sidecar.socket)
    try:
        # Another client: grpc-core shares one connection among channels with
        # equal settings in a process, so this one differs in one.
        ch = grpc.insecure_channel(f"unix:{sidecar.socket}", options=[
            ("grpc.default_authority", "localhost"), ("grpc.primary_user_agent", "another-client")])
        other = cl.stub(ch)
        rep = a._stub.Reserve(pb.ReserveRequest(items=[pb.ReserveItem(key=b"k", size=10)]), timeout=5)
        rid = rep.reservations[0].reservation_id
        cr = other.Commit(pb.CommitRequest(reservation_ids=[rid]), timeout=5)
        assert cr.statuses[0].code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        ch.close()
    finally:
        a.close()


def test_a_pool_a_client_maps_is_neither_reformatted_nor_resized_under_it(tmp_path):
    """An LMCache process keeps the pool mapped across sidecar restarts: a
    restart with `--format` (another geometry, or another size) would pull
    its pages from under it — SIGBUS on its next copy, or pages of the new
    layout read through locations of the old. The plugin holds a shared lock
    on the pool file while it maps it, and the sidecar refuses until it lets
    go."""
    sc = Sidecar(tmp_path).start()
    a = make_adapter(sc.socket)
    try:
        assert store(a, [key(1)], [obj(OBJ)]).is_successful()  # the pool is mapped
        sc.stop()
        size = os.path.getsize(sc.pool)
        for extra in (("--region-size", "4MiB"), ("--pool-size", "32MiB")):
            again = Sidecar(tmp_path, "again", extra=("--format", *extra))
            out = subprocess.run(again.args(), capture_output=True, text=True, timeout=30)
            assert out.returncode != 0 and "a client (an LMCache server" in out.stderr, out.stderr
            assert os.path.getsize(sc.pool) == size
    finally:
        a.close()
    Sidecar(tmp_path, "again", extra=("--format", "--pool-size", "32MiB")).start().kill()
    assert os.path.getsize(sc.pool) < size
