"""Reservations leased ahead of need, bound to chunks' keys at commit.

A store is Reserve → copy → Commit: two round trips, the first before any
byte can move. With leases the Reserve leaves the critical path: after a
store commits, the client reserves as many pages as that store used, under
names of its own (admission-exempt: nobody asks for those names), and the
next store of chunks of that size copies straight into them and commits
each under its chunk's key (``CommitRequest.keys``). The sidecar judges the
key then, as a Reserve of it would (stored, or declined: the lease is given
back and the chunk counts as a Reserve's refusal would).

Leases take free room only (``ReserveRequest.no_evict``): nobody's cached
chunk is evicted for a reservation ahead of need, so in a full pool there
are none and stores reserve as before.

Bounds, in bytes: a client leases at most ``lease_ahead_bytes``, a quarter
of its pin budget and an eighth of the sidecar's capacity, whichever is
least. A lease is a reservation: it lapses with ``reservation_timeout_ms``
and counts against the pin budget like one. A copy into a lease follows the
store's rule (it starts before the lease lapses, with the same margin);
leases with less than a quarter of the timeout left are given back, not
used. No leases where the sidecar does not bind (any node of a cluster), for a key
that would not fit its record, for chunks that carry token ids (the event
plane takes them at Reserve), or on another connection than the one that
leased them; a restart drops them all, and a bind refused as another
session's or unknown drops the rest of the stock with it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass

import grpc

from cxlkv_lmcache import client as cl
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.state import Conn

EXEMPT = (("cxlkv-admission", "exempt"),)
PREFIX = b"\x00lease/"
REFILL_TIMEOUT_S = 2.0


class _Ok:
    code = cl.OK


@dataclass
class Lease:
    """A reservation leased ahead; read where a Reserve's reply entry is
    (`status.code`, `reservation_id`, `location`)."""
    reservation_id: int
    location: pb.Location
    expires_unix_ms: int
    conn: Conn
    status = _Ok


def limit(cap: int, info: pb.PoolInfoReply) -> int:
    """Bytes this client may hold leased."""
    if not info.commit_as_name_bytes:
        return 0
    if info.max_client_pinned_bytes:
        cap = min(cap, info.max_client_pinned_bytes // 4)
    if info.capacity_bytes:
        cap = min(cap, info.capacity_bytes // 8)
    return cap


class Leases:
    """Per (tenant, size): the stock, and how many the last store wanted."""

    def __init__(self, stub, cap_bytes: int):
        self._stub = stub
        self._cap = cap_bytes
        self._lock = threading.Lock()
        self._stock: dict[tuple[str, int], deque[Lease]] = {}
        self._want: dict[tuple[str, int], int] = {}
        self._stale: list[int] = []  # given back at the next refill
        self._refilling = False
        self.bound = 0  # chunks committed through a lease (tests, status)

    def usable(self, conn: Conn, tenant: str, enc: bytes, fields: dict | None) -> bool:
        info = conn.info
        return (self._cap > 0 and info is not None and not conn.inline and not fields
                and len(tenant.encode()) + len(enc) <= info.commit_as_name_bytes)

    def take(self, conn: Conn, tenant: str, size: int, n: int) -> list[Lease]:
        """Up to `n` leases of this size, fresh enough to copy into now; the
        store's demand is remembered for the next refill either way."""
        keep_s = conn.info.reservation_timeout_ms / 4000
        now = time.time()
        out: list[Lease] = []
        with self._lock:
            self._want[(tenant, size)] = n
            stock = self._stock.get((tenant, size))
            while stock and len(out) < n:
                lease = stock.popleft()
                # Still its pages, in the instance that leased them: a
                # restarted sidecar renewed the region's generation, and
                # freed pages have a new version (a local read, no call).
                if (lease.conn is conn and lease.expires_unix_ms / 1000 - now > keep_s
                        and conn.pool is not None and conn.pool.still_there(lease.location)):
                    out.append(lease)
                else:
                    self._stale.append(lease.reservation_id)
        return out

    def stock_size(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._stock.values())

    def drop(self) -> None:
        """Every lease is void (a restart, or another session's)."""
        with self._lock:
            self._stock.clear()

    def refill_due(self) -> bool:
        """Claim the next refill (one at a time); False when one runs."""
        with self._lock:
            if self._refilling or not (self._want or self._stale):
                return False
            self._refilling = True
            return True

    def refill(self, conn: Conn) -> None:
        """Give back stale leases and lease what the last stores wanted,
        within the byte limit. Best effort: a refused or failed call leaves
        the stock as it is (the next store reserves as before)."""
        try:
            with self._lock:
                stale, self._stale = self._stale, []
            if stale:
                try:
                    self._stub.Abort(pb.AbortRequest(reservation_ids=stale), timeout=REFILL_TIMEOUT_S)
                except grpc.RpcError:
                    pass  # they lapse on their own
            if conn.info is None or conn.inline:
                return
            room = limit(self._cap, conn.info)
            for (tenant, size), n in self._wanted(room):
                self._lease(conn, tenant, size, n)
        finally:
            self.refill_done()

    def idle(self) -> bool:
        """No refill runs or waits to run."""
        with self._lock:
            return not self._refilling

    def refill_done(self) -> None:
        with self._lock:
            self._refilling = False

    def _wanted(self, room: int) -> list[tuple[tuple[str, int], int]]:
        with self._lock:
            held = sum(size * len(s) for (_, size), s in self._stock.items())
            out = []
            for (tenant, size), n in self._want.items():
                have = len(self._stock.get((tenant, size), ()))
                more = min(n - have, (room - held) // size)
                if more > 0:
                    out.append(((tenant, size), more))
                    held += more * size
            self._want.clear()
            return out

    def _lease(self, conn: Conn, tenant: str, size: int, n: int) -> None:
        keys = [PREFIX + os.urandom(12) for _ in range(n)]
        items = [(k, size) for k in keys] if conn.info.packed_reserve else [pb.ReserveItem(key=k, size=size) for k in keys]
        try:
            rep = self._stub.Reserve(pb.ReserveRequest(tenant=tenant, **cl.reserve_fields(items), runs=True, no_evict=True),
                                     timeout=REFILL_TIMEOUT_S, metadata=EXEMPT)
        except grpc.RpcError:
            return
        got = [Lease(r.reservation_id, r.location, rep.expires_unix_ms, conn)
               for r in cl.per_item(rep) if r.status.code == cl.OK]
        with self._lock:
            self._stock.setdefault((tenant, size), deque()).extend(got)

    def give_back(self) -> None:
        """At close: every lease back to the sidecar (best effort)."""
        with self._lock:
            ids = [lease.reservation_id for s in self._stock.values() for lease in s] + self._stale
            self._stock.clear()
            self._stale = []
        if ids:
            try:
                self._stub.Abort(pb.AbortRequest(reservation_ids=ids), timeout=1.0)
            except grpc.RpcError:
                pass
