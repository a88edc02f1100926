"""The in-process backend's zero-copy hits attacked as a hostile user would:
LMCache's own StorageManager (its LocalCPUBackend as L1, the cxlkv backend
as a storage plugin) keeps a view of a chunk in L1, and while it reads it
from there another client deletes the chunk and fills the pool, after the
engine's connection was reset, after the sidecar was killed and restarted,
or after the engine held far more views for far longer than it reads them.
Every read is byte-checked: a view is the stored chunk's bytes or a miss,
never another key's. Allocations are never pool pages. (docs/ARCHITECTURE.md,
"Hits through the backend".)"""

from __future__ import annotations

import subprocess
import time

import grpc
import pytest

from cxlkv_testkit import (Sidecar, clear_l1, engine_chunk, engine_key, engine_put, engine_storage_manager,
                           free_port, ready, same_chunk, sidecar_stats, wait_for)


def config(tmp_path, text: str) -> tuple:
    p = tmp_path / "views.toml"
    p.write_text(text)
    return ("--config", str(p))


def l1_read(sm, seed: int) -> str:
    """One read of chunk `seed` from the engine's L1, as LMCache's retrieve
    takes it: "ok" (its bytes), "foreign" (any other bytes) or "miss"."""
    obj = sm.storage_backends["LocalCPUBackend"].get_blocking(engine_key(seed))
    if obj is None:
        return "miss"
    try:
        if not obj.is_valid() or obj.tensor is None:
            return "miss"
        return "ok" if same_chunk(obj, seed) else "foreign"
    finally:
        obj.ref_count_down()


def view_into_l1(sm, seeds: list[int]) -> None:
    """The engine's retrieve of `seeds` from cxlkv with an empty L1: LMCache
    writes each hit (a view of the pool) back into its L1."""
    clear_l1(sm)
    objs = sm.batched_get([engine_key(s) for s in seeds], location="cxlkv")
    assert all(o is not None and same_chunk(o, s) for o, s in zip(objs, seeds))
    for o in objs:
        o.ref_count_down()
    assert all(l1_read(sm, s) == "ok" for s in seeds)
    pool = sm.storage_backends["cxlkv"]._core.conn.pool
    held = sm.storage_backends["LocalCPUBackend"].hot_cache[engine_key(seeds[0])]
    assert pool.contains(held.data_ptr), "L1 keeps the view itself, not a copy"


def stub(sock: str):
    from cxlkv_lmcache import client as cl

    ch = cl.channel(sock)
    return ch, cl.stub(ch)


def delete(sock: str, seeds: list[int]) -> list[int]:
    """Another client's Delete of the chunks: a status code per chunk."""
    from cxlkv_lmcache import keys as keycodec
    from cxlkv_lmcache._proto import cxlkv_pb2 as pb

    ch, s = stub(sock)
    try:
        keys = [keycodec.encode_engine_key(engine_key(x)) for x in seeds]
        return [st.code for st in s.Delete(pb.DeleteRequest(keys=keys), timeout=5).statuses]
    except grpc.RpcError as e:
        return [e.code().value[0]] * len(seeds)
    finally:
        ch.close()


def fill(sock: str, first: int, n: int) -> list[int]:
    """Another engine stores n chunks from seed `first` (more than the pool
    holds makes it evict everything it can): the seeds it stored."""
    sm = engine_storage_manager(sock, cpu_gb=0.2)
    stored = []
    try:
        be = sm.storage_backends["cxlkv"]
        for i in range(first, first + n, 32):
            seeds = list(range(i, min(i + 32, first + n)))
            engine_put(sm, seeds, timeout=20)
            clear_l1(sm)
            stored += [s for s in seeds if be.contains(engine_key(s))]  # (later batches may evict it)
        return stored
    finally:
        sm.close()


def reads_while(sm, seed: int, seconds: float, during=None) -> dict:
    """Read `seed` from L1 for `seconds` (running `during` once, first):
    how many reads came out each way."""
    out = {"ok": 0, "foreign": 0, "miss": 0}
    if during is not None:
        during()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out[l1_read(sm, seed)] += 1
        time.sleep(0.01)
    return out


# ------------------------------------------------------ a reset connection

def reset_tcp(port: int) -> None:
    """Kill every TCP connection to the sidecar's port (as a conntrack flush
    or a proxy would): the sidecar sees its client's connection close."""
    subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", f":{port}"], check=True, capture_output=True)


