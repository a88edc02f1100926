"""A store through the mapped pool: reservations (leases where they fit,
else one Reserve), the copies, and the commits.

A store is reserve → copy → publish → commit. Two things keep round trips
off its critical path:

- leases (`leases.py`): the next store's pages are reserved after this
  one's commit, so a store that finds them copies at once and binds each
  chunk's key at its commit;
- pipelined commits: a batch large enough (``PIPELINE_MIN_BYTES``) is
  copied in two pieces, and the first piece's commit is sent while the
  second is copied; only the second's commit is left after the last byte
  moved. Each piece is published (fenced) before its commit, so
  write-then-publish holds per key; a piece's keys become visible as soon
  as their own bytes are in the pool.

A commit that binds leases is sent from the copying thread itself, as an
asynchronous call, the moment its piece is published (the last piece's
too): handing it to another thread first cost a thread's wake-up before
the call left (docs/BENCHMARKS.md). Its reply is read where the store
finishes. A commit without leases goes through a thread of its own: it may
ride on another store's Reserve.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from cxlkv_lmcache import client as cl
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.state import Conn, Task, time_left

#: A batch of at least this many bytes (and two objects) commits in two
#: pieces, the first while the second is copied.
PIPELINE_MIN_BYTES = 8 << 20

Item = tuple[object, bytes, int, int]  # (token, encoded key, source address, size)


@dataclass
class Part:
    """What a group's copies left to commit: per copied object its id,
    crc32 (when verified), key to bind (b"": as reserved) and (token, key,
    size); the commits already sent for a prefix of them; the phases'
    clock readings."""
    ok: bool = True
    ids: list = field(default_factory=list)
    crcs: list = field(default_factory=list)
    keys: list = field(default_factory=list)
    new: list = field(default_factory=list)
    early: list = field(default_factory=list)  # (future of (statuses, seq), number of ids)
    times: tuple | None = None
    present: set | None = None
    void: list = field(default_factory=list)  # keys whose lease was void at its bind
    failed: int = 0  # copied objects not stored, void leases included

    def sent(self) -> int:
        """How many of `ids` (a prefix) the early commits carry."""
        return sum(n for _, n in self.early)


class MappedStores:
    """The mapped store path of one `Core` (its link, copier, unlocks,
    rides, leases and counters)."""

    def __init__(self, core):
        self.core = core
        # Commits sent while a batch's last piece copies: threads that wait
        # on nothing but their call, so they never wait behind the tasks
        # that wait for them.
        self.committer = ThreadPoolExecutor(2, thread_name_prefix="cxlkv-commit")
        # Lease refills: one at a time, on a thread of their own, so a
        # sidecar slow to answer one never holds up LMCache's tasks.
        self.leaser = ThreadPoolExecutor(1, thread_name_prefix="cxlkv-lease")

    def close(self) -> None:
        self.committer.shutdown(wait=True, cancel_futures=True)
        self.leaser.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------ reserve

    def reserve_and_copy(self, task: Task, conn: Conn, tenant: str, items: list[Item], carry: bool = False,
                         present: set | None = None) -> Part:
        """Reserve (or take leases) → copy → publish; what `commit_copied`
        needs to finish."""
        core = self.core
        t0 = time.perf_counter()
        per, keys, until = self.reserved(task, conn, tenant, items, carry)
        t1 = time.perf_counter()
        part = Part(present=present)
        if not core.begin_copy(task):
            core.abort_quietly([r.reservation_id for r in per if r.status.code == cl.OK])
            part.ok = False
            return part
        try:
            todo = self.sort_out(per, items, keys, part)
            pieces = self.pieces(todo)
            for i, piece in enumerate(pieces):
                self.copy_piece(task, conn, piece, until, part)
                if part.ids and (i + 1 < len(pieces) or self.bound_unsent(part)):
                    self.commit_early(task, part)
        finally:
            core.end_copy(task)
        part.times = (t0, t1, time.perf_counter())
        return part

    def sort_out(self, per: list, items: list[Item], keys: list[bytes], part: Part) -> list:
        """The reserved items to copy; the others counted as what they are."""
        todo = []
        for r, it, key in zip(per, items, keys):
            if r.status.code == cl.OK:
                todo.append((r, it, key))
            elif r.status.code == cl.NOT_ADMITTED:
                self.core.not_admitted += 1  # a skipped store, not a failure: nothing was reserved
            elif r.status.code != cl.ALREADY_EXISTS:  # exists: stored by someone, counts as done
                part.ok = False
            elif part.present is not None:
                part.present.add(it[1])
        return todo

    @staticmethod
    def pieces(todo: list) -> list[list]:
        """One piece, or two of about equal bytes for a large batch."""
        total = sum(r.location.length for r, _, _ in todo)
        if len(todo) < 2 or total < PIPELINE_MIN_BYTES:
            return [todo]
        run = 0
        for i, (r, _, _) in enumerate(todo):
            run += r.location.length
            if run * 2 >= total:
                cut = max(1, min(i + 1, len(todo) - 1))
                return [todo[:cut], todo[cut:]]
        return [todo]

    def copy_piece(self, task: Task, conn: Conn, piece: list, until: float, part: Part) -> None:
        """Copy a piece over the copy threads and publish it; an object
        whose copy could not start before `until` is partial: aborted,
        never committed."""
        core = self.core
        verify = core.verify(conn)
        jobs = [(r.location, src, r.location.length) for r, (_, _, src, _), _ in piece]
        skipped = conn.pool.put_many(core.copier, jobs, until=until)
        late = []
        for j, (r, (tok, e, src, _), key) in enumerate(piece):
            if j in skipped:
                late.append(r.reservation_id)
                part.ok = False
                continue
            if verify:
                part.crcs.append(cl.crc32_at(src, r.location.length))
            part.ids.append(r.reservation_id)
            part.keys.append(key)
            part.new.append((tok, e, r.location.length))
        core.abort_quietly(late)
        if part.ids:
            conn.pool.publish()  # every put reaches memory before the commit makes it visible

    def reserved(self, task: Task, conn: Conn, tenant: str, items: list[Item], carry: bool) -> tuple:
        """Per item a reservation: a lease where one fits (its key to bind
        at commit), else from one Reserve of the rest; and the time after
        which no copy into any of them may start."""
        core = self.core
        fields = core.token_fields
        leased = self.take_leases(conn, tenant, items, fields)
        rest = [i for i in range(len(items)) if i not in leased]
        per: list = [None] * len(items)
        keys = [b""] * len(items)
        until = float("inf")
        for i, lease in leased.items():
            per[i] = lease
            keys[i] = items[i][1]
            until = min(until, copy_limit(conn, lease.expires_unix_ms))
        if not rest:
            if carry:
                core.handoff.skip()
            return per, keys, until
        # Items with token ids go as messages; the rest packed where the
        # sidecar reads that (client.reserve_fields).
        if fields or not conn.info.packed_reserve:
            items_pb = [pb.ReserveItem(key=e, size=n, **fields.pop(e, {})) if fields else pb.ReserveItem(key=e, size=n)
                        for _, e, _, n in (items[i] for i in rest)]
        else:
            items_pb = [(e, n) for _, e, _, n in (items[i] for i in rest)]
        unlocking = core.unlocks.in_flight() > 0
        rep = core.reserve(task, tenant, items_pb, carry)
        got = cl.per_item(rep)
        if unlocking:
            self.reserve_again_after_own_unlocks(task, tenant, items_pb, got)
        for i, r in zip(rest, got):
            per[i] = r
        return per, keys, min(until, copy_limit(conn, rep.expires_unix_ms))

    def take_leases(self, conn: Conn, tenant: str, items: list[Item], fields: dict) -> dict:
        """Item index -> a lease for it, for items of the store's most
        common size whose keys a lease can take. A key this client stored
        and has not seen removed goes through the Reserve, which says it is
        there before anything is copied (a lease would learn it only at
        the commit, after the copy)."""
        leases, ledger = self.core.leases, self.core.ledger
        fit = [i for i, (_, e, _, _) in enumerate(items)
               if leases.usable(conn, tenant, e, fields.get(e)) and not ledger.holds(e)]
        if not fit:
            return {}
        sizes: dict[int, list[int]] = {}
        for i in fit:
            sizes.setdefault(items[i][3], []).append(i)
        size, idx = max(sizes.items(), key=lambda kv: len(kv[1]))
        return dict(zip(idx, leases.take(conn, tenant, size, len(idx))))

    def reserve_again_after_own_unlocks(self, task: Task, tenant: str, items_pb: list, per: list) -> None:
        """Items refused for room (RESOURCE_EXHAUSTED) while this client's
        own unlocks were on the wire may need just the room those free: an
        engine that releases its views and stores at once sends both, and
        the sidecar may see the Reserve first. Wait for the unlocks (at most
        half the time left) and reserve those items once more, in `per`. The
        first reply's expiry stays the copies' limit: it is the earlier."""
        core = self.core
        again = [i for i, r in enumerate(per) if r.status.code == cl.RESOURCE_EXHAUSTED]
        if not again or not core.unlocks.settle(time_left(task.deadline) / 2):
            return
        rep = core.reserve(task, tenant, [items_pb[i] for i in again])
        for i, r in zip(again, cl.per_item(rep)):
            per[i] = r

    # ------------------------------------------------------------- commit

    @staticmethod
    def bound_unsent(part: Part) -> bool:
        """Whether what is copied and not yet committed binds a lease."""
        return any(part.keys[part.sent():])

    def commit_early(self, task: Task, part: Part) -> None:
        """Send the commit of what is copied so far: at once when it binds
        leases, else from the committer (it may ride on a Reserve)."""
        sent = part.sent()
        ids, keys, new = part.ids[sent:], part.keys[sent:], part.new[sent:]
        crcs = part.crcs[sent:] if part.crcs else []
        if any(keys):
            fut = self.send_bound(task, ids, crcs, keys, new, part.present, part.void)
        else:
            try:
                fut = self.committer.submit(self.commit_ids, task, ids, crcs, keys, new, part.present, part.void)
            except RuntimeError:  # closing: committed with the rest
                return
        part.early.append((fut, len(ids)))

    def commit_copied(self, task: Task, part: Part) -> tuple[bool, int, list]:
        """Commit what `reserve_and_copy` copied: (all stored or already
        there, bytes written, (token, enc, size, removal-log seq) per newly
        stored key)."""
        core = self.core
        if not part.ids:
            return part.ok, 0, []
        t0, t1, t2 = part.times
        statuses: list = []
        seqs: list[int] = []
        for fut, n in part.early:
            st, seq = self.early_result(task, fut, n)
            statuses += st
            if seq is not None and any(x.code == cl.OK for x in st):
                seqs.append(seq)
        at = len(statuses)
        if at < len(part.ids):
            st, seq = self.commit_ids(task, part.ids[at:], part.crcs[at:] if part.crcs else [], part.keys[at:],
                                      part.new[at:], part.present, part.void)
            statuses += list(st)
            if any(x.code == cl.OK for x in st):
                seqs.append(seq)
        core.store_times.add(t1 - t0, t2 - t1, time.perf_counter() - t2)
        # The earliest position of the calls that stored something: a
        # removal after any of these commits counts.
        removed_seq = min(seqs, default=0)
        done = [(tok, e, n, removed_seq) for (tok, e, n), st in zip(part.new, statuses) if st.code == cl.OK]
        refused = sum(st.code in (cl.ALREADY_EXISTS, cl.NOT_ADMITTED) for st, k in zip(statuses, part.keys) if k)
        part.failed = len(part.new) - len(done) - refused
        self.lease_soon()
        return part.ok and part.failed == 0, sum(n for _, _, n, _ in done), done

    def store(self, task: Task, conn: Conn, tenant: str, items: list[Item], carry: bool = False,
              present: set | None = None) -> tuple[bool, int, list]:
        """Reserve (or lease), copy, commit; chunks whose lease was void at
        the bind (another session's after a reconnect, or an instance that
        restarted under the copy) are stored once more through a Reserve:
        here their sources are still the caller's."""
        part = self.reserve_and_copy(task, conn, tenant, items, carry, present)
        ok, written, new = self.commit_copied(task, part)
        if not part.void or time_left(task.deadline) <= 0:
            return ok, written, new
        again = set(part.void)
        retry = [it for it in items if it[1] in again]
        ok2, written2, new2 = self.commit_copied(task, self.reserve_and_copy(task, self.core.connect(task.deadline),
                                                                            tenant, retry, False, present))
        ok = part.ok and part.failed == len(part.void) and ok2
        return ok, written + written2, new + new2

    @staticmethod
    def early_result(task: Task, fut: Future, n: int) -> tuple[list, int | None]:
        """An early commit's statuses and removal-log position; one that
        failed or did not answer in time counts as failed for each of its
        ids (doubt is a failure), and has no position."""
        try:
            st, seq = fut.result(timeout=max(0.0, time_left(task.deadline)) + 1.0)
            return list(st), seq
        except Exception:  # noqa: BLE001 - any failure of that call is the same doubt
            failed = pb.KeyStatus(code=grpc.StatusCode.UNKNOWN.value[0], message="commit failed")
            return [failed] * n, None

    def commit_ids(self, task: Task, ids: list[int], crcs: list[int], keys: list[bytes], new: list,
                   present: set | None, void: list):
        """One commit: bound keys through an explicit Commit, else as the
        rides decide (possibly carried by another store's Reserve)."""
        if any(keys):
            return self.send_bound(task, ids, crcs, keys, new, present, void).result()
        return self.core.rides.commit(task, ids, crcs)

    def send_bound(self, task: Task, ids: list[int], crcs: list[int], keys: list[bytes], new: list,
                   present: set | None, void: list) -> SentCommit:
        """Send an explicit Commit binding leases to their keys (no ride: a
        carrying Reserve binds nothing); its reply is applied when read."""
        call = self.core.stub.Commit.future(pb.CommitRequest(reservation_ids=ids, crc32=crcs, keys=keys),
                                            timeout=time_left(task.deadline))
        return SentCommit(call, lambda cr: self.bound_statuses(cr, keys, new, present, void))

    def bound_statuses(self, cr: pb.CommitReply, keys: list[bytes], new: list, present: set | None, void: list):
        """A bound Commit's reply, applied. A bound key already there, or
        declined, is what a Reserve's refusal of it would have been; a lease
        unknown or another session's (a reconnect, a restart under the
        copy) voids the stock, and its key goes into `void`."""
        core = self.core
        for st, k, (_, e, _) in zip(cr.statuses, keys, new):
            if not k:
                continue
            if st.code == cl.OK:
                core.leases.bound += 1
            elif st.code == cl.NOT_ADMITTED:
                core.not_admitted += 1
            elif st.code == cl.ALREADY_EXISTS:
                if present is not None:
                    present.add(e)
            else:
                core.leases.drop()
                if st.code in (cl.NOT_FOUND, cl.PERMISSION_DENIED):
                    void.append(e)
        return cr.statuses, cr.removed_seq

    def lease_soon(self) -> None:
        """Lease ahead for the next store, off the caller's thread."""
        core = self.core
        if core.leases.refill_due():
            try:
                self.leaser.submit(core.leases.refill, core.conn)
            except RuntimeError:  # closing
                core.leases.refill_done()


def copy_limit(conn: Conn, expires_unix_ms: int) -> float:
    """Unix time after which no copy into a reservation that lapses at
    `expires_unix_ms` may begin: the pages are ours until then, and a copy
    still running then might overwrite another key's bytes."""
    margin = min(1.0, conn.info.reservation_timeout_ms / 4000)
    return expires_unix_ms / 1000 - margin


class SentCommit:
    """A bound Commit already on the wire: `result` waits for its reply and
    applies it (once), as `MappedStores.early_result` reads a future."""

    def __init__(self, call: grpc.Future, settle):
        self._call = call
        self._settle = settle
        self._value = None

    def result(self, timeout: float | None = None) -> tuple:
        if self._value is None:
            self._value = self._settle(self._call.result(timeout=timeout))
        return self._value
