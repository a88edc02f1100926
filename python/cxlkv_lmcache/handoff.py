"""Commits of finished store batches riding on the next store's Reserve.

A store is Reserve → copy → Commit: two round trips. When another store
task is already running and about to send its Reserve, a finished batch
hands its Commit over instead (``ReserveRequest.commit_first``) and waits
for that Reserve's reply, at most ``commit_ride_ms``; then it takes the
Commit back (if nobody took it yet) and sends it itself. A lone store (the
common case of one batch at a time) commits at once, as before.

Write-then-publish holds: a batch is offered only after all its copies
ended and were fenced (`PoolMap.put_many`, `publish`), and its task reports
success only after the sidecar acknowledged the commit (LMCache may drop
its own copy of a stored object as soon as the store task succeeds).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from cxlkv_lmcache import client as cl
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.state import Task, server_deadline, time_left


@dataclass
class Ride:
    """One batch's commit: ids and (empty, or one per id) crc32s."""
    ids: list[int]
    crcs: list[int]
    done: threading.Event = field(default_factory=threading.Event)
    taken: bool = False
    statuses: list | None = None  # per id, from the carrying Reserve; None: unknown (that call failed)
    removed_seq: int = 0


class Handoff:
    def __init__(self):
        self._lock = threading.Lock()
        self._rides: list[Ride] = []
        self._about_to_reserve = 0
        self.carried = 0  # ids committed through a Reserve (tests, status)

    def reserving(self) -> None:
        """A store task is running and will send a Reserve."""
        with self._lock:
            self._about_to_reserve += 1

    def take(self, with_crc: bool) -> list[Ride]:
        """For the Reserve about to be sent (the caller called `reserving`):
        every waiting commit whose checksum form matches this call's."""
        with self._lock:
            self._about_to_reserve -= 1
            mine = [r for r in self._rides if bool(r.crcs) == with_crc]
            self._rides = [r for r in self._rides if bool(r.crcs) != with_crc]
            for r in mine:
                r.taken = True
            return mine

    def skip(self) -> None:
        """A task that called `reserving` sends no Reserve after all."""
        with self._lock:
            self._about_to_reserve -= 1

    def offer(self, ids: list[int], crcs: list[int]) -> Ride | None:
        """Hand a commit over, or None when no other store will reserve soon."""
        with self._lock:
            if self._about_to_reserve <= 0:
                return None
            ride = Ride(ids, crcs)
            self._rides.append(ride)
            return ride

    def withdraw(self, ride: Ride) -> bool:
        """Take a commit back unless a Reserve already carries it."""
        with self._lock:
            if ride.taken:
                return False
            self._rides.remove(ride)
            return True

    @staticmethod
    def settle(rides: list[Ride], statuses, removed_seq: int) -> None:
        """The carrying Reserve's answer (statuses None: it failed, outcome unknown)."""
        at = 0
        for r in rides:
            if statuses is not None:
                r.statuses = list(statuses[at:at + len(r.ids)])
                r.removed_seq = removed_seq
            at += len(r.ids)
            r.done.set()


class CommitRides:
    """The store path's side: a Reserve carrying waiting commits, and a
    Commit through a ride or explicitly. `handoff` is shared with the store
    path, which announces its Reserves (`reserving`, `take`, `skip`)."""

    def __init__(self, stub, handoff: Handoff, ride_ms: int):
        self._stub = stub
        self._handoff = handoff
        self._ride_ms = ride_ms

    def reserve(self, task: Task, salt: str, items: list, rides: list[Ride]):
        """Reserve, carrying the commits of `rides`; their owners learn the
        outcome whatever happens here. Refusals come back as runs: read the
        reply's reservations through `client.per_item`."""
        statuses, seq = None, 0
        try:
            rep = self._stub.Reserve(
                pb.ReserveRequest(tenant=salt, **cl.reserve_fields(items), deadline_unix_ms=server_deadline(task.deadline),
                                  commit_first=[i for r in rides for i in r.ids],
                                  commit_first_crc32=[c for r in rides for c in r.crcs], runs=True),
                timeout=time_left(task.deadline),
            )
            if rides and len(rep.commit_statuses) == sum(len(r.ids) for r in rides):
                statuses, seq = rep.commit_statuses, rep.commit_removed_seq
                self._handoff.carried += sum(st.code == cl.OK for st in statuses)
            return rep
        finally:
            self._handoff.settle(rides, statuses, seq)

    def commit(self, task: Task, ids: list[int], crcs: list[int]):
        """Commit a copied, published batch: through another store's Reserve
        when one is about to be sent (waiting at most ride_ms for it), else
        (or when that call failed) by an explicit Commit. Returns only once
        the sidecar answered: per-id statuses and the removal-log seq."""
        ride = self._handoff.offer(ids, crcs) if self._ride_ms > 0 else None
        if ride is not None:
            if not ride.done.wait(self._ride_ms / 1000) and self._handoff.withdraw(ride):
                ride = None
            elif ride.done.wait(time_left(task.deadline)) and ride.statuses is not None:
                return ride.statuses, ride.removed_seq
            # Else the carrying call failed or hung: commit here. An id it did
            # commit is NOT_FOUND now and counts as failed (doubt is a failure).
        cr = self._stub.Commit(pb.CommitRequest(reservation_ids=ids, crc32=crcs), timeout=time_left(task.deadline))
        return cr.statuses, cr.removed_seq