def connections(port: int) -> set[str]:
    """The client ends of the established connections to the sidecar's port."""
    out = subprocess.run(["ss", "-Htn", "state", "established", "dst", "127.0.0.1", "dport", "=", f":{port}"],
                         check=True, capture_output=True, text=True).stdout
    return {line.split()[-2] for line in out.splitlines() if line.strip()}


@pytest.mark.parametrize("how", ["ss_kill", "idle_timeout"])
def test_a_reset_connection_leaves_the_view_locked_and_another_client_cannot_reuse_its_pages(tmp_path, how):
    port = free_port()
    # A short idle timeout closes an engine's connection while it only reads L1.
    extra = ("--tcp", f"127.0.0.1:{port}",
             *config(tmp_path, "[server]\nhandshake_timeout_ms = 500\nidle_timeout_ms = 1000\n" if how == "idle_timeout" else ""))
    with Sidecar(tmp_path, extra=extra).start() as s:
        # Polling the removal log every 200 ms would keep the connection busy.
        sm = engine_storage_manager(s.socket, tcp_address=f"127.0.0.1:{port}", poll_interval_ms=60000)
        try:
            engine_put(sm, [1])
            view_into_l1(sm, [1])
            before = connections(port)
            assert before
            if how == "ss_kill":
                reset_tcp(port)
            else:
                time.sleep(2.5)  # past the idle timeout: the sidecar closed the connection
            assert wait_for(lambda: not before & connections(port)), "the engine's connection is still open"
            time.sleep(0.5)

            def attack():
                # Another client deletes the chunk and fills the pool.
                assert delete(s.socket, [1]) == [grpc.StatusCode.FAILED_PRECONDITION.value[0]], \
                    "the view's lock went with the connection"
                fill(s.socket, 1000, 1200)

            got = reads_while(sm, 1, 2.0, attack)
            assert got["foreign"] == 0 and got["ok"] > 0, got
            assert sidecar_stats(s.socket).locked_keys >= 1
            # The lock is the session's: renewals on the new connection extend
            # it, and giving the view back releases it.
            be = sm.storage_backends["cxlkv"]
            be.renew_now(be._cfg.lock_ttl_ms / 1000)
            assert sidecar_stats(s.socket).locked_keys == 1
            clear_l1(sm)
            assert wait_for(lambda: sidecar_stats(s.socket).locked_keys == 0)
        finally:
            sm.close()


# ------------------------------------------------------- a sidecar restart

@pytest.mark.parametrize("down_s", [0.0, 3.0])
def test_a_view_held_across_a_sidecar_kill_and_restart_never_reads_another_keys_bytes(tmp_path, down_s):
    s = Sidecar(tmp_path).start()
    sm = engine_storage_manager(s.socket, poll_interval_ms=100)
    try:
        engine_put(sm, [2])
        view_into_l1(sm, [2])
        s.kill()
        time.sleep(down_s)
        statuses: list = []

        def attack():
            # The new instance starts; another client deletes the chunk from
            # the moment it answers (before the engine could lock it again),
            # then fills the pool.
            s.proc = subprocess.Popen(s.args(), stdout=subprocess.DEVNULL, stderr=open(s.log, "ab"))
            end = time.monotonic() + 4
            while time.monotonic() < end:
                statuses.extend(delete(s.socket, [2]))
                if statuses[-1] == 0:
                    break
            assert wait_for(lambda: ready(s.socket), timeout=30)
            fill(s.socket, 2000, 1200)

        got = reads_while(sm, 2, 2.0, attack)
        assert got["foreign"] == 0, got
        assert 0 not in statuses, f"the chunk a view shows was deleted: {statuses[-5:]}"
        # The restart's grace, then the backend's new lock, kept it: the view
        # is still good, and locked again.
        assert got["ok"] > 0 and sidecar_stats(s.socket).locked_keys == 1, got
        codes = set(statuses)
        assert codes <= {grpc.StatusCode.UNAVAILABLE.value[0], grpc.StatusCode.FAILED_PRECONDITION.value[0]}, codes
    finally:
        sm.close()
        s.kill()


