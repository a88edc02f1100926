"""The in-process backend's zero-copy hits: views of pool pages that
LMCache's L1 keeps, and what keeps each one safe to read.

A view may be read only while its pages cannot be reused, and that is
while the sidecar holds a lock on its key. Each lock this backend holds is
a `Lease`: the views and pins of a key share the key's current lease (one
sidecar lock), and its last user gives the lock back. The backend's session
is durable (its locks outlive a connection; a restarted sidecar removes
nothing until they could have lapsed: docs/ARCHITECTURE.md), so the only
ways a lease ends are its users leaving, this client's own clock, and a
location found changed. A thread (`Views.run`) keeps the rest true:

- renewal: the key of every current lease is locked again before half its
  TTL is left (LookupAndLock, then one Unlock: never unlocked in between);
- the budget: views not read for `view_idle_ms`, then the least recently
  read past `max_view_bytes`, are retired: out of LMCache's L1 and never
  renewed again, so their lock goes with their last reference, or lapses
  (a get past the budget sheds too, down to three quarters of it);
- the lease's end: a current lease whose renewal did not succeed in time is
  retired, and a retired one is lapsed (its views invalidated, out of L1)
  before the sidecar's expiry, by this client's clock, which errs early.

A key found again elsewhere (renewal, or after a sidecar restart) loses
its leases at once: views out of L1 and invalidated (doubt is a miss).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Callable

from lmcache.v1.memory_management import TensorMemoryObj

from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.core import Core

log = logging.getLogger("cxlkv_lmcache")


class Lease:
    """One sidecar lock this backend holds on `enc`, shared by its users
    (views and pins). `lost`: the lock is gone or given back (nothing left to
    unlock); `retired`: kept only until its users leave, never renewed."""

    __slots__ = ("enc", "loc", "users", "views", "retired", "lost", "used", "__weakref__")

    def __init__(self, enc: bytes, loc: pb.Location):
        self.enc, self.loc = enc, loc
        self.users = 0
        self.views: weakref.WeakSet = weakref.WeakSet()
        self.retired = self.lost = False
        self.used = time.monotonic()  # last shared or pinned (views say when they were read)

    def place(self) -> tuple:
        return self.loc.region, self.loc.offset, self.loc.length, self.loc.version


class Slot:
    """What a view stands for: its key, its lease, LMCache's key (to take it
    out of L1)."""

    __slots__ = ("enc", "lease", "key", "loc")

    def __init__(self, lease: Lease, key: Any):
        self.enc, self.lease, self.key, self.loc = lease.enc, lease, key, lease.loc


class PoolView(TensorMemoryObj):
    """A hit: a TensorMemoryObj over pool pages. LMCache's L1 calls
    `ref_count_up` on every hit it serves, so that is when it was last read."""

    def __init__(self, raw, meta, allocator, slot: Slot):
        super().__init__(raw, meta, allocator)
        self._cxlkv = slot
        self.last_read = time.monotonic()
        # LMCache frees an object at its last ref_count_down and again when
        # it is collected: its lease user is given back once.
        self.given = False

    def ref_count_up(self):
        self.last_read = time.monotonic()
        super().ref_count_up()


class Views:
    """The leases of one backend, its views and pins, and their upkeep."""

    def __init__(self, core: Core, l1, max_view_bytes: int, idle_ms: int):
        self._core = core
        self._l1 = l1  # LMCache's LocalCPUBackend (or None)
        self._max_cfg = max_view_bytes
        self._idle = idle_ms / 1000
        self.ttl = core.cfg.lock_ttl_ms / 1000
        self.period = max(0.05, min(self.ttl / 6, 1.0))
        self._lock = threading.Lock()
        self._current: dict[bytes, Lease] = {}
        # Bytes of the current leases: at least those of the views kept, so
        # a get under it needs no look at them (`over_budget`).
        self._current_bytes = 0
        self._retired: dict[bytes, list[Lease]] = {}
        self._pins: dict[bytes, list[Lease]] = {}

    # ------------------------------------------------------------ leases

    def shared(self, enc: bytes) -> Lease | None:
        """The key's current lease with one more user, if it is fresh
        enough to lend (a quarter of the TTL left): no lookup needed."""
        now = time.monotonic()
        with self._lock, self._core.lock:
            lease, held = self._current.get(enc), self._core.held.get(enc)
            if lease is None or held is None or held.expires - now < self.ttl / 4:
                return None
            lease.users += 1
            lease.used = now
            return lease

    def locked(self, enc: bytes) -> Lease | None:
        """A lock a lookup just took on `enc` (recorded in the core), as a
        lease with one user: the key's current one when it has a usable one
        (the extra lock goes back at once), else a new current one."""
        loc = self._core.location(enc)
        if loc is None:
            return None
        with self._lock:
            cur = self._current.get(enc)
            share = cur is not None and cur.place() == (loc.region, loc.offset, loc.length, loc.version)
            if share:
                cur.users += 1
                cur.used = time.monotonic()
            else:
                if cur is not None:  # the key moved: the old lease's views are doubt
                    self._retire_locked(cur)
                cur = self._current[enc] = Lease(enc, loc)
                self._current_bytes += loc.length
                cur.users = 1
        if share:
            self._core.release([enc])
        return cur

    def join(self, lease: Lease) -> bool:
        """One more user of a lease this caller already uses (False: it was
        given back meanwhile)."""
        with self._lock:
            if lease.lost or lease.users <= 0:
                return False
            lease.users += 1
            return True

    def give(self, lease: Lease) -> None:
        """A user of `lease` is done; the last gives its lock back."""
        with self._lock:
            lease.users -= 1
            if lease.users > 0:
                return
            last, lease.lost = not lease.lost, True
            self._forget_locked(lease)
        if last:
            self._core.release([lease.enc])

    def add_view(self, view: PoolView) -> None:
        with self._lock:
            view._cxlkv.lease.views.add(view)

    def freed(self, view: PoolView) -> None:
        """The view's last reference went (its allocator's `free`)."""
        lease = view._cxlkv.lease
        with self._lock:
            lease.views.discard(view)
            if view.given:
                return
            view.given = True
        self.give(lease)

    def pin(self, lease: Lease) -> None:
        with self._lock:
            self._pins.setdefault(lease.enc, []).append(lease)

    def unpin(self, enc: bytes) -> bool:
        with self._lock:
            stack = self._pins.get(enc)
            if not stack:
                return False
            lease = stack.pop()
            if not stack:
                del self._pins[enc]
        self.give(lease)
        return True

    def _forget_locked(self, lease: Lease) -> None:
        if self._current.get(lease.enc) is lease:
            del self._current[lease.enc]
            self._current_bytes -= lease.loc.length
        old = self._retired.get(lease.enc)
        if old is not None and lease in old:
            old.remove(lease)
            if not old:
                del self._retired[lease.enc]

    # -------------------------------------------------- ending protection

    def _retire_locked(self, lease: Lease) -> list:
        """No new user shares it and it is not renewed; its views leave L1
        (returned, for the caller to take out outside the lock)."""
        if lease.retired or lease.lost:
            return []
        lease.retired = True
        if self._current.get(lease.enc) is lease:
            del self._current[lease.enc]
            self._current_bytes -= lease.loc.length
        self._retired.setdefault(lease.enc, []).append(lease)
        return list(lease.views)

    def retire(self, enc: bytes, why: str) -> None:
        with self._lock:
            lease = self._current.get(enc)
            views = self._retire_locked(lease) if lease is not None else []
        self._out_of_l1(views, why, invalidate=False)

    def lose(self, enc: bytes, why: str) -> None:
        """Every lock of `enc` is void (or about to be): its views out of L1
        and invalid, nothing left to unlock."""
        with self._lock:
            cur = self._current.pop(enc, None)
            if cur is not None:
                self._current_bytes -= cur.loc.length
            leases = [x for x in [cur, *self._retired.pop(enc, [])] if x is not None]
            for lease in leases:
                lease.retired = lease.lost = True
            self._pins.pop(enc, None)
            views = [v for lease in leases for v in lease.views]
        self._core.forget(enc)
        self._out_of_l1(views, why, invalidate=True)

    def _out_of_l1(self, views: list, why: str, invalidate: bool) -> None:
        if not views:
            return
        log.info("cxlkv: %d view(s) of a chunk leave LMCache's L1: %s", len(views), why)
        for v in views:
            key = v._cxlkv.key
            if self._l1 is not None and key is not None:
                try:
                    with self._l1.cpu_lock:
                        same = self._l1.hot_cache.get(key) is v
                    if same:  # only this very object: L1 may hold its own copy of the key
                        self._l1.remove(key, force=True)
                except Exception:
                    log.exception("cxlkv: cannot take a view out of LMCache's L1")
            if invalidate:
                v.invalidate()

    # ------------------------------------------------------------ upkeep

    def budget(self) -> int:
        """Bytes of views kept at most (see the module doc)."""
        info = self._core.conn.info
        pin = info.max_client_pinned_bytes if info is not None else 0
        want = self._max_cfg or (info.capacity_bytes // 8 if info is not None else 0)
        return min(want, pin // 2) if pin else want

    def over_budget(self) -> bool:
        """Whether the views kept may be past the budget: O(1), where
        `shed` looks at every lease (a get calls this, the thread `shed`)."""
        budget = self.budget()
        return bool(budget) and self._current_bytes > budget

    def shed(self, now: float, budget: int | None = None) -> int:
        """Retire idle views, then the least recently read past the budget;
        and the leases of pins older than the idle time (LMCache unpins what
        it pinned within a request; one it never unpins is not renewed for
        ever). Returns the bytes retired."""
        budget = self.budget() if budget is None else budget
        with self._lock:
            live = [(max(v.last_read for v in lease.views), lease) for lease in self._current.values()
                    if len(lease.views)]
            stale_pins = [lease.enc for lease in self._current.values()
                          if not len(lease.views) and now - lease.used > self._idle]
        for enc in stale_pins:
            self.retire(enc, "pinned and not read for a while")
        live.sort(key=lambda x: x[0])
        total = sum(lease.loc.length for _, lease in live)
        out = 0
        for last, lease in live:
            idle = now - last > self._idle
            if not idle and (not budget or total <= budget):
                break
            total -= lease.loc.length
            out += lease.loc.length
            self.retire(lease.enc, "not read for a while" if idle else "past this engine's view budget")
        return out

    def renew(self, now: float) -> None:
        """Renew the current leases with less than half the TTL left; a key
        found elsewhere loses its leases."""
        with self._lock, self._core.lock:
            due = [e for e in self._current
                   if (h := self._core.held.get(e)) is not None and h.expires - now < self.ttl / 2]
        if not due:
            return
        locs = self._core.renew(due, time.monotonic() + self._core.cfg.deadline_ms / 1000)
        for enc, loc in zip(due, locs):
            with self._lock:
                lease = self._current.get(enc)
                moved = lease is not None and (loc is None or lease.place() != (
                    loc.region, loc.offset, loc.length, loc.version))
            if moved:
                self.lose(enc, "its lock could not be renewed at the same location")

    def lapse(self, now: float) -> None:
        """Leases this client can no longer count on: a current one whose
        renewal has not come with three periods left is retired; every lease
        of a key with a period and a half left (retired or not: nothing
        renewed it) lapses: its views out of L1 and invalid, before the
        sidecar's expiry, which is a tenth of the TTL later still."""
        with self._lock, self._core.lock:
            held = self._core.held

            def left(e: bytes) -> float:
                h = held.get(e)
                return h.expires - now if h is not None else -1.0

            ending = [e for e in {*self._current, *self._retired} if left(e) < 1.5 * self.period]
            late = [e for e in self._current if e not in ending and left(e) < 3 * self.period]
        for e in late:
            self.retire(e, "its lock could not be renewed in time")
        for e in ending:
            self.lose(e, "its lock is about to lapse")

    def run(self, closed: threading.Event, on_error: Callable[[Exception], None]) -> None:
        while not closed.wait(self.period):
            now = time.monotonic()
            try:
                self.shed(now)
                self.renew(now)
            except Exception as e:  # the lease ends below all the same
                on_error(e)
            try:
                self.lapse(time.monotonic())
            except Exception as e:
                on_error(e)

    # ------------------------------------------------------ after restart

    def relock(self, deadline: float) -> None:
        """The sidecar restarted (every lock of the old instance is gone; it
        removes nothing until they could have lapsed): lock each current
        lease's key again and keep it where it is still at the same place;
        the rest lose their leases."""
        with self._lock:
            keys = list(self._current)
            stale = [e for e in self._retired if e not in self._current]
        for e in stale:
            self.lose(e, "the sidecar restarted")
        if not keys:
            return
        try:
            hits = self._core.lock_keys(deadline, keys)
        except Exception as e:  # nothing is protected any more
            log.warning("cxlkv: locking views again after a sidecar restart failed: %s", e)
            hits = [False] * len(keys)
        for e, hit in zip(keys, hits):
            loc = self._core.location(e) if hit else None
            with self._lock:
                lease = self._current.get(e)
                keep = lease is not None and loc is not None and lease.place() == (
                    loc.region, loc.offset, loc.length, loc.version)
                old = self._retired.pop(e, []) if keep else []
                if keep:
                    lease.loc, lease.lost = loc, False
                    for x in old:
                        x.lost = True
            if keep:
                self._out_of_l1([v for x in old for v in x.views], "the sidecar restarted", invalidate=True)
            else:
                if hit:
                    self._core.release([e])
                self.lose(e, "the sidecar restarted without it at the same place")

    # ------------------------------------------------------------- state

    def report(self) -> dict:
        with self._lock:
            views = sum(len(x.views) for x in self._current.values())
            retired = sum(len(x.views) for xs in self._retired.values() for x in xs)
            pinned = sum(x.loc.length for x in self._current.values() if len(x.views))
            pins = sum(len(p) for p in self._pins.values())
        return {"live_views": views + retired, "retired_views": retired, "view_bytes": pinned,
                "view_budget_bytes": self.budget(), "pins": pins}

    def keys(self) -> set[bytes]:
        with self._lock:
            return set(self._current) | set(self._retired)

    def has_live_views(self) -> bool:
        with self._lock:
            return any(len(x.views) for x in self._current.values()) or any(
                len(x.views) for xs in self._retired.values() for x in xs)
