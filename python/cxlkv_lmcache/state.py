"""Small state records and time helpers of the cxlkv LMCache adapter."""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from cxlkv_lmcache import client as cl
from cxlkv_lmcache._proto import cxlkv_pb2 as pb

if TYPE_CHECKING:  # a type only: the store path (handoff.py) runs without LMCache in scripts/bench_copy.py
    from lmcache.v1.distributed.api import ObjectKey


@dataclass
class Task:
    """One store, lookup or load task LMCache submitted: it ends by `deadline`
    (monotonic); `copying` holds off the watchdog while bytes move."""

    kind: str
    deadline: float
    n: int
    done: bool = False
    copying: bool = False


@dataclass
class Held:
    """A key this adapter holds sidecar locks on."""

    count: int
    loc: pb.Location
    expires: float  # monotonic


@dataclass
class Stored:
    """A key this adapter stored and reports to LMCache's accounting."""

    key: ObjectKey
    size: int
    seq: int  # removal-log position at commit: older removals do not apply


@dataclass
class Conn:
    """What this adapter knows of the sidecar it is connected to."""

    info: pb.PoolInfoReply | None = None
    pool: cl.PoolMap | None = None
    inline: bool = False
    healthy: bool = False
    last_error: str = ""
    removed_seq: int = 0
    instance: int = 0
    unlock_q: collections.deque = field(default_factory=collections.deque)


class Ledger:
    """The keys this adapter stored, as LMCache counts them: whatever takes
    one out (a delete, the removal feed) reports it deleted, exactly once.
    Its own lock: nothing else changes together with it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._keys: dict[bytes, Stored] = {}

    def add(self, new: list[tuple[ObjectKey, bytes, int, int]]) -> None:
        """(key, encoded key, size, removal-log seq at commit) per stored key."""
        with self._lock:
            for k, e, size, seq in new:
                self._keys[e] = Stored(k, size, seq)

    def holds(self, enc: bytes) -> bool:
        with self._lock:
            return enc in self._keys

    def remove(self, enc: list[bytes]) -> list[Stored]:
        """Take out the keys among `enc` it holds (deleted through this adapter)."""
        with self._lock:
            return [self._keys.pop(k) for k in enc if k in self._keys]

    def removed(self, logged: list[tuple[bytes, int]]) -> list[Stored]:
        """Take out keys the sidecar logged removed at (key, seq); a removal
        logged before our commit is of an older incarnation and does not apply."""
        gone = []
        with self._lock:
            for k, seq in logged:
                s = self._keys.get(k)
                if s is not None and seq >= s.seq:
                    gone.append(self._keys.pop(k))
        return gone

    def snapshot(self) -> list[tuple[bytes, Stored]]:
        with self._lock:
            return list(self._keys.items())

    def missing(self, checked: list[tuple[tuple[bytes, Stored], bool]]) -> list[Stored]:
        """Take out the snapshot entries found not to exist, unless stored again since."""
        gone = []
        with self._lock:
            for (k, s), exists in checked:
                if not exists and self._keys.get(k) is s:
                    gone.append(self._keys.pop(k))
        return gone


class StoreTimes:
    """Where mapped stores spend their time, summed since the adapter
    started (`report_status()["store_phase_s"]`): the Reserve call, the
    copies with their fence, and the Commit (its own call, or the wait for
    the Reserve it rode on), per batch that reached its commit. An operator
    sees which part dominates a slow store; the benchmark derives from it
    what a store with one round trip fewer could reach at most."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sums = {"batches": 0, "reserve": 0.0, "copy": 0.0, "commit": 0.0}

    def add(self, reserve: float, copy: float, commit: float) -> None:
        with self._lock:
            s = self._sums
            s["batches"] += 1
            s["reserve"] += reserve
            s["copy"] += copy
            s["commit"] += commit

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._sums)


def time_left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def server_deadline(deadline: float) -> int:
    """Unix ms after which the sidecar must refuse the work: 80% of the time
    left, so a reply sent just in time still reaches us before we give up
    (otherwise locks or reservations it took would have no owner)."""
    return int(time.time() * 1000 + max(0.0, deadline - time.monotonic()) * 800)


def rpc_error(e: grpc.RpcError) -> str:
    try:
        return f"{e.code().name}: {e.details()}"
    except Exception:
        return str(e)
