"""CxlKvL2Adapter behaviour beyond LMCache's interface tests, always against a
real `cxlkv serve`."""

from __future__ import annotations

import contextlib
import filecmp
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache.v1.distributed.internal_api import L2AdapterListener

from cxlkv_testkit import ROOT, Sidecar, adapter, free_port, make_adapter, storage_manager, upstream, wait_for
from cxlkv_testkit.l2 import bits, key, load, lookup, obj, store

class Recorder(L2AdapterListener):
    def __init__(self):
        self.stored, self.accessed, self.deleted = [], [], []

    def on_l2_keys_stored(self, keys, sizes):
        self.stored += list(zip(keys, sizes))

    def on_l2_keys_accessed(self, keys):
        self.accessed += list(keys)

    def on_l2_keys_deleted(self, keys):
        self.deleted += list(keys)


# --------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"sockett": "/x"}, "unknown cxlkv adapter_params ['sockett']"),
        ({"deadline_ms": "5s"}, "deadline_ms must be int"),
        ({"mode": "rdma"}, "mode must be one of"),
        ({"workers": 0}, "must be > 0"),
        ({"lock_ttl_ms": -1}, "must be >= 0"),
        ({"poll_interval_ms": 1.5}, "poll_interval_ms must be int"),
    ],
)
def test_bad_adapter_params_fail_at_startup_with_a_clear_error(params, needle):
    with pytest.raises(ValueError) as e:
        make_adapter("/tmp/none.sock", **params)
    assert needle in str(e.value)


def test_unreachable_sidecar_starts_unhealthy_and_tasks_fail_fast(tmp_path):
    with adapter(str(tmp_path / "absent.sock"), connect_timeout_ms=100, deadline_ms=500) as a:
        assert a.report_status()["is_healthy"] is False
        t = time.monotonic()
        assert bits(lookup(a, [key(1)]), 1) == [False]
        r = store(a, [key(1)], [obj(100)])
        assert not r.is_successful()
        assert time.monotonic() - t < 3
        a.submit_unlock([key(1)])  # never raises


# ------------------------------------------------------------------ data path


def test_mapped_roundtrip_sizes_tenants_and_accounting(sidecar):
    with adapter(sidecar.socket) as a:
        rec = Recorder()
        a.register_listener(rec)
        assert a.report_status()["mode"] == "mmap"
        sizes = [1, 4096, 4097, 2 * 1024 * 1024 - 3]  # up to almost a whole region
        keys = [key(i, salt="alice" if i % 2 else "") for i in range(len(sizes))]
        objs = [obj(n, seed=i) for i, n in enumerate(sizes)]
        r = store(a, keys, objs)
        assert r.is_successful() and r.bytes_transferred() == sum(sizes)
        assert dict(rec.stored) == dict(zip(keys, sizes))
        u = a.get_usage()
        assert u.total_bytes_used == sum(sizes)
        assert u.bytes_by_cache_salt == {"": sizes[0] + sizes[2], "alice": sizes[1] + sizes[3]}
        assert 0 < u.usage_fraction < 1

        # Re-store: the sidecar says "exists", nothing is counted twice.
        r = store(a, keys[:2], [obj(sizes[0], 99), obj(sizes[1], 99)])
        assert r.is_successful() and r.bytes_transferred() == 0
        assert a.get_usage().total_bytes_used == sum(sizes)

        assert bits(lookup(a, keys + [key(77)]), 5) == [True] * 4 + [False]
        outs = [obj(n, seed=1000) for n in sizes]
        assert bits(load(a, keys, outs), 4) == [True] * 4
        for o, want in zip(outs, objs):
            assert torch.equal(o.tensor, want.tensor)
        assert set(rec.accessed) == set(keys)
        a.submit_unlock(keys)
        assert wait_for(lambda: a.report_status()["pending_unlocks"] == 0 and a.report_status()["locked_key_count"] == 0)

        # A buffer of the wrong size is a miss, never a partial write.
        small = obj(10, seed=5)
        before = small.tensor.clone()
        assert bits(load(a, [keys[1]], [small]), 1) == [False]
        assert torch.equal(small.tensor, before)


