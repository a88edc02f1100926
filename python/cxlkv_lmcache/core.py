"""The one client of the cxlkv sidecar that every LMCache face uses.

LMCache reaches cxlkv three ways, each a thin layer over this core:

- ``adapter.CxlKvL2Adapter``: the multiprocess server's L2 adapter (tasks,
  event fds, a watchdog);
- ``backend.CxlKvBackend``: the in-process engine's storage plugin, whose
  memory objects are views of pool pages;
- ``connector.CxlKvConnector``: the in-process engine's remote connector
  (``remote_storage_plugins`` / ``external://``), one copy each way.

The core owns everything they share, once: the connection and the pool
mapping (`Link`), keys' locks and their unlocks (`held`, `Unlocks`), the
copies (`Copier`, ``PoolMap``) with the coherence rules, the store sequence
(Reserve → copy → publish → Commit, commits riding on the next Reserve), the
checks after a read (region generation and page version, the writer's
crc32), the removal feed and the health watch that notice restarts and
failovers. Byte counts and keys stay the caller's: items are
``(token, encoded key, address, size)`` and results name the token.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc

from cxlkv_lmcache import client as cl
from cxlkv_lmcache.client import crc32_at
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.copies import Copier
from cxlkv_lmcache.feed import RemovalFeed
from cxlkv_lmcache.handoff import CommitRides, Handoff
from cxlkv_lmcache.inline import InlinePath
from cxlkv_lmcache.leases import Leases
from cxlkv_lmcache.mapped import Item, MappedStores
from cxlkv_lmcache.link import Link
from cxlkv_lmcache.state import Conn, Held, Ledger, Stored, StoreTimes, Task, rpc_error, server_deadline, time_left
from cxlkv_lmcache.unlocks import Unlocks
from cxlkv_lmcache.watch import HealthWatch

log = logging.getLogger("cxlkv_lmcache")

class Restarted(Exception):
    """The sidecar that answered is another instance than the one the
    caller's locks came from (see `Core.renew`)."""