def test_a_view_through_a_follower_survives_its_primarys_kill_and_restart(cluster):
    """Engine on follower b views a chunk; the primary is killed (-9) and
    started again; a client of follower c deletes the chunk from the moment
    it can and fills the pool: b's engine never reads another key's bytes
    (the new primary keeps everything until view locks granted by the old
    one could have lapsed; b's clients see a new instance id and lock again)."""
    a, b, c = cluster["a"], cluster["b"], cluster["c"]
    sm = engine_storage_manager(b.socket, poll_interval_ms=100)
    try:
        engine_put(sm, [6])
        view_into_l1(sm, [6])
        statuses: list = []

        def attack():
            a.kill()
            a.proc = subprocess.Popen(a.args(), stdout=subprocess.DEVNULL, stderr=open(a.log, "ab"))
            end = time.monotonic() + 6
            while time.monotonic() < end:
                statuses.extend(delete(c.socket, [6]))
                if statuses[-1] == 0:
                    break
                time.sleep(0.02)
            assert wait_for(lambda: ready(a.socket), timeout=30)
            fill(c.socket, 6000, 300)

        got = reads_while(sm, 6, 3.0, attack)
        assert got["foreign"] == 0, got
        assert 0 not in statuses, f"the chunk a view shows was deleted: {statuses[-5:]}"
        assert got["ok"] > 0, got
    finally:
        sm.close()


def test_without_view_locks_a_restart_grants_no_grace(tmp_path):
    """The grace lasts until view locks granted before the restart could
    have lapsed: with none granted, a restarted sidecar deletes at once."""
    s = Sidecar(tmp_path).start()
    sm = engine_storage_manager(s.socket)
    try:
        engine_put(sm, [3])
    finally:
        sm.close()
    s.kill()
    s.start()
    try:
        assert delete(s.socket, [3]) == [0]
    finally:
        s.kill()


# ------------------------------------------------- what views may pin

def test_an_engine_that_read_more_than_its_budget_can_still_store_and_so_can_others(tmp_path):
    """Half the pool read back into L1 as views: what the engine keeps
    locked stays within its view budget, and it and another engine store."""
    with Sidecar(tmp_path).start() as s:
        sm = engine_storage_manager(s.socket, cpu_gb=0.2)
        try:
            seeds = list(range(100, 620))  # 520 chunks of 64 KiB: more than half the 64 MiB pool
            for i in range(0, len(seeds), 40):
                engine_put(sm, seeds[i:i + 40], timeout=20)
            clear_l1(sm)
            be = sm.storage_backends["cxlkv"]
            budget = be._core.conn.info.capacity_bytes // 8  # the default view budget (docs/ARCHITECTURE.md)
            for i in range(0, len(seeds), 40):
                objs = sm.batched_get([engine_key(x) for x in seeds[i:i + 40]], location="cxlkv")
                assert all(o is not None and same_chunk(o, x) for o, x in zip(objs, seeds[i:i + 40]))
                for o in objs:
                    o.ref_count_down()
            assert wait_for(lambda: sidecar_stats(s.socket).locked_keys * (64 << 10) <= budget + 40 * (64 << 10)), \
                (sidecar_stats(s.socket).locked_keys, budget)
            # Every read was byte-checked above; what L1 still holds reads right.
            assert all(l1_read(sm, x) in ("ok", "miss") for x in seeds)
            # The engine stores 8 new chunks, all of them.
            engine_put(sm, list(range(700, 708)))
            assert sum(be.contains(engine_key(x)) for x in range(700, 708)) == 8
        finally:
            sm.close()
        # And another engine stores 64.
        assert len(fill(s.socket, 800, 64)) == 64


def test_two_engines_holding_views_leave_room_for_a_third_clients_store(tmp_path):
    with Sidecar(tmp_path, pool_size="16MiB").start() as s:
        engines = [engine_storage_manager(s.socket, cpu_gb=0.1) for _ in range(2)]
        try:
            for n, sm in enumerate(engines):
                seeds = list(range(n * 1000, n * 1000 + 112))
                for i in range(0, len(seeds), 16):
                    engine_put(sm, seeds[i:i + 16])
                clear_l1(sm)
                for i in range(0, len(seeds), 16):
                    for o in sm.batched_get([engine_key(x) for x in seeds[i:i + 16]], location="cxlkv"):
                        if o is not None:
                            o.ref_count_down()
            stored = fill(s.socket, 5000, 64)
            assert len(stored) == 64, f"a third client stored {len(stored)} of 64 chunks"
        finally:
            for sm in engines:
                sm.close()