def test_new_keys_stored_between_present_ones_hold_their_own_bytes(sidecar):
    """The sidecar answers the adapter's Reserves with runs (two present keys
    in a row are one entry): each new key still gets its own reservation and
    bytes, and nothing is counted for the present ones."""
    with adapter(sidecar.socket) as a:
        present = [key(i) for i in range(3)]
        assert store(a, present, [obj(4096, seed=i) for i in range(3)]).is_successful()
        new = [key(10), key(11)]
        keys = [new[0], *present, new[1], present[0]]
        objs = [obj(4096, seed=50 + i) for i in range(len(keys))]
        r = store(a, keys, objs)
        assert r.is_successful() and r.bytes_transferred() == 2 * 4096
        outs = [obj(4096, seed=1000) for _ in range(5)]
        assert bits(load(a, new + present, outs), 5) == [True] * 5
        assert torch.equal(outs[0].tensor, objs[0].tensor) and torch.equal(outs[1].tensor, objs[4].tensor)
        for i in range(3):
            assert torch.equal(outs[2 + i].tensor, obj(4096, seed=i).tensor), "a present key was overwritten"
        a.submit_unlock(new + present)


def test_inline_mode_roundtrip(sidecar):
    with adapter(sidecar.socket, mode="inline") as a:
        assert a.report_status()["mode"] == "inline"
        objs = [obj(3 * 1024 * 1024 // 2, seed=1), obj(10, seed=2)]
        assert store(a, [key(1), key(2)], objs).is_successful()
        outs = [obj(3 * 1024 * 1024 // 2, seed=9), obj(10, seed=9)]
        assert bits(lookup(a, [key(1), key(2)]), 2) == [True, True]
        assert bits(load(a, [key(1), key(2)], outs), 2) == [True, True]
        assert all(torch.equal(o.tensor, w.tensor) for o, w in zip(outs, objs))
        a.submit_unlock([key(1), key(2)])
    # What the inline path stored is visible to a mapping client, and back.
    with adapter(sidecar.socket, mode="mmap") as b:
        out = obj(10, seed=7)
        assert bits(load(b, [key(2)], [out]), 1) == [True]
        assert torch.equal(out.tensor, objs[1].tensor)


def test_unmappable_pool_falls_back_to_inline_or_fails_clearly(tmp_path):
    """An LMCache process that cannot see the pool (here: a private mount
    namespace with an empty tmpfs over the pool's directory, like a pod without
    the pool volume) reaches the sidecar over TCP: mode auto falls back to the
    inline path, mode mmap refuses at start-up with a clear error."""
    port = free_port()
    s = Sidecar(tmp_path, extra=("--tcp", f"127.0.0.1:{port}"))
    script = textwrap.dedent(f"""
        import os, torch
        assert not os.path.exists({s.pool!r}), "pool still visible"
        from cxlkv_testkit.l2 import make_adapter, store, lookup, load, obj, key, bits
        try:
            make_adapter("", tcp_address="127.0.0.1:{port}", mode="mmap")
            print("NO-ERROR")
        except RuntimeError as e:
            print("MMAP-ERROR", "cannot map pool" in str(e))
        a = make_adapter("", tcp_address="127.0.0.1:{port}")
        print("MODE", a.report_status()["mode"])
        o = obj(5000, seed=3)
        print("STORE", store(a, [key(1)], [o]).is_successful())
        out = obj(5000, seed=4)
        print("LOAD", bits(lookup(a, [key(1)]), 1), bits(load(a, [key(1)], [out]), 1), torch.equal(out.tensor, o.tensor))
        a.close()
    """)
    with s.start():
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
               f'mount -t tmpfs none "{tmp_path}" && exec "$0" -c "$1"', sys.executable, script]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        lines = out.stdout.splitlines()
        assert "MMAP-ERROR True" in lines, out.stdout + out.stderr[-2000:]
        assert "MODE inline" in lines
        assert "STORE True" in lines
        assert "LOAD [True] [True] True" in lines


def test_two_lmcache_processes_share_chunks(sidecar):
    """One process stores, another (separate interpreter) finds and loads."""
    writer = textwrap.dedent(f"""
        from cxlkv_testkit.l2 import make_adapter, store, obj, key
        a = make_adapter({sidecar.socket!r})
        r = store(a, [key(i) for i in range(8)], [obj(256 * 1024, seed=i) for i in range(8)])
        print("STORED", r.is_successful(), r.bytes_transferred())
        a.close()
    """)
    out = subprocess.run([sys.executable, "-c", writer], capture_output=True, text=True, timeout=120)
    assert "STORED True 2097152" in out.stdout, out.stderr[-3000:]
    with adapter(sidecar.socket) as b:
        keys = [key(i) for i in range(8)] + [key(100)]
        assert bits(lookup(b, keys), 9) == [True] * 8 + [False]
        outs = [obj(256 * 1024, seed=50) for _ in range(8)]
        assert bits(load(b, keys[:8], outs), 8) == [True] * 8
        for i, o in enumerate(outs):
            assert torch.equal(o.tensor, obj(256 * 1024, seed=i).tensor)
        b.submit_unlock(keys)


# ----------------------------------------------------------------- eviction


def test_sidecar_evictions_reach_lmcache_accounting(tmp_path):
    """The sidecar evicts on its own (pool of two 2 MiB regions); the adapter
    reports those keys deleted with exact sizes so LMCache's usage stays right,
    including evictions caused by another client."""
    # One client here holds the whole pool at once (a batch as large as the
    # pool, then three of its four objects locked): past the default bound
    # of half the pool per client, so the bound is the pool.
    with (Sidecar(tmp_path, pool_size="4MiB", extra=("--max-client-pinned-bytes", "4MiB")).start() as s,
          adapter(s.socket, poll_interval_ms=50) as a,
          adapter(s.socket, poll_interval_ms=50) as b):
        rec = Recorder()
        a.register_listener(rec)
        mib = 1024 * 1024
        assert store(a, [key(i) for i in range(4)], [obj(mib, seed=i) for i in range(4)]).is_successful()
        assert a.get_usage().total_bytes_used == 4 * mib
        # Keep key 3 locked: it must survive.
        assert bits(lookup(a, [key(3)]), 1) == [True]
        # Another client fills the pool: keys 0..2 of `a` are evicted, LRU first.
        assert store(b, [key(10), key(11)], [obj(mib), obj(mib)]).is_successful()
        assert store(b, [key(12)], [obj(mib)]).is_successful()
        assert wait_for(lambda: len(rec.deleted) == 3), rec.deleted
        assert set(rec.deleted) == {key(0), key(1), key(2)}
        assert a.get_usage().total_bytes_used == mib
        assert bits(lookup(b, [key(3)]), 1) == [True], "a locked key was evicted"
        b.submit_unlock([key(3)])
        # Everything left is locked or taken: the next store fails cleanly.
        assert bits(lookup(b, [key(10), key(11), key(12)]), 3) == [True] * 3
        r = store(a, [key(20)], [obj(mib)])
        assert not r.is_successful()
        a.submit_unlock([key(3)])


def test_delete_skips_locked_and_reports_exact_sizes(sidecar):
    with adapter(sidecar.socket) as a:
        rec = Recorder()
        a.register_listener(rec)
        store(a, [key(1), key(2)], [obj(1000), obj(3000)])
        assert bits(lookup(a, [key(2)]), 1) == [True]
        a.delete([key(1), key(2), key(3)])
        assert rec.deleted == [key(1)]
        assert a.get_usage().total_bytes_used == 3000
        a.submit_unlock([key(2)])
        assert wait_for(lambda: a.report_status()["pending_unlocks"] == 0)
        a.delete([key(2)])
        assert a.get_usage().total_bytes_used == 0


def test_list_l2_keys_pages_and_filters(sidecar):
    with adapter(sidecar.socket) as a:
        store(a, [key(i) for i in range(7)], [obj(100 + i) for i in range(7)])
        store(a, [key(50, model="other/model", salt="t1")], [obj(9)])
        seen, cursor = [], None
        while True:
            page = a.list_l2_keys(model_name="org/model", page_size=3, cursor=cursor)
            seen += [(e.key.chunk_hash_hex, e.size_bytes) for e in page.entries]
            cursor = page.next_page_token
            if cursor is None:
                break
        assert sorted(seen) == sorted((key(i).chunk_hash_hex if hasattr(key(i), "chunk_hash_hex") else
                                       key(i).chunk_hash.hex(), 100 + i) for i in range(7))
        other = a.list_l2_keys(model_name="other/model").entries
        assert [(e.key.cache_salt, e.size_bytes) for e in other] == [("t1", 9)]
        with pytest.raises(ValueError):
            a.list_l2_keys(page_size=0)
        with pytest.raises(ValueError):
            a.list_l2_keys(cursor="not-a-cursor")


# -------------------------------------------------------------------- faults


def test_frozen_sidecar_turns_into_failure_bits_within_the_deadline(sidecar):
    with adapter(sidecar.socket, deadline_ms=700) as a, sidecar.sigcont_on_exit():
        store(a, [key(1)], [obj(100)])
        sidecar.signal(signal.SIGSTOP)
        t = time.monotonic()
        assert bits(lookup(a, [key(1)]), 1) == [False]
        assert bits(load(a, [key(1)], [obj(100)]), 1) == [False]
        assert not store(a, [key(2)], [obj(100)]).is_successful()
        assert time.monotonic() - t < 3 * 0.7 + 1.5
        sidecar.signal(signal.SIGCONT)
        assert wait_for(lambda: bits(lookup(a, [key(1)]), 1) == [True], timeout=10)
        a.submit_unlock([key(1)])


def test_a_lookup_answered_after_its_deadline_leaves_no_lock(sidecar):
    """LMCache never unlocks a lookup that failed; if the sidecar answers late,
    the adapter must release the locks that answer took."""
    from cxlkv_lmcache import client as cl
    from cxlkv_lmcache._proto import cxlkv_pb2 as pb

    stub = cl.stub(cl.channel(sidecar.socket))
    with adapter(sidecar.socket, deadline_ms=400) as a, sidecar.sigcont_on_exit():
        assert store(a, [key(1), key(2)], [obj(100), obj(100)]).is_successful()
        sidecar.signal(signal.SIGSTOP)
        assert bits(lookup(a, [key(1), key(2)]), 2) == [False, False]
        sidecar.signal(signal.SIGCONT)
        locked = lambda: stub.Stats(pb.StatsRequest(), timeout=2).locked_keys  # noqa: E731
        assert wait_for(lambda: locked() == 0, timeout=5), f"{locked()} keys stay locked"
        assert a.report_status()["locked_key_count"] == 0
        # And the normal path still locks.
        assert bits(lookup(a, [key(1)]), 1) == [True]
        assert locked() == 1


def test_sidecar_killed_during_loads_then_back(sidecar):
    with adapter(sidecar.socket, deadline_ms=1500, poll_interval_ms=50) as a:
        objs = [obj(64 * 1024, seed=i) for i in range(4)]
        assert store(a, [key(i) for i in range(4)], objs).is_successful()
        assert bits(lookup(a, [key(0)]), 1) == [True]
        sidecar.kill()
        t = time.monotonic()
        # Not locked before: needs the sidecar → failure bits, not a hang.
        assert bits(load(a, [key(1), key(2)], [obj(64 * 1024), obj(64 * 1024)]), 2) == [False, False]
        assert time.monotonic() - t < 5
        assert wait_for(lambda: a.report_status()["is_healthy"] is False, timeout=5)
        # Back on the same pool: the registry is rebuilt from the object
        # records in the pool. The location held for key 0 is stale (its region
        # has a new generation), so the load looks the key up again and gets
        # the same bytes; the adapter's accounting keeps the surviving keys.
        sidecar.start()
        assert wait_for(lambda: a.report_status()["is_healthy"], timeout=10)
        out = obj(64 * 1024, seed=99)
        assert bits(load(a, [key(0)], [out]), 1) == [True]
        assert torch.equal(out.tensor, objs[0].tensor)
        assert wait_for(lambda: a.get_usage().total_bytes_used == 4 * 64 * 1024, timeout=5)
        # A fresh process finds them too.
        with adapter(sidecar.socket) as b:
            assert bits(lookup(b, [key(i) for i in range(4)]), 4) == [True] * 4
            outs = [obj(64 * 1024, seed=50 + i) for i in range(4)]
            assert bits(load(b, [key(i) for i in range(4)], outs), 4) == [True] * 4
            assert all(torch.equal(o.tensor, w.tensor) for o, w in zip(outs, objs))
            b.submit_unlock([key(i) for i in range(4)])
        assert store(a, [key(5)], [objs[0]]).is_successful()
        out = obj(64 * 1024)
        assert bits(lookup(a, [key(5)]), 1) == [True]
        assert bits(load(a, [key(5)], [out]), 1) == [True]
        assert torch.equal(out.tensor, objs[0].tensor)
        a.submit_unlock([key(5)])


def test_tasks_running_when_a_restart_is_noticed_finish_on_their_own_connection(sidecar, monkeypatch):
    """The removal feed noticing a sidecar restart (`Link.forget`) while a
    store is between its Reserve and its copies, or while a load copies,
    does not pull the PoolInfo from under them: they finish on the
    connection they began with (the sidecar did not really restart here, so
    both succeed; before, both failed with an AttributeError)."""
    with adapter(sidecar.socket, verify_payload=True) as a:
        reserve = a._rides.reserve

        def reserve_then_forget(*args, **kw):
            rep = reserve(*args, **kw)
            a._link.forget()
            return rep

        monkeypatch.setattr(a._rides, "reserve", reserve_then_forget)
        want = obj(4096, seed=1)
        r = store(a, [key(1)], [want])
        assert r.is_successful() and r.bytes_transferred() == 4096
        monkeypatch.undo()
        assert bits(lookup(a, [key(1)]), 1) == [True]
        pool = a._link.conn.pool
        get_many = pool.get_many

        def get_then_forget(*args, **kw):
            get_many(*args, **kw)
            a._link.forget()

        monkeypatch.setattr(pool, "get_many", get_then_forget)
        out = obj(4096, seed=2)
        assert bits(load(a, [key(1)], [out]), 1) == [True]
        assert torch.equal(out.tensor, want.tensor)
        a.submit_unlock([key(1)])


def test_close_releases_everything(sidecar):
    a = make_adapter(sidecar.socket)
    fds = [a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()]
    tid = a.submit_store_task([key(i) for i in range(16)], [obj(256 * 1024, seed=i) for i in range(16)])
    a.close()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    # The in-flight store either completed or failed; either way it is answered.
    assert tid in a._results["store"] or tid not in a._pending
    a.close()  # idempotent


# ---------------------------------------------------------------- generated code


def test_committed_stubs_match_the_proto(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "gen-python-stubs.sh"), str(tmp_path)], check=True,
                   env={**os.environ, "PYTHON": sys.executable})
    for name in ("cxlkv_pb2.py", "cxlkv_pb2_grpc.py"):
        ours = ROOT / "python" / "cxlkv_lmcache" / "_proto" / name
        fresh = tmp_path / "cxlkv_lmcache" / "_proto" / name
        assert filecmp.cmp(ours, fresh, shallow=False), f"{name} is stale: run scripts/gen-python-stubs.sh"


def test_storage_manager_roundtrip_through_l2(sidecar):
    """Real StorageManager: L1 objects reach cxlkv through the store
    controller; with L1 dropped (skip_l1), a prefetch loads them back."""
    single_row_spec = upstream("tests.v1.distributed.utils").single_row_spec

    shape, dtype = torch.Size([2, 4, 256]), torch.bfloat16
    layout = MemoryLayoutDesc(shapes=[shape], dtypes=[dtype])
    keys = [key(i) for i in range(4)]
    with contextlib.closing(storage_manager(sidecar.socket)) as sm:
        l2 = sm._l2_adapters[0]
        assert type(l2).__name__ == "CxlKvL2Adapter"
        reserved = sm.reserve_write(keys, layout)
        for i, k in enumerate(keys):
            reserved[k].tensor.copy_(torch.full(shape, float(i + 1), dtype=dtype))
        sm.finish_write(keys)
        assert wait_for(lambda: sm.report_status()["l1_manager"]["total_object_count"] == 0
                        and l2.get_usage().total_bytes_used == 4 * shape.numel() * 2, timeout=10)
        handle = sm.submit_prefetch_task(single_row_spec(keys, layout))
        assert sm.wait_prefetch_status(handle, timeout=10.0)
        result = sm.query_prefetch_status(handle)
        assert result.l2_hit_cells[0].count_leading_ones() == 4
        with sm.read_prefetched_results(keys) as results:
            for i, r in enumerate(results):
                assert torch.all(r.tensor == float(i + 1))
        sm.finish_read_prefetched(keys)
        assert wait_for(lambda: l2.report_status()["locked_key_count"] == 0)