class Core:
    """See the module doc. `on_restart` callbacks run when the sidecar lost
    its registry (locks and locations of the old instance are void);
    `on_deleted` sees keys the removal feed or a delete took out of the
    ledger (the L2 adapter's byte accounting)."""

    def __init__(self, cfg, on_info: Callable[[pb.PoolInfoReply], None] | None = None,
                 on_deleted: Callable[[list[Stored]], None] | None = None,
                 on_map: Callable[[cl.PoolMap | None, cl.PoolMap], None] | None = None, session: str = ""):
        self.cfg = cfg
        self.lock = threading.Lock()  # tasks' done/copying flags and `held`
        self.closed = threading.Event()
        self.held: dict[bytes, Held] = {}
        self.ledger = Ledger()
        self._on_info = on_info
        self._on_deleted = on_deleted
        self._restart_hooks: list[Callable[[], None]] = []
        self.link = Link(cfg, self._took_info, on_map, session)
        self.stub = self.link.stub
        self.unlocks = Unlocks(self.link, cfg.unlock_retry_s, self.closed)
        self.feed = RemovalFeed(self.link, self.ledger, self.restarted, self._report_deleted,
                                cfg.poll_interval_ms / 1000, self.closed)
        self.watch = HealthWatch(self.link, self.feed.poll_soon, self.closed)
        self.copier = Copier(cfg.copy_threads)
        self.handoff = Handoff()
        # enc -> ReserveItem token fields, set by a caller just before it
        # stores those keys (tokens.py), taken by the store.
        self.token_fields: dict[bytes, dict] = {}
        self.rides = CommitRides(self.stub, self.handoff, cfg.commit_ride_ms)
        self.leases = Leases(self.stub, cfg.lease_ahead_bytes)
        self.mapped = MappedStores(self)
        self.store_times = StoreTimes()
        # Stores the sidecar's admission declined (skipped, never copied).
        self.not_admitted = 0
        self.inline = InlinePath(self.stub, self.begin_copy, self.end_copy, self._declined)
        self.exec = ThreadPoolExecutor(cfg.workers, thread_name_prefix="cxlkv-task")
        try:
            self.connect(time.monotonic() + cfg.connect_timeout_ms / 1000, wait=True)
        except grpc.RpcError as e:
            log.warning("cxlkv sidecar not reachable at start-up (%s); will retry", rpc_error(e))
        self.threads = [
            threading.Thread(target=self.unlocks.run, name="cxlkv-unlock", daemon=True),
            threading.Thread(target=self.feed.run, name="cxlkv-poll", daemon=True),
            threading.Thread(target=self.watch.run, name="cxlkv-watch", daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    # ------------------------------------------------------------ connection

    @property
    def conn(self) -> Conn:
        """The link's current Conn: a reconnect replaces it, so never keep one."""
        return self.link.conn

    def connect(self, deadline: float, wait: bool = False) -> Conn:
        return self.link.connect(deadline, wait)

    def _took_info(self, info: pb.PoolInfoReply) -> None:
        if self._on_info is not None:
            self._on_info(info)

    def on_restart(self, hook: Callable[[], None]) -> None:
        self._restart_hooks.append(hook)

    def restarted(self) -> None:
        """The sidecar lost its registry: drop locations and locks, then tell
        the faces (a view of an old location must be checked again)."""
        self.link.forget()
        with self.lock:
            self.held.clear()
            self.conn.unlock_q.clear()
        self.leases.drop()
        for hook in self._restart_hooks:
            try:
                hook()
            except Exception:
                log.exception("cxlkv restart hook failed")

    def _report_deleted(self, gone: list[Stored]) -> None:
        if self._on_deleted is not None:
            self._on_deleted(gone)

    def rpc_failed(self, e: grpc.RpcError) -> None:
        self.link.rpc_failed(e)

    def healthy(self) -> bool:
        return self.conn.healthy and self.watch.serving and not self.closed.is_set()

    def verify(self, conn: Conn) -> bool:
        return self.cfg.verify_payload or conn.info.require_checksum

    def _declined(self) -> None:
        self.not_admitted += 1

    # ------------------------------------------------------------ copy gate

    def begin_copy(self, task: Task) -> bool:
        """Enter the copy phase unless the task already failed (its deadline:
        the caller's buffers may be reused by now)."""
        with self.lock:
            if task.done:
                return False
            task.copying = True
            return True

    def end_copy(self, task: Task) -> None:
        with self.lock:
            task.copying = False

    def task(self, kind: str, n: int, deadline_ms: int | None = None) -> Task:
        return Task(kind, time.monotonic() + (deadline_ms or self.cfg.deadline_ms) / 1000, n)

    # ------------------------------------------------------------------ store

    def store(self, task: Task, groups: list[tuple[str, list[Item]]], account: bool = True,
              present: set | None = None) -> tuple[bool, int, list]:
        """Store each tenant's items (token, enc, src, size): Reserve → copy
        → publish → Commit on the mapped path, else streamed inline. Returns
        (all stored, already there or not admitted, bytes written, (token,
        enc, size, removal-log seq) per newly stored key), and adds those to
        the ledger when `account` (the L2 adapter reports LMCache's byte
        usage from it). Keys the sidecar already had go into `present` when
        given. A key the sidecar's admission declined is a skipped store: not
        a failure, nothing reserved or copied, not stored."""
        conn = self.connect(task.deadline)
        ok, written, new = True, 0, []
        carry = not conn.inline and self.cfg.commit_ride_ms > 0  # this task's first Reserve may carry commits
        if carry:
            self.handoff.reserving()
        try:
            for tenant, items in groups:
                if conn.inline:
                    g_ok, g_written, g_new = self.inline.store(task, tenant, items, present)
                else:
                    g_ok, g_written, g_new = self.store_mapped(task, conn, tenant, items, carry, present)
                    carry = False
                ok, written = ok and g_ok, written + g_written
                new += g_new
        finally:
            if carry:
                self.handoff.skip()
            self.drop_token_fields(groups)
        if new and account:
            self.ledger.add(new)
        return ok, written, new

    def drop_token_fields(self, groups) -> None:
        """Token fields of keys a store took, or gave up on, go."""
        if self.token_fields:
            for _, items in groups:
                for it in items:
                    self.token_fields.pop(it[1], None)

    def add_token_fields(self, encs: list[bytes], fields: list[dict]) -> None:
        """Token ids (and parent keys) for the next store of these keys."""
        for e, f in zip(encs, fields):
            if f:
                self.token_fields[e] = f

    def reserve(self, task: Task, tenant: str, items: list, carry: bool = False) -> pb.ReserveReply:
        """One Reserve of pb.ReserveItems, carrying waiting commits when
        `carry` (the caller announced it with `handoff.reserving()`); the
        sidecar's admission judges the items."""
        rides = self.handoff.take(self.verify(self.conn)) if carry else []
        return self.rides.reserve(task, tenant, items, rides)

    def store_begin(self, task: Task, groups: list[tuple[str, list[Item]]],
                    present: set | None = None) -> Callable[[], tuple[bool, int, list]]:
        """The first half of `store` (account=False): every group reserved
        and copied before this returns, so the sources may be reused or freed
        then; the function returned commits them and returns what `store`
        does. (Through the inline path the sidecar reads the sources while
        it streams: that is all done before this returns.)"""
        conn = self.connect(task.deadline)
        if conn.inline:
            done = self.store(task, groups, account=False, present=present)
            return lambda: done
        parts = []
        carry = self.cfg.commit_ride_ms > 0
        if carry:
            self.handoff.reserving()
        try:
            for tenant, items in groups:
                parts.append(self.mapped.reserve_and_copy(task, conn, tenant, items, carry, present))
                carry = False
        finally:
            if carry:
                self.handoff.skip()
            self.drop_token_fields(groups)

        def finish() -> tuple[bool, int, list]:
            ok, written, new = True, 0, []
            for part in parts:
                g_ok, g_written, g_new = self.mapped.commit_copied(task, part)
                ok, written, new = ok and g_ok, written + g_written, new + g_new
            return ok, written, new

        return finish

    def store_mapped(self, task: Task, conn: Conn, tenant: str, items: list[Item], carry: bool = False,
                     present: set | None = None):
        return self.mapped.store(task, conn, tenant, items, carry, present)

    def commit(self, task: Task, ids: list[int], crcs: list[int]):
        return self.rides.commit(task, ids, crcs)

    def abort_quietly(self, ids: list[int]) -> None:
        if ids:
            try:
                self.stub.Abort(pb.AbortRequest(reservation_ids=ids), timeout=1.0)
            except grpc.RpcError:
                pass  # the sidecar reclaims it after reservation_timeout_ms

    # ----------------------------------------------------------------- locks

    def lookup_request(self, enc: list[bytes], deadline: float) -> pb.LookupRequest:
        return pb.LookupRequest(keys=enc, lock_ttl_ms=self.cfg.lock_ttl_ms, deadline_unix_ms=server_deadline(deadline))

    def lock_keys(self, deadline: float, enc: list[bytes], task: Task | None = None) -> list[bool]:
        """LookupAndLock: per key, found and locked (recorded in `held`)."""
        return self.lock_keys_ex(deadline, enc, task)[0]

    def lock_keys_ex(self, deadline: float, enc: list[bytes], task: Task | None = None) -> tuple[list[bool], bool]:
        """As `lock_keys`, and whether some key was refused because this
        client holds as much as the sidecar lets one client pin."""
        self.connect(deadline)
        sent = time.monotonic()
        rep = self.stub.LookupAndLock(self.lookup_request(enc, deadline), timeout=time_left(deadline))
        over = any(r.status.code == cl.RESOURCE_EXHAUSTED for r in rep.results)
        return self.apply_locks(task, enc, rep, sent), over

    def lock_expiry(self, sent: float) -> float:
        """When a lock asked for at `sent` (monotonic) is to be treated as
        gone: a little before the sidecar's TTL, counted from the send (the
        sidecar's clock starts later), so the client errs early."""
        return sent + self.cfg.lock_ttl_ms / 1000 * 0.9

    def apply_locks(self, task: Task | None, enc: list[bytes], rep: pb.LookupReply,
                    sent: float | None = None) -> list[bool]:
        """Record the locks a lookup sent at `sent` took. If the task already
        failed (deadline), nobody will unlock them, so they are released
        right away."""
        expires = self.lock_expiry(time.monotonic() if sent is None else sent)
        hits = [r.found for r in rep.results]
        with self.lock:
            late = task is not None and task.done
            if not late:
                for k, r in zip(enc, rep.results):
                    if r.found:
                        h = self.held.get(k)
                        if h is None:
                            self.held[k] = Held(1, r.location, expires)
                        else:
                            h.count, h.loc, h.expires = h.count + 1, r.location, expires
        if late:
            found = [k for k, h in zip(enc, hits) if h]
            if found:
                self.unlocks.send(found)
            return [False] * len(enc)
        return hits

    def location(self, enc: bytes) -> pb.Location | None:
        with self.lock:
            h = self.held.get(enc)
            return h.loc if h is not None else None

    def release(self, enc: list[bytes]) -> None:
        """One unlock per key this client holds a lock on (others: nothing)."""
        send = []
        with self.lock:
            for k in enc:
                h = self.held.get(k)
                if h is None:
                    continue
                h.count -= 1
                if h.count == 0:
                    del self.held[k]
                send.append(k)
        if send:
            self.unlocks.send(send)

    def forget(self, enc: bytes) -> None:
        """Stop counting locks on `enc` without unlocking: they are gone
        (or left to lapse)."""
        with self.lock:
            self.held.pop(enc, None)

    def renew(self, enc: list[bytes], deadline: float) -> list[pb.Location | None]:
        """Extend the locks this client holds on `enc` without ever letting
        one go: a LookupAndLock first (a second lock, a fresh expiry), then
        one Unlock each. Per key, its location now, or None where the key
        is gone (its old lock gave no protection any more: a miss).
        `Restarted` if the locks were taken from another sidecar instance
        than the one that granted the old ones (which are gone with it): the
        restart hooks then run, and the new locks are given back."""
        instance = self.conn.instance
        sent = time.monotonic()
        rep = self.stub.LookupAndLock(self.lookup_request(enc, deadline), timeout=time_left(deadline))
        if rep.instance_id and instance and rep.instance_id != instance:
            self.restarted()  # its hooks lock what they need again
            found = [k for k, r in zip(enc, rep.results) if r.found]
            if found:  # a lock each on the new instance that nobody counts
                try:
                    self.stub.Unlock(pb.UnlockRequest(keys=found), timeout=time_left(deadline))
                except grpc.RpcError:
                    pass  # they lapse at their TTL
            raise Restarted()
        expires = self.lock_expiry(sent)
        out, extra = [], []
        with self.lock:
            for k, r in zip(enc, rep.results):
                if not r.found:
                    out.append(None)
                    continue
                extra.append(k)
                h = self.held.get(k)
                if h is None:  # released meanwhile: the new lock is the only one, give it back
                    out.append(r.location)
                    continue
                h.loc, h.expires = r.location, expires
                out.append(r.location)
        if extra:
            self.unlocks.send(extra)
        return out

    # ------------------------------------------------------------------- load

    def load(self, task: Task, enc: list[bytes], dsts: list[tuple[int, int]]) -> list[int]:
        """Fill each (address, size) with its key's object; the indices that
        loaded. Keys not already locked (by a lookup) are locked for the copy
        and released after it."""
        conn = self.connect(task.deadline)
        now = time.monotonic()
        with self.lock:
            missing = [k for k in enc if k not in self.held or self.held[k].expires < now]
        if missing:
            self.lock_keys(task.deadline, missing)
        loaded = []
        try:
            if conn.inline:
                loaded = self.inline.load(task, enc, dsts)
            else:
                with self.lock:
                    locs = [self.held[k].loc if k in self.held else None for k in enc]
                if self.begin_copy(task):
                    try:
                        loaded = self.copy_out(conn, locs, dsts)
                    finally:
                        self.end_copy(task)
        finally:
            if missing:
                self.release(missing)
        return loaded

    def copy_out(self, conn: Conn, locs: list, dsts: list[tuple[int, int]]) -> list[int]:
        """Copy each located object into its (address, size); an index is
        loaded only if the object was still there after the copy (same
        region generation and page version: neither a restart nor eviction
        and reuse of its pages, e.g. after its lock ran out mid-copy) and,
        when verifying, its bytes match the crc32 its writer gave."""
        pool, loaded = conn.pool, []
        todo = [i for i, (loc, (_, n)) in enumerate(zip(locs, dsts))
                if loc is not None and loc.length == n and pool.still_there(loc)]  # else stale: a miss
        pool.get_many(self.copier, [(dsts[i][0], locs[i], locs[i].length) for i in todo])
        for i in todo:
            if self.checked(conn, locs[i], dsts[i][0]):
                loaded.append(i)
        return loaded

    def checked(self, conn: Conn, loc: pb.Location, addr: int) -> bool:
        """After reading the object at `loc` (bytes now at `addr`): still
        that object, and its bytes the ones its writer vouched for."""
        pool = conn.pool
        if not pool.still_there(loc):
            log.warning("cxlkv object at region %d offset %d changed during the copy: a miss", loc.region, loc.offset)
            return False
        if self.verify(conn):
            want = pool.crc(loc)
            if (want is None and conn.info.require_checksum) or (
                    want is not None and crc32_at(addr, loc.length) != want):
                log.warning("cxlkv payload checksum mismatch at region %d offset %d: a miss", loc.region, loc.offset)
                return False
        return True

    # ----------------------------------------------------- delete / exists

    def delete(self, enc: list[bytes], timeout: float | None = None) -> list[bool]:
        """Delete keys; per key, whether it was deleted (not found, locked or
        refused: False). Keys this client accounted for are reported gone."""
        rep = self.stub.Delete(pb.DeleteRequest(keys=enc), timeout=timeout or self.cfg.deadline_ms / 1000)
        deleted = [s.code == cl.OK for s in rep.statuses]
        gone = self.ledger.remove([k for k, d in zip(enc, deleted) if d])
        if gone:
            self._report_deleted(gone)
        return deleted

    def exists(self, enc: list[bytes], deadline: float) -> list[bool]:
        self.connect(deadline)
        rep = self.stub.Exists(pb.ExistsRequest(keys=enc), timeout=time_left(deadline))
        return list(rep.exists)

    def list_keys(self, page_size: int, cursor: int, timeout: float | None = None) -> pb.ListKeysReply:
        return self.stub.ListKeys(pb.ListKeysRequest(page_size=page_size, cursor=cursor),
                                  timeout=timeout or self.cfg.deadline_ms / 1000)

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Stop the threads, then close the channel (the sidecar releases
        this connection's locks) and unmap the pool."""
        if self.closed.is_set():
            return
        self.closed.set()
        self.feed.poll_soon()
        self.unlocks.wake()
        self.watch.close()
        self.exec.shutdown(wait=True, cancel_futures=True)
        self.mapped.close()  # after the tasks: they wait for its commits
        for t in self.threads:
            if t.is_alive():
                t.join(timeout=5)

    def close_io(self, unmap: bool = True) -> None:
        """After close() and after the faces finished their tasks."""
        self.copier.close()
        self.unlocks.quiesce()
        self.leases.give_back()
        self.link.close(unmap)