def test_a_view_not_read_leaves_l1_and_its_lock_goes_while_a_view_read_keeps_it_past_max_lock_ttl(tmp_path):
    extra = config(tmp_path, "[registry]\nmax_lock_ttl_ms = 2000\n")
    with Sidecar(tmp_path, extra=extra).start() as s:
        sm = engine_storage_manager(s.socket, lock_ttl_ms=1000, view_idle_ms=1500)
        try:
            engine_put(sm, [4, 5])
            view_into_l1(sm, [4, 5])
            # Chunk 4 is read every 200 ms for 3 x max_lock_ttl: its holder
            # proves it exists, the lock stays. Chunk 5 is never read again.
            got = reads_while(sm, 4, 6.0)
            assert got == {"ok": got["ok"], "foreign": 0, "miss": 0} and got["ok"] > 0, got
            assert l1_read(sm, 5) == "miss", "an idle view stays in L1"
            assert delete(s.socket, [5]) == [0], "an idle view's lock stays"
            assert delete(s.socket, [4]) == [grpc.StatusCode.FAILED_PRECONDITION.value[0]]
        finally:
            sm.close()


# ---------------------------------------------- allocations and their pages

def test_an_allocation_written_after_any_reservation_would_have_expired_corrupts_no_other_key(tmp_path):
    with Sidecar(tmp_path, pool_size="16MiB", extra=("--reservation-timeout-ms", "1000")).start() as s:
        sm = engine_storage_manager(s.socket)
        try:
            be = sm.storage_backends["cxlkv"]
            objs = be.batched_allocate(sm.metadata.get_shapes(), sm.metadata.get_dtypes(), 4)
            time.sleep(2.0)  # any reservation behind them would be gone
            others = fill(s.socket, 3000, 300)  # another client fills the pool
            for i, o in enumerate(objs):
                o.tensor.copy_(engine_chunk(sm, 40 + i).tensor)
            for f in be.batched_submit_put_task([engine_key(40 + i) for i in range(4)], objs):
                f.result(timeout=10)
            for o in objs:
                o.ref_count_down()
            # The engine's chunks hold what it wrote; every chunk the other
            # client stored holds its own bytes.
            clear_l1(sm)
            mine = be.batched_get_blocking([engine_key(40 + i) for i in range(4)])
            assert all(o is not None and same_chunk(o, 40 + i) for i, o in enumerate(mine))
            for o in mine:
                o.ref_count_down()
            theirs = [x for x in others if be.contains(engine_key(x))]  # (the later ones evicted the first)
            assert theirs
            for i in range(0, len(theirs), 32):
                got = be.batched_get_blocking([engine_key(x) for x in theirs[i:i + 32]])
                assert all(o is None or same_chunk(o, x) for o, x in zip(got, theirs[i:i + 32]))
                for o in got:
                    if o is not None:
                        o.ref_count_down()
        finally:
            sm.close()



def test_a_get_under_the_view_budget_looks_at_no_other_lease_and_one_past_it_sheds_at_once(tmp_path, monkeypatch):
    """Shedding looks at every lease the engine keeps; a get calls it only
    when the kept leases may be past the budget (a count kept as leases come
    and go), and then sheds down to three quarters of it, so a get's cost
    does not grow with the views L1 keeps, even at the budget."""
    import threading

    from cxlkv_lmcache.views import Views

    here, calls = threading.get_ident(), []
    real = Views.shed

    def spy(self, now, budget=None):
        if threading.get_ident() == here:  # the get's own thread, not the upkeep thread
            calls.append(budget)
        return real(self, now, budget)

    monkeypatch.setattr(Views, "shed", spy)
    chunk = 64 << 10
    with Sidecar(tmp_path).start() as s:
        sm = engine_storage_manager(s.socket, cpu_gb=0.2, max_view_bytes=16 * chunk)
        try:
            seeds = list(range(100, 148))
            engine_put(sm, seeds, timeout=20)
            clear_l1(sm)
            be = sm.storage_backends["cxlkv"]
            views = be.views

            def get(batch):
                objs = sm.batched_get([engine_key(x) for x in batch], location="cxlkv")
                assert all(o is not None and same_chunk(o, x) for o, x in zip(objs, batch))
                return objs

            kept = get(seeds[:8])  # 8 chunks kept by L1, half the budget
            assert calls == [], "under the budget a get sheds nothing"
            assert views._current_bytes == sum(x.loc.length for x in views._current.values()) == 8 * chunk
            for o in get(seeds[8:40]):  # 32 more: past the budget
                o.ref_count_down()
            assert calls, "past the budget the get itself sheds"
            assert views._current_bytes == sum(x.loc.length for x in views._current.values())
            assert views._current_bytes <= 12 * chunk, "the get shed down to three quarters of the budget"
            calls.clear()
            for o in get(seeds[40:43]):  # 3 more stay within the budget: no shedding
                o.ref_count_down()
            assert calls == [] and views._current_bytes <= 16 * chunk
            del kept
        finally:
            sm.close()
