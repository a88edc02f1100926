"""``CxlKvL2Adapter``: LMCache L2 adapter backed by the cxlkv sidecar.

A face of the shared client (core.py): the task frame (event fds, deadlines,
the watchdog) and LMCache's accounting live here; keys' locks, copies,
coherence and restarts live in `Core`.

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
import itertools
import logging
import threading
import time

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
from cxlkv_lmcache.core import Core
from cxlkv_lmcache.state import Conn, Stored, Task, rpc_error, server_deadline
from cxlkv_lmcache.tokens import MpTokens

__all__ = ["CxlKvL2Adapter", "CxlKvL2AdapterConfig"]

log = logging.getLogger("cxlkv_lmcache")


class CxlKvL2Adapter(L2AdapterInterface):
    """LMCache's interface over the shared client (`Core`: the connection
    and pool mapping, the inline path, commits riding on another store's
    Reserve, the removal feed, the health watch, locks and unlocks). The
    adapter itself runs the tasks (deadlines, the watchdog), keeps the locks
    a lookup takes until LMCache unlocks them, and keeps LMCache's byte
    accounting (the core's ledger)."""

    config_class_name = "CxlKvL2AdapterConfig"

    def __init__(self, config: CxlKvL2AdapterConfig | dict, **kwargs):
        if isinstance(config, dict):
            config = CxlKvL2AdapterConfig.from_dict(config)
        self._cfg = config
        super().__init__(max_capacity_bytes=int(config.max_capacity_gb * (1 << 30)))
        self._l1_desc = kwargs.get("l1_memory_desc")
        self._ev = {k: create_event_notifier() for k in ("store", "lookup", "load")}
        self._ids = itertools.count(1)
        self._pending: dict[int, Task] = {}
        self._results: dict[str, dict] = {"store": {}, "lookup": {}, "load": {}}
        self._core = core = Core(config, self._took_info, self._report_deleted)
        # The token ids LMCache's server publishes at each store, for the
        # sidecar's events (tokens.py).
        self._tokens = MpTokens()
        # The core's parts the task frame and the status use, and the ones
        # the tests reach through the adapter (held locks, the stub, the
        # link, commit rides and handoffs, the unlocker).
        self._lock = core.lock
        self._held = core.held
        self._closed = core.closed
        self._link = core.link
        self._stub = core.stub
        self._unlocks = core.unlocks
        self._handoff = core.handoff
        self._rides = core.rides
        self._store_times = core.store_times
        self._exec = core.exec
        self._threads = [threading.Thread(target=self._watchdog, name="cxlkv-watchdog", daemon=True), *core.threads]
        self._threads[0].start()
        core.start()

    # ------------------------------------------------------------------ setup

    @property
    def _conn(self) -> Conn:
        """The link's current Conn: a reconnect replaces it, so never keep one."""
        return self._link.conn

    def _took_info(self, info: pb.PoolInfoReply) -> None:
        """max_capacity_gb 0: LMCache's capacity is what the sidecar lets this node own."""
        if self._cfg.max_capacity_gb == 0:
            self._max_capacity_bytes = info.capacity_bytes

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
            self._core.rpc_failed(e)
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

    # ------------------------------------------------------------------ store

    def submit_store_task(self, keys: list[ObjectKey], objects: list) -> int:
        return self._submit_objects("store", self._store, keys, objects)

    def _store(self, task: Task, keys: list[ObjectKey], objs: list) -> L2StoreResult:
        enc = keycodec.encode_many(keys)
        if len(self._tokens.bindings):
            self._core.add_token_fields(enc, self._tokens.fields(keys, keycodec.encode))
        by_salt: dict[str, list] = collections.defaultdict(list)
        for k, e, o in zip(keys, enc, objs):
            by_salt[k.cache_salt].append((k, e, o.data_ptr, o.get_size()))
        ok, written, new = self._core.store(task, list(by_salt.items()))
        if new:  # (key, encoded key, size, removal-log seq) per stored key
            self._notify_keys_stored([k for k, _, _, _ in new], [s for _, _, s, _ in new])
        return L2StoreResult(ok, written)

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
            result = self._bitmap(self._core.apply_locks(task, enc, fut.result()))
        except grpc.RpcError as e:
            self._core.rpc_failed(e)
        except Exception:
            log.exception("cxlkv lookup task %d failed", tid)
        self._finish(tid, task, result)

    @staticmethod
    def _bitmap(hits: list[bool]) -> Bitmap:
        bm = Bitmap(len(hits))
        bm.batched_set([i for i, h in enumerate(hits) if h])
        return bm

    def _lookup_task(self, task: Task, keys: list[ObjectKey]) -> Bitmap:
        return self._bitmap(self._core.lock_keys(task.deadline, keycodec.encode_many(keys), task))

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._results["lookup"].pop(task_id, None)

    # ----------------------------------------------------------------- unlock

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Never raises; only keys this adapter locked are released remotely."""
        try:
            self._core.release(keycodec.encode_many(keys))
        except Exception:
            log.exception("cxlkv unlock bookkeeping failed")

    # ------------------------------------------------------------------- load

    def submit_load_task(self, keys: list[ObjectKey], objects: list) -> int:
        return self._submit_objects("load", self._load, keys, objects)

    def _load(self, task: Task, keys: list[ObjectKey], objs: list) -> Bitmap:
        loaded = self._core.load(task, keycodec.encode_many(keys), [(o.data_ptr, o.get_size()) for o in objs])
        if loaded:
            self._notify_keys_accessed([keys[i] for i in loaded])
        bm = Bitmap(len(keys))
        bm.batched_set(loaded)
        return bm

    def query_load_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._results["load"].pop(task_id, None)

    # --------------------------------------------------- delete / list / usage

    def delete(self, keys: list[ObjectKey]) -> None:
        try:
            self._core.delete(keycodec.encode_many(keys))
        except grpc.RpcError as e:
            self._core.rpc_failed(e)
            log.warning("cxlkv delete of %d keys failed: %s", len(keys), rpc_error(e))

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None):
        if not isinstance(page_size, int) or page_size <= 0 or page_size > 10_000:
            raise ValueError(f"page_size must be 1..10000, got {page_size!r}")
        try:
            start = int(cursor) if cursor else 0
            if start < 0:
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(f"malformed cursor {cursor!r}") from None
        rep = self._core.list_keys(page_size, start)
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
            "is_healthy": self._core.healthy(),
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
            # Stores the sidecar's admission declined: skipped, never copied.
            "not_admitted_stores": self._core.not_admitted,
            "last_error": c.last_error,
        }

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._core.close()
        if self._threads[0].is_alive():
            self._threads[0].join(timeout=5)
        with self._lock:
            pending = list(self._pending.items())
        for tid, task in pending:
            self._finish(tid, task, None)
        self._core.close_io()
        for ev in self._ev.values():
            ev.close()
