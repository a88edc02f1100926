"""Admission through every face of the plugin, against a real `cxlkv serve`
whose registry gates every store while its pool is full (`admission =
"second_touch"`: a key's first store is declined, its second admitted): the
L2 adapter (mapped and inline), the in-process backend under LMCache's
StorageManager and the remote connector each take a declined store as a
skipped store, never a failure, with nothing reserved, placed or copied;
the next store of the key is stored and read back with its bytes."""

from __future__ import annotations

import pytest
import torch

from cxlkv_lmcache import client as cl
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_testkit import (Sidecar, adapter, clear_l1, engine_chunk, engine_key, engine_put, engine_storage_manager,
                           same_chunk, sidecar_stats)
from cxlkv_testkit.l2 import bits, key, load, lookup, obj, store
from test_adapter import Recorder
from test_inproc_backend import hits
from test_inproc_connector import conn_of, run


def fill(socket: str) -> None:
    """One-page keys stored (nothing copied: no one reads them) until the
    pool evicts: from then on it is full, and the gate applies."""
    ch = cl.channel(socket)
    try:
        stub, i = cl.stub(ch), 0
        while sidecar_stats(socket).evictions == 0:
            items = [pb.ReserveItem(key=f"fill-{i}-{j}".encode(), size=1000) for j in range(64)]
            rep = stub.Reserve(pb.ReserveRequest(tenant="fill", items=items), timeout=10)
            ids = [r.reservation_id for r in rep.reservations if r.status.code == cl.OK]
            stub.Commit(pb.CommitRequest(reservation_ids=ids), timeout=10)
            i += 1
    finally:
        ch.close()
    assert sidecar_stats(socket).admission.gating


@pytest.fixture
def gated(tmp_path):
    """A sidecar owning one 2 MiB region (512 pages), full, gating."""
    cfg = tmp_path / "gate.toml"
    cfg.write_text('[registry]\nadmission = "second_touch"\nmax_regions_per_instance = 1\n')
    s = Sidecar(tmp_path, extra=("--config", str(cfg))).start()
    try:
        fill(s.socket)
        yield s
    finally:
        s.kill()


def footprint(socket: str) -> tuple[int, int, int]:
    """Pages in use, keys being written, keys committed."""
    st = sidecar_stats(socket)
    return st.pages_used, st.reserved, st.keys


@pytest.mark.parametrize("mode", ["mmap", "inline"])
def test_adapter_a_declined_store_is_skipped_and_the_second_is_stored(gated, mode):
    with adapter(gated.socket, mode=mode) as a:
        rec = Recorder()
        a.register_listener(rec)
        sizes = [4096, 100_000]
        keys, objs = [key(1), key(2)], [obj(n, seed=i) for i, n in enumerate(sizes)]
        before = footprint(gated.socket)
        r = store(a, keys, objs)
        # Skipped, not failed: LMCache sees a successful task that wrote nothing.
        assert r.is_successful() and r.bytes_transferred() == 0
        assert rec.stored == [] and a.get_usage().total_bytes_used == 0
        assert footprint(gated.socket) == before, "nothing placed, reserved or committed"
        assert a.report_status()["not_admitted_stores"] == 2
        assert bits(lookup(a, keys), 2) == [False, False]
        r = store(a, keys, objs)
        assert r.is_successful() and r.bytes_transferred() == sum(sizes)
        assert dict(rec.stored) == dict(zip(keys, sizes))
        assert bits(lookup(a, keys), 2) == [True, True]
        outs = [obj(n, seed=100) for n in sizes]
        assert bits(load(a, keys, outs), 2) == [True, True]
        assert all(torch.equal(o.tensor, w.tensor) for o, w in zip(outs, objs))
        a.submit_unlock(keys)
    adm = sidecar_stats(gated.socket).admission
    assert (adm.mode, adm.refused) == ("second_touch", 2)


def test_backend_a_declined_put_is_skipped_and_the_second_is_stored(gated):
    sm = engine_storage_manager(gated.socket)
    try:
        be = sm.storage_backends["cxlkv"]
        keys = [engine_key(s) for s in (1, 2)]
        before = footprint(gated.socket)
        engine_put(sm, [1, 2])
        assert footprint(gated.socket) == before, "nothing placed, reserved or committed"
        assert sidecar_stats(gated.socket).admission.refused == 2
        assert not be.contains(keys[0]) and be.report_status()["is_healthy"]
        clear_l1(sm)
        assert sm.batched_contains(keys)[0] == 0
        engine_put(sm, [1, 2])
        assert sm.batched_contains(keys)[0] == 2
        clear_l1(sm)
        for o in hits(sm, [1, 2]):
            o.ref_count_down()
    finally:
        sm.close()


def test_connector_a_declined_put_is_skipped_and_the_second_is_stored(gated):
    sm = engine_storage_manager(gated.socket, backend=False, connector=True)
    try:
        c = conn_of(sm)
        keys = [engine_key(s) for s in (3, 4)]
        objs = [engine_chunk(sm, s) for s in (3, 4)]
        before = footprint(gated.socket)
        run(sm, c.batched_put(keys, objs))
        assert footprint(gated.socket) == before, "nothing placed, reserved or committed"
        assert c.batched_contains(keys) == 0
        run(sm, c.put(keys[0], objs[0]))  # a key's second store: admitted
        assert c.batched_contains(keys[:1]) == 1 and not c.exists_sync(keys[1])
        run(sm, c.batched_put(keys[1:], objs[1:]))
        assert c.batched_contains(keys) == 2
        got = run(sm, c.batched_get(keys))
        assert all(o is not None and same_chunk(o, s) for o, s in zip(got, (3, 4)))
        for o in got:
            o.ref_count_down()
        assert sidecar_stats(gated.socket).admission.refused == 2
    finally:
        sm.close()
