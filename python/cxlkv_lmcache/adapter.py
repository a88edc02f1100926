"""``CxlKvL2Adapter``: LMCache L2 adapter backed by the cxlkv sidecar.

Data path: the adapter maps the pool itself and moves bytes with one copy
(streaming stores for large objects, GIL released) between LMCache's
``MemoryObj`` and the pool; gRPC carries only metadata (reserve → copy →
commit; lookup-and-lock → copy → unlock). Without access to the pool it
streams bytes through the sidecar's inline path instead.

Every task finishes within ``deadline_ms``: gRPC calls carry deadlines and a
watchdog fails any task still pending past its deadline, so LMCache (whose
controllers have no timeouts) never waits forever.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import grpc
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

from cxlkv_lmcache import client as cl
from cxlkv_lmcache import keys as keycodec
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.config import CxlKvL2AdapterConfig
from cxlkv_lmcache.copies import Copier
from cxlkv_lmcache.feed import RemovalFeed
from cxlkv_lmcache.handoff import CommitRides, Handoff
from cxlkv_lmcache.inline import InlinePath
from cxlkv_lmcache.link import Link
from cxlkv_lmcache.state import (Conn, Held, Ledger, Stored, StoreTimes, Task, rpc_error, server_deadline,
                                  time_left)
from cxlkv_lmcache.unlocks import Unlocks
from cxlkv_lmcache.watch import HealthWatch

__all__ = ["CxlKvL2Adapter", "CxlKvL2AdapterConfig"]

log = logging.getLogger("cxlkv_lmcache")


def _crc32(addr: int, n: int) -> int:
    """crc32 (IEEE, as the sidecar's) of n bytes at addr, without a copy."""
    return zlib.crc32((ctypes.c_char * n).from_address(addr)) if n else 0


class CxlKvL2Adapter(L2AdapterInterface):
    """LMCache's interface over parts that each own one concern: `Link` (the
    connection and pool mapping), `InlinePath` (bytes over gRPC),
    `CommitRides` (commits on another store's Reserve), `RemovalFeed`
    (accounting follows the sidecar's removals) and `HealthWatch`. The
    adapter itself runs the tasks (deadlines, the watchdog) and keeps the
    locks a lookup takes until LMCache unlocks them (`Unlocks` sends the
    unlocks and retries the failed ones)."""

    config_class_name = "CxlKvL2AdapterConfig"

    def __init__(self, config: CxlKvL2AdapterConfig | dict, **kwargs):
        if isinstance(config, dict):
            config = CxlKvL2AdapterConfig.from_dict(config)
        self._cfg = config
        super().__init__(max_capacity_bytes=int(config.max_capacity_gb * (1 << 30)))
        self._l1_desc = kwargs.get("l1_memory_desc")
        self._ev = {k: create_event_notifier() for k in ("store", "lookup", "load")}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, Task] = {}
        self._results: dict[str, dict] = {"store": {}, "lookup": {}, "load": {}}
        self._held: dict[bytes, Held] = {}
        self._stored = Ledger()
        self._closed = threading.Event()
        self._link = Link(config, self._took_info)
        self._unlocks = Unlocks(self._link, config.unlock_retry_s, self._closed)
        self._stub = self._link.stub
        self._feed = RemovalFeed(self._link, self._stored, self._restarted, self._report_deleted,
                                 config.poll_interval_ms / 1000, self._closed)
        self._watch = HealthWatch(self._link, self._feed.poll_soon, self._closed)
        self._exec = ThreadPoolExecutor(config.workers, thread_name_prefix="cxlkv-task")
        self._copier = Copier(config.copy_threads)
        self._handoff = Handoff()
        self._rides = CommitRides(self._stub, self._handoff, config.commit_ride_ms)
        self._store_times = StoreTimes()
        self._inline = InlinePath(self._stub, self._begin_copy, self._end_copy)
        try:
            self._connect(time.monotonic() + config.connect_timeout_ms / 1000, wait=True)
        except grpc.RpcError as e:
            log.warning("cxlkv sidecar not reachable at start-up (%s); will retry", rpc_error(e))
        self._threads = [
            threading.Thread(target=self._watchdog, name="cxlkv-watchdog", daemon=True),
            threading.Thread(target=self._unlocks.run, name="cxlkv-unlock", daemon=True),
            threading.Thread(target=self._feed.run, name="cxlkv-poll", daemon=True),
            threading.Thread(target=self._watch.run, name="cxlkv-watch", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ setup

    @property
    def _conn(self) -> Conn:
        """The link's current Conn: a reconnect replaces it, so never keep one."""
        return self._link.conn

    def _connect(self, deadline: float, wait: bool = False) -> Conn:
        return self._link.connect(deadline, wait)

    def _took_info(self, info: pb.PoolInfoReply) -> None:
        """max_capacity_gb 0: LMCache's capacity is what the sidecar lets this node own."""
        if self._cfg.max_capacity_gb == 0:
            self._max_capacity_bytes = info.capacity_bytes

    def _restarted(self) -> None:
        """The sidecar lost its registry: drop locations and recheck accounting."""
        self._link.forget()
        with self._lock:
            self._held.clear()
            self._conn.unlock_q.clear()

    def _report_deleted(self, gone: list[Stored]) -> None:
        self._notify_keys_deleted([g.key for g in gone], [g.size for g in gone])

    # ------------------------------------------------------------- event fds

    def get_store_event_fd(self) -> int:
        return self._ev["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._ev["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._ev["load"].fileno()

    # ----------------------------------------------------------- task frame

    def _submit(self, kind: str, n: int, fn, *args) -> int:
        tid = next(self._ids)
        task = Task(kind, time.monotonic() + self._cfg.deadline_ms / 1000, n)
        with self._lock:
            self._pending[tid] = task
        if self._closed.is_set():
            self._finish(tid, task, None)
            return tid
        try:
            self._exec.submit(self._run, tid, task, fn, args)
        except RuntimeError:  # executor shut down
            self._finish(tid, task, None)
        return tid

    def _submit_objects(self, kind: str, fn, keys: list[ObjectKey], objects: list) -> int:
        """A store or load task: one object per key."""
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        return self._submit(kind, len(keys), fn, list(keys), list(objects))

    def _run(self, tid: int, task: Task, fn, args) -> None:
        result = None
        try:
            if not task.done:
                result = fn(task, *args)
        except grpc.RpcError as e:
            self._rpc_failed(e)
            log.warning("cxlkv %s task %d failed: %s", task.kind, tid, rpc_error(e))
        except Exception:  # a task must end in failure bits, never kill a worker
            log.exception("cxlkv %s task %d failed", task.kind, tid)
        self._finish(tid, task, result)

    def _finish(self, tid: int, task: Task, result) -> None:
        """Store the result, then signal (the controller resets the fd first)."""
        with self._lock:
            if task.done:
                return
            task.done = True
            self._pending.pop(tid, None)
            if result is None:
                result = L2StoreResult(False, 0) if task.kind == "store" else Bitmap(task.n)
            self._results[task.kind][tid] = result
        self._ev[task.kind].notify()

    def _begin_copy(self, task: Task) -> bool:
        """Enter the copy phase unless the watchdog already failed the task."""
        with self._lock:
            if task.done:
                return False
            task.copying = True
            return True

    def _end_copy(self, task: Task) -> None:
        with self._lock:
            task.copying = False

    def _watchdog(self) -> None:
        """Fails tasks at their deadline. Wakes at the earliest deadline (all
        tasks get the same budget, so a new task never has an earlier one),
        at least every 0.5 s, never on a short fixed tick."""
        wait = 0.05
        while not self._closed.wait(wait):
            now = time.monotonic()
            with self._lock:
                late = [(t, k) for t, k in self._pending.items() if k.deadline < now and not k.copying]
                nxt = min((k.deadline for k in self._pending.values() if k.deadline >= now), default=now + 0.5)
            wait = min(0.5, max(0.001, nxt - now))
            for tid, task in late:
                log.warning("cxlkv %s task %d missed its %d ms deadline", task.kind, tid, self._cfg.deadline_ms)
                self._finish(tid, task, None)

    def _rpc_failed(self, e: grpc.RpcError) -> None:
        self._link.rpc_failed(e)

    # ------------------------------------------------------------------ store

    def submit_store_task(self, keys: list[ObjectKey], objects: list) -> int:
        return self._submit_objects("store", self._store, keys, objects)

    def _store(self, task: Task, keys: list[ObjectKey], objs: list) -> L2StoreResult:
        conn = self._connect(task.deadline)
        by_salt: dict[str, list[int]] = collections.defaultdict(list)
        for i, k in enumerate(keys):
            by_salt[k.cache_salt].append(i)
        ok, written, new = True, 0, []
        carry = not conn.inline and self._cfg.commit_ride_ms > 0  # this task's first Reserve may carry commits
        if carry:
            self._handoff.reserving()
        try:
            for salt, idx in by_salt.items():
                if conn.inline:
                    g_ok, g_written, g_new = self._inline.store(task, [keys[i] for i in idx],
                                                                [objs[i] for i in idx])
                else:
                    g_ok, g_written, g_new = self._store_mapped(task, conn, salt, [keys[i] for i in idx],
                                                                [objs[i] for i in idx], carry)
                    carry = False
                ok, written = ok and g_ok, written + g_written
                new += g_new
        finally:
            if carry:
                self._handoff.skip()
        if new:  # (key, encoded key, size, removal-log seq) per stored key
            self._stored.add(new)
            self._notify_keys_stored([k for k, _, _, _ in new], [s for _, _, s, _ in new])
        return L2StoreResult(ok, written)

    def _verify(self, conn) -> bool:
        return self._cfg.verify_payload or conn.info.require_checksum

    def _store_mapped(self, task, conn, salt, keys, objs, carry=False):
        enc = keycodec.encode_many(keys)
        items = [pb.ReserveItem(key=e, size=o.get_size()) for e, o in zip(enc, objs)]
        t0 = time.perf_counter()
        rep = self._rides.reserve(task, salt, items, self._handoff.take(self._verify(conn)) if carry else [])
        t1 = time.perf_counter()
        ok, new = True, []
        if not self._begin_copy(task):
            self._abort_quietly([r.reservation_id for r in rep.reservations if r.status.code == cl.OK])
            return False, 0, []
        # The pages are ours until the reservation expires: a copy that could
        # still be running then might overwrite another key's bytes.
        margin = min(1.0, conn.info.reservation_timeout_ms / 4000)
        last_copy_start = rep.expires_unix_ms / 1000 - margin
        verify = self._verify(conn)
        ids, crcs, late, todo = [], [], [], []
        try:
            for r, k, e, o in zip(rep.reservations, keys, enc, objs):
                if r.status.code == cl.OK:
                    todo.append((r, k, e, o))
                elif r.status.code != cl.ALREADY_EXISTS:  # exists: stored by someone, counts as done
                    ok = False
            # One batch over the copy threads; an object whose copy could not
            # start before last_copy_start is partial: aborted, never committed.
            skipped = conn.pool.put_many(self._copier, [(r.location, o.data_ptr, r.location.length)
                                                        for r, _, _, o in todo], until=last_copy_start)
            for j, (r, k, e, o) in enumerate(todo):
                if j in skipped:
                    late.append(r.reservation_id)
                    ok = False
                    continue
                if verify:
                    crcs.append(_crc32(o.data_ptr, r.location.length))
                ids.append(r.reservation_id)
                new.append((k, e, r.location.length))
        finally:
            self._end_copy(task)
        self._abort_quietly(late)
        if not ids:
            return ok, 0, []
        conn.pool.publish()  # every put reaches memory before the commit makes it visible
        t2 = time.perf_counter()
        statuses, removed_seq = self._rides.commit(task, ids, crcs)
        self._store_times.add(t1 - t0, t2 - t1, time.perf_counter() - t2)
        done = [(k, e, n, removed_seq) for (k, e, n), st in zip(new, statuses) if st.code == cl.OK]
        return ok and len(done) == len(new), sum(n for _, _, n, _ in done), done

    def _abort_quietly(self, ids: list[int]) -> None:
        if ids:
            try:
                self._stub.Abort(pb.AbortRequest(reservation_ids=ids), timeout=1.0)
            except grpc.RpcError:
                pass  # the sidecar reclaims it after reservation_timeout_ms

    def pop_completed_store_tasks(self) -> dict:
        with self._lock:
            out, self._results["store"] = self._results["store"], {}
        return out

    # ----------------------------------------------------------------- lookup

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], group_layout_descs: dict) -> int:
        if self._conn.info is None or self._closed.is_set():
            return self._submit("lookup", len(keys), self._lookup_task, list(keys))
        # Fast path: an async call whose completion callback finishes the task
        # (no hop through the worker pool).
        enc = keycodec.encode_many(keys)
        tid = next(self._ids)
        task = Task("lookup", time.monotonic() + self._cfg.deadline_ms / 1000, len(keys))
        with self._lock:
            self._pending[tid] = task
        try:
            fut = self._stub.LookupAndLock.future(
                pb.LookupRequest(keys=enc, lock_ttl_ms=self._cfg.lock_ttl_ms,
                                 deadline_unix_ms=server_deadline(task.deadline)),
                timeout=self._cfg.deadline_ms / 1000,
            )
        except Exception:
            log.exception("cxlkv lookup submit failed")
            self._finish(tid, task, None)
            return tid
        fut.add_done_callback(lambda f: self._lookup_done(tid, task, enc, f))
        return tid

    def _lookup_done(self, tid: int, task: Task, enc: list[bytes], fut) -> None:
        result = None
        try:
            result = self._bitmap(self._apply_locks(task, enc, fut.result()))
        except grpc.RpcError as e:
            self._rpc_failed(e)
        except Exception:
            log.exception("cxlkv lookup task %d failed", tid)
        self._finish(tid, task, result)

    @staticmethod
    def _bitmap(hits: list[bool]) -> Bitmap:
        bm = Bitmap(len(hits))
        bm.batched_set([i for i, h in enumerate(hits) if h])
        return bm

    def _lookup_task(self, task: Task, keys: list[ObjectKey]) -> Bitmap:
        return self._bitmap(self._lock_keys(task.deadline, keycodec.encode_many(keys), task))

    def _lock_keys(self, deadline: float, enc: list[bytes], task: Task | None = None) -> list[bool]:
        self._connect(deadline)
        rep = self._stub.LookupAndLock(
            pb.LookupRequest(keys=enc, lock_ttl_ms=self._cfg.lock_ttl_ms, deadline_unix_ms=server_deadline(deadline)),
            timeout=time_left(deadline),
        )
        return self._apply_locks(task, enc, rep)

    def _apply_locks(self, task: Task | None, enc: list[bytes], rep: pb.LookupReply) -> list[bool]:
        """Record the locks a lookup took. If the task already failed (deadline),
        LMCache will never unlock them, so they are released right away."""
        # Treat the lock as gone a little before the sidecar does.
        expires = time.monotonic() + self._cfg.lock_ttl_ms / 1000 * 0.9
        hits = [r.found for r in rep.results]
        with self._lock:
            late = task is not None and task.done
            if not late:
                for k, r in zip(enc, rep.results):
                    if r.found:
                        h = self._held.get(k)
                        if h is None:
                            self._held[k] = Held(1, r.location, expires)
                        else:
                            h.count, h.loc, h.expires = h.count + 1, r.location, expires
        if late:
            found = [k for k, h in zip(enc, hits) if h]
            if found:
                self._unlocks.send(found)
            return [False] * len(enc)
        return hits

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._results["lookup"].pop(task_id, None)

    # ----------------------------------------------------------------- unlock

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Never raises; only keys this adapter locked are released remotely."""
        try:
            self._release(keycodec.encode_many(keys))
        except Exception:
            log.exception("cxlkv unlock bookkeeping failed")

    def _release(self, enc: list[bytes]) -> None:
        send = []
        with self._lock:
            for k in enc:
                h = self._held.get(k)
                if h is None:
                    continue
                h.count -= 1
                if h.count == 0:
                    del self._held[k]
                send.append(k)
        if send:
            self._unlocks.send(send)

    # ------------------------------------------------------------------- load

    def submit_load_task(self, keys: list[ObjectKey], objects: list) -> int:
        return self._submit_objects("load", self._load, keys, objects)

    def _load(self, task: Task, keys: list[ObjectKey], objs: list) -> Bitmap:
        conn = self._connect(task.deadline)
        enc = keycodec.encode_many(keys)
        now = time.monotonic()
        with self._lock:
            missing = [k for k in enc if k not in self._held or self._held[k].expires < now]
        if missing:  # not locked by a lookup (or the lock aged out): lock for this load
            self._lock_keys(task.deadline, missing)
        loaded = []
        try:
            if conn.inline:
                loaded = self._inline.load(task, enc, objs)
            else:
                with self._lock:
                    locs = [self._held[k].loc if k in self._held else None for k in enc]
                if self._begin_copy(task):
                    try:
                        loaded = self._copy_out(conn, locs, objs)
                    finally:
                        self._end_copy(task)
        finally:
            if missing:
                self._release(missing)
        if loaded:
            self._notify_keys_accessed([keys[i] for i in loaded])
        bm = Bitmap(len(keys))
        bm.batched_set(loaded)
        return bm

    def _copy_out(self, conn, locs, objs) -> list[int]:
        """Copy each located object into its buffer; an index is loaded only
        if the object was still there after the copy (same region generation
        and page version: neither a restart nor eviction and reuse of its
        pages, e.g. after its lock ran out mid-copy) and, when verifying, its
        bytes match the crc32 its writer gave."""
        pool, verify, loaded = conn.pool, self._verify(conn), []
        todo = [i for i, (loc, o) in enumerate(zip(locs, objs))
                if loc is not None and loc.length == o.get_size() and pool.still_there(loc)]  # else stale: a miss
        pool.get_many(self._copier, [(objs[i].data_ptr, locs[i], locs[i].length) for i in todo])
        for i in todo:
            loc, o = locs[i], objs[i]
            if not pool.still_there(loc):
                log.warning("cxlkv object at region %d offset %d changed during the copy: a miss",
                            loc.region, loc.offset)
                continue
            if verify:
                want = pool.crc(loc)
                if (want is None and conn.info.require_checksum) or (
                        want is not None and _crc32(o.data_ptr, loc.length) != want):
                    log.warning("cxlkv payload checksum mismatch at region %d offset %d: a miss",
                                loc.region, loc.offset)
                    continue
            loaded.append(i)
        return loaded

    def query_load_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._results["load"].pop(task_id, None)

    # --------------------------------------------------- delete / list / usage

    def delete(self, keys: list[ObjectKey]) -> None:
        enc = keycodec.encode_many(keys)
        try:
            rep = self._stub.Delete(pb.DeleteRequest(keys=enc), timeout=self._cfg.deadline_ms / 1000)
        except grpc.RpcError as e:
            self._rpc_failed(e)
            log.warning("cxlkv delete of %d keys failed: %s", len(keys), rpc_error(e))
            return
        gone = self._stored.remove([k for k, s in zip(enc, rep.statuses) if s.code == cl.OK])
        if gone:
            self._report_deleted(gone)

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None):
        if not isinstance(page_size, int) or page_size <= 0 or page_size > 10_000:
            raise ValueError(f"page_size must be 1..10000, got {page_size!r}")
        try:
            start = int(cursor) if cursor else 0
            if start < 0:
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(f"malformed cursor {cursor!r}") from None
        rep = self._stub.ListKeys(pb.ListKeysRequest(page_size=page_size, cursor=start),
                                  timeout=self._cfg.deadline_ms / 1000)
        entries = []
        for ki in rep.keys:
            k = keycodec.decode(ki.key)
            if k is None or (model_name is not None and k.model_name != model_name):
                continue
            entries.append(KeyEntry(key=k.to_encoded_object_key(), size_bytes=ki.size))
        return KeyListPage(entries=tuple(entries), next_page_token=str(rep.next_cursor) if rep.next_cursor else None)

    def report_status(self) -> dict:
        c = self._conn
        with self._lock:
            pending = collections.Counter(t.kind for t in self._pending.values())
            held = len(self._held)
        return {
            "is_healthy": c.healthy and self._watch.serving and not self._closed.is_set(),
            "type": "cxlkv",
            "endpoint": self._cfg.tcp_address or f"unix:{self._cfg.socket}",
            "mode": "inline" if c.inline else ("mmap" if c.pool else "not connected"),
            "copy": cl.COPY,
            "pool_path": c.info.path if c.info else None,
            "pool_uuid": c.info.pool_uuid if c.info else None,
            "capacity_bytes": self._max_capacity_bytes,
            "locked_key_count": held,
            "inflight_store_tasks": pending["store"],
            "inflight_lookup_tasks": pending["lookup"],
            "inflight_load_tasks": pending["load"],
            "pending_unlocks": self._unlocks.pending(),
            "store_phase_s": self._store_times.snapshot(),
            "last_error": c.last_error,
        }

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._feed.poll_soon()
        self._unlocks.wake()
        self._watch.close()
        self._exec.shutdown(wait=True, cancel_futures=True)
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:
            pending = list(self._pending.items())
        for tid, task in pending:
            self._finish(tid, task, None)
        self._copier.close()
        self._link.close()
        for ev in self._ev.values():
            ev.close()
