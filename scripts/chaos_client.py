"""The `cluster-chaos` scenario's client processes (`scripts/faults_chaos.py`
starts them): each imports only grpc and the plugin's generated stubs.

What a client does: stores are Reserve -> write through the mapping -> Commit; reads are
LookupAndLock -> copy -> re-read the page's version word and the region's
generation -> Unlock (a copy whose words moved is a miss; anything else must
be the key's exact bytes), and some InlineGet; deletes of a client's own
keys. Every object's bytes name their key, version and 4 KiB block, so any
read is checked and a wrong one says whose bytes it got. Slow writers
reserve one object and copy it in pieces over most of the reservation's
time (always finishing before its `expires_unix_ms`), whatever happens to
their node meanwhile.

A ledger file shared by every client says, per key, the newest version whose
commit was acknowledged and the newest whose delete was acknowledged; a
reader takes both before its lookup, so a hit of a version deleted (or
superseded) before the lookup began is a resurrected delete. A key whose
commit had no answer (the call failed as a whole: it may have landed, or
land later) is left alone until 15 s after its reservation expired; then a
delete settles it.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import struct
import sys
import time
from collections import Counter

import grpc

from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache._proto import cxlkv_pb2_grpc as pbg
from cxlkv_lmcache.client import channel

# Every lock the clients take lasts this long, InlineGet's too (the server's
# default `lock_ttl_ms`, 60 s otherwise): the end check waits for the locks
# nobody gives back to lapse. A follower's lookup the primary answers after
# the follower gave up on it (the primary was stopped) leaves the node a
# lock it does not know of, which only its TTL ends.
LOCK_TTL_MS = 4000
CALL_S = 2.0  # every call's deadline (as the other scenarios' plugin deadline)
MARGIN_S = 1.0  # scheduling slack on a loaded 2-core machine, on top of it
WRITE_SLACK_MS = 1500  # slow writers stop copying this long before their reservation expires
SETTLE_MS = 15000  # after its reservation expired, an unanswered commit can no longer land
TENANT = "chaos"
BIG_SHARE = 0.4  # of a fast client's stores: one reserve of more than a region (2 MiB)
BIG_BATCH = (2 << 20) + (256 << 10)

KEYS = 64  # per client
DRIVER = 0  # the driver's own keys (the delete bursts before a primary kill)
FRESH = 1  # the end check's fresh keys
FIRST_WORKER = 2  # the clients' processes: 2 .. 10
FILL = 11  # the driver's big stores while a follower is down
MAX_PROCS = 16
PAGE = 4096
STAMP = struct.Struct("<IHHII")  # magic, proc, idx, seq, block: the head of every 4 KiB block
MAGIC = 0x43484153
LEDGER_HEADER = 4096  # [stop u32] ... [reserving since, u64 per proc at 64 + 8 * proc]


# ---- content derived from the key ---------------------------------------------------

def key_bytes(proc: int, idx: int) -> bytes:
    return f"chaos/{proc}/{idx}".encode()


def size_of(proc: int, idx: int) -> int:
    """32 KiB .. 192 KiB, fixed per key (a version of another size is caught too)."""
    return PAGE * (8 + (idx * 7 + proc * 3) % 41)


def payload(proc: int, idx: int, seq: int, size: int) -> bytes:
    """Version `seq` of key (proc, idx): 4 KiB blocks of random bytes seeded
    by the three, each block's head naming them and its place."""
    body = random.Random((proc << 48) | (idx << 32) | seq).randbytes(PAGE)[STAMP.size:]
    return b"".join(STAMP.pack(MAGIC, proc, idx, seq, i) + body for i in range(size // PAGE))


def whose(data: bytes) -> str:
    """What a wrong read holds, block by block: which key, version and block."""
    runs: list[str] = []
    last = None
    for off in range(0, len(data), PAGE):
        m, p, i, s, b = STAMP.unpack_from(data, off) if len(data) - off >= STAMP.size else (0, 0, 0, 0, 0)
        if m == MAGIC:
            good = data[off:off + PAGE] == payload(p, i, s, (b + 1) * PAGE)[b * PAGE:(b + 1) * PAGE]
            what = f"key {p}/{i} v{s}" + ("" if good else " (torn)")
        elif not any(data[off:off + PAGE]):
            what = "zeros"
        else:
            what = "unstamped bytes"
        if last and last[0] == what:
            last[2] = off // PAGE
        else:
            last = [what, off // PAGE, off // PAGE]
            runs.append(last)
    return "; ".join(f"blocks {a}-{b}: {w}" for w, a, b in runs[:8]) + (" ..." if len(runs) > 8 else "")


# ---- the ledger every client shares ------------------------------------------------

class Ledger:
    """Per key [newest acknowledged commit u32][newest acknowledged delete u32];
    a stop flag; per process the unix ms its open slow reservation was made."""

    def __init__(self, path: str, create: bool = False):
        import mmap

        size = LEDGER_HEADER + MAX_PROCS * KEYS * 8
        if create:
            with open(path, "wb") as f:
                f.truncate(size)
        self.fd = os.open(path, os.O_RDWR)
        self.mm = mmap.mmap(self.fd, size)

    def _at(self, proc: int, idx: int) -> int:
        return LEDGER_HEADER + (proc * KEYS + idx) * 8

    def get(self, proc: int, idx: int) -> tuple[int, int]:
        return struct.unpack_from("<II", self.mm, self._at(proc, idx))

    def committed(self, proc: int, idx: int, seq: int) -> None:
        struct.pack_into("<I", self.mm, self._at(proc, idx), seq)

    def deleted(self, proc: int, idx: int, seq: int) -> None:
        struct.pack_into("<I", self.mm, self._at(proc, idx) + 4, seq)

    def stop(self) -> None:
        struct.pack_into("<I", self.mm, 0, 1)

    def stopped(self) -> bool:
        return struct.unpack_from("<I", self.mm, 0)[0] == 1

    def reserving(self, proc: int, since_ms: int) -> None:
        struct.pack_into("<Q", self.mm, 64 + 8 * proc, since_ms)

    def reserving_since(self, proc: int) -> int:
        return struct.unpack_from("<Q", self.mm, 64 + 8 * proc)[0]


# ---- a client of one node -----------------------------------------------------------

class Book:
    """What one writer knows of its own keys: per key ("absent" | "present" |
    "maybe" | "retired", the highest version tried), and its version counter
    (shared by the driver's clients of every node)."""

    def __init__(self) -> None:
        self.state = {i: ["absent", 0] for i in range(KEYS)}
        self.retired: dict[int, int] = {}  # key -> unix ms after which its unanswered commit is settled
        self.seq = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq


def now_ms() -> int:
    return int(time.time() * 1000)


class Client:
    """One node's client: gRPC stubs through the node's socket, the pool
    mapped, every call timed against its deadline, every read checked."""

    EVIDENCE = 20

    def __init__(self, sock: str, via: str, proc: int, ledger: Ledger, seed: int, book: "Book | None" = None):
        import mmap

        self.via, self.proc, self.ledger = via, proc, ledger
        self.rng = random.Random(seed)
        self.ch = channel(sock)
        self.stub = pbg.CxlkvStub(self.ch)
        self.c: Counter = Counter()
        self.max_call_s = 0.0
        self.codes: Counter = Counter()
        self.evidence: list[dict] = []
        self.slow_trace: list[tuple[int, int]] = []  # per slow store: (reserved at, last write at), unix ms
        info = None
        for _ in range(100):
            try:
                info = self.stub.PoolInfo(pb.PoolInfoRequest(), timeout=CALL_S)
                break
            except grpc.RpcError:
                time.sleep(0.1)
        if info is None:
            raise RuntimeError(f"no PoolInfo from {via}")
        self.info = info
        fd = os.open(info.path, os.O_RDWR)
        self.mm = mmap.mmap(fd, info.pool_size)
        os.close(fd)
        self.book = book or Book()
        self.state = self.book.state
        self.retired = self.book.retired

    def close(self) -> None:
        self.ch.close()

    # -- calls, timed -------------------------------------------------------------

    def call(self, method: str, req, stream: bool = False):
        """One RPC with the scenario's deadline; a whole-call error is raised
        (grpc.RpcError) after being counted."""
        t0 = time.monotonic()
        try:
            fn = getattr(self.stub, method)
            if stream:
                return list(fn(req, timeout=CALL_S))
            return fn(req, timeout=CALL_S)
        except grpc.RpcError as e:
            self.c["calls_failed"] += 1
            self.codes[f"{method}:{e.code().name}"] += 1
            if method == "Reserve" and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # Outside the proto's error model (per-item statuses only).
                self.c["whole_call_exhausted"] += 1
                self.note("whole-call RESOURCE_EXHAUSTED", method=method, message=e.details())
            raise
        finally:
            dt = time.monotonic() - t0
            self.c["calls"] += 1
            self.max_call_s = max(self.max_call_s, dt)
            if dt > CALL_S + MARGIN_S:
                self.c["past_deadline"] += 1
                self.note("call past its deadline", method=method, seconds=round(dt, 3))

    def deadline(self) -> int:
        return now_ms() + int(CALL_S * 1000) - 100

    def note(self, what: str, **kw) -> None:
        if len(self.evidence) < self.EVIDENCE:
            self.evidence.append({"what": what, "via": self.via, "client": self.proc, "unix_ms": now_ms(), **kw})

    # -- the mapping --------------------------------------------------------------------

    def _off(self, loc) -> int:
        return self.info.data_offset + loc.region * self.info.region_size + loc.offset

    def version(self, loc) -> int:
        i = self.info
        page = loc.region * (i.region_size // i.page_size) + loc.offset // i.page_size
        return struct.unpack_from("<I", self.mm, i.page_table_offset + page * i.page_slot_bytes)[0]

    def generation(self, loc) -> int:
        i = self.info
        return struct.unpack_from("<Q", self.mm, i.region_table_offset + loc.region * i.region_entry_bytes + 8)[0]

    def write(self, loc, data: bytes) -> None:
        o = self._off(loc)
        self.mm[o:o + len(data)] = data

    # -- checks ---------------------------------------------------------------------------

    def check(self, proc: int, idx: int, data: bytes, snap: tuple[int, int], path: str, loc=None) -> None:
        """A read that must hold exactly one version of key (proc, idx): not a
        version deleted or superseded before the read began."""
        want_size = size_of(proc, idx)
        m, p, i, s, b = STAMP.unpack_from(data, 0) if len(data) >= STAMP.size else (0, 0, 0, 0, 0)
        ok = (len(data) == want_size and m == MAGIC and (p, i, b) == (proc, idx, 0)
              and data == payload(proc, idx, s, want_size))
        where = None if loc is None else {"region": loc.region, "offset": loc.offset, "length": loc.length,
                                          "generation": loc.generation, "version": loc.version}
        if not ok:
            self.c["wrong_bytes"] += 1
            self.note("wrong bytes", path=path, key=f"{proc}/{idx}", expected_size=want_size, got_size=len(data),
                      got=whose(data), location=where, ledger=snap)
            return
        self.c["hits"] += 1
        if path == "inline":
            self.c["inline_hits"] += 1
        acked_commit, acked_delete = snap
        if s <= acked_delete:
            self.c["resurrected"] += 1
            self.note("resurrected delete", path=path, key=f"{proc}/{idx}", version=s,
                      delete_acknowledged_up_to=acked_delete, location=where)
        elif s < acked_commit:
            self.c["resurrected"] += 1
            self.note("older version than an acknowledged commit (a newer one was stored after it was removed)",
                      path=path, key=f"{proc}/{idx}", version=s, newest_acknowledged=acked_commit, location=where)

    # -- operations --------------------------------------------------------------------------

    def read(self, keys: list[tuple[int, int]], inline: bool = False) -> None:
        """Lookup-and-lock, copy, check the words, unlock; or InlineGet."""
        snaps = [self.ledger.get(p, i) for p, i in keys]
        if inline:
            for (p, i), snap in zip(keys, snaps):
                try:
                    msgs = self.call("InlineGet", pb.InlineGetRequest(key=key_bytes(p, i)), stream=True)
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.ABORTED:
                        self.c["moved"] += 1  # went away while read: a miss
                    continue
                if not msgs or not msgs[0].HasField("header") or not msgs[0].header.found:
                    self.c["lookup_misses"] += 1
                    continue
                data = b"".join(m.data for m in msgs[1:])
                if len(data) != msgs[0].header.size:
                    self.c["errors"] += 1
                    self.note("InlineGet ended short without an error", key=f"{p}/{i}", got=len(data),
                              header=msgs[0].header.size)
                    continue
                self.check(p, i, data, snap, "inline")
            return
        req = pb.LookupRequest(keys=[key_bytes(p, i) for p, i in keys], lock_ttl_ms=LOCK_TTL_MS,
                               deadline_unix_ms=self.deadline())
        try:
            rep = self.call("LookupAndLock", req)
        except grpc.RpcError:
            return
        locked = []
        for (p, i), snap, r in zip(keys, snaps, rep.results):
            if not r.found:
                self.c["lookup_misses"] += 1
                continue
            locked.append(key_bytes(p, i))
            loc = r.location
            o = self._off(loc)
            data = self.mm[o:o + loc.length]
            if self.version(loc) != loc.version or self.generation(loc) != loc.generation:
                self.c["moved"] += 1  # the words moved: a miss
                continue
            self.check(p, i, data, snap, "mapped", loc)
        if locked:
            try:
                self.call("Unlock", pb.UnlockRequest(keys=locked))
            except grpc.RpcError:
                pass  # the lock's TTL ends it

    def own_keys(self, states: tuple[str, ...], n: int) -> list[int]:
        now = now_ms()
        for i, until in list(self.retired.items()):
            if until < now:  # settled: present or not, a delete tells
                del self.retired[i]
                self.state[i][0] = "maybe"
        cand = [i for i, (st, _) in self.state.items() if st in states]
        self.rng.shuffle(cand)
        return cand[:n]

    def store(self, idxs: list[int]) -> None:
        """Reserve, write through the mapping, commit."""
        items, seqs = [], []
        for i in idxs:
            s = self.book.next_seq()
            self.state[i][1] = s
            seqs.append(s)
            items.append(pb.ReserveItem(key=key_bytes(self.proc, i), size=size_of(self.proc, i)))
        try:
            rep = self.call("Reserve", pb.ReserveRequest(tenant=TENANT, items=items, deadline_unix_ms=self.deadline()))
        except grpc.RpcError:
            self.c["store_failed"] += len(idxs)
            return  # a reservation made meanwhile cannot be committed by anyone: it expires
        ids, placed, exists = [], [], []
        for i, s, r in zip(idxs, seqs, rep.reservations):
            code = r.status.code
            if code == 0:
                self.write_in_time(r.location, payload(self.proc, i, s, size_of(self.proc, i)), rep.expires_unix_ms)
                ids.append(r.reservation_id)
                placed.append(i)
            elif code == grpc.StatusCode.ALREADY_EXISTS.value[0]:
                # Stored or being written: a key this client deleted (with
                # an answer) can only be being written by a reserve that got
                # no answer; a stored one is checked by reading it (below).
                self.c["store_exists"] += 1
                self.state[i][0] = "maybe"
                exists.append((self.proc, i))
            else:
                self.c["store_failed"] += 1
                self.codes[f"Reserve item:{code}"] += 1
        if ids:
            self.commit(ids, placed, rep.expires_unix_ms)
        if exists:
            self.read(exists)

    def commit(self, ids: list[int], placed: list[int], expires_ms: int) -> None:
        try:
            cr = self.call("Commit", pb.CommitRequest(reservation_ids=ids))
        except grpc.RpcError:
            # No answer: the commit may have landed, or may still land while
            # the reservation is open. Until well after it expired the keys
            # are neither deleted nor stored again (then a delete settles
            # them).
            self.c["uncertain_commits"] += len(ids)
            for i in placed:
                self.state[i][0] = "retired"
                self.retired[i] = expires_ms + SETTLE_MS
            return
        for i, st in zip(placed, cr.statuses):
            if st.code == 0:
                self.state[i][0] = "present"
                self.ledger.committed(self.proc, i, self.state[i][1])
                self.c["stored"] += 1
            else:
                self.c["store_failed"] += 1
                self.codes[f"Commit item:{st.code}"] += 1
                if st.code == grpc.StatusCode.NOT_FOUND.value[0]:
                    self.c["commit_expired"] += 1  # reservation gone (expired, node dead, primary restarted)

    def write_in_time(self, loc, data: bytes, expires_ms: int) -> None:
        self.write(loc, data)
        if now_ms() > expires_ms:
            self.c["writer_overran"] += 1  # this client's fault, not the sidecar's: the run proves nothing
            self.note("a write finished after its reservation expired", location=str(loc))

    def slow_store(self, idx: int) -> None:
        """Reserve one object and copy it in pieces over most of the
        reservation's time (whatever happens to the node meanwhile), then
        commit."""
        s = self.book.next_seq()
        self.state[idx][1] = s
        size = size_of(self.proc, idx)
        req = pb.ReserveRequest(tenant=TENANT, items=[pb.ReserveItem(key=key_bytes(self.proc, idx), size=size)],
                                deadline_unix_ms=self.deadline())
        try:
            rep = self.call("Reserve", req)
        except grpc.RpcError:
            self.c["store_failed"] += 1
            return
        r = rep.reservations[0]
        if r.status.code != 0:
            if r.status.code == grpc.StatusCode.ALREADY_EXISTS.value[0]:
                self.c["store_exists"] += 1
                self.state[idx][0] = "maybe"
            else:
                self.c["store_failed"] += 1
                self.codes[f"Reserve item:{r.status.code}"] += 1
            return
        self.ledger.reserving(self.proc, now_ms())
        data = payload(self.proc, idx, s, size)
        stop_at = rep.expires_unix_ms - WRITE_SLACK_MS
        span = max(0, stop_at - now_ms()) * self.rng.uniform(0.6, 1.0) / 1000
        pieces = size // PAGE
        t0 = time.monotonic()
        done = 0
        o = self._off(r.location)
        reserved_at = now_ms()
        for k in range(pieces):
            if now_ms() >= stop_at:
                break
            self.mm[o + k * PAGE:o + (k + 1) * PAGE] = data[k * PAGE:(k + 1) * PAGE]
            done += 1
            last_write = now_ms()
            if now_ms() > rep.expires_unix_ms:
                self.c["writer_overran"] += 1
                self.note("a slow write finished after its reservation expired", key=f"{self.proc}/{idx}")
            time.sleep(max(0.0, t0 + span * (k + 1) / pieces - time.monotonic()))
        self.ledger.reserving(self.proc, 0)
        if done and len(self.slow_trace) < 5000:
            self.slow_trace.append((reserved_at, last_write))
        if done < pieces:
            self.c["slow_unfinished"] += 1  # too late to finish: not committed (it expires)
            return
        stored = self.c["stored"]
        self.commit([r.reservation_id], [idx], rep.expires_unix_ms)
        if self.c["stored"] > stored:
            self.c["slow_stored"] += 1

    def delete(self, idxs: list[int]) -> None:
        try:
            rep = self.call("Delete", pb.DeleteRequest(keys=[key_bytes(self.proc, i) for i in idxs]))
        except grpc.RpcError:
            for i in idxs:
                if self.state[i][0] == "present":
                    self.state[i][0] = "maybe"
            return
        for i, st in zip(idxs, rep.statuses):
            if st.code in (0, grpc.StatusCode.NOT_FOUND.value[0]):
                # Acknowledged gone: no version up to the highest tried may
                # be found again (keys with an unanswered commit are not
                # deleted until it is settled).
                self.state[i][0] = "absent"
                self.ledger.deleted(self.proc, i, self.state[i][1])
                self.c["deletes_acked"] += 1
            else:
                self.c["delete_refused"] += 1  # locked, held or being written
                self.codes[f"Delete item:{st.code}"] += 1

    def pick_reads(self, procs: list[int], n: int) -> list[tuple[int, int]]:
        """Keys of any client, mostly ones the ledger says are stored."""
        out = []
        for _ in range(n):
            best = None
            for _ in range(6):
                p, i = self.rng.choice(procs), self.rng.randrange(KEYS)
                c, d = self.ledger.get(p, i)
                best = (p, i)
                if c > d:
                    break
            if best not in out:
                out.append(best)
        return out

    def report(self) -> dict:
        return {"counters": dict(self.c), "max_call_s": self.max_call_s, "codes": dict(self.codes),
                "evidence": self.evidence, "slow_trace": self.slow_trace, "via": self.via}


def child(cfg: dict) -> None:
    """A client process: mixed stores (slow ones for a slow writer), reads
    of everyone's keys and deletes of its own, until the ledger says stop."""
    ledger = Ledger(cfg["ledger"])
    c = Client(cfg["socket"], cfg["via"], cfg["proc"], ledger, cfg["seed"])
    print("ready", flush=True)
    slow = cfg["slow"]
    try:
        while not ledger.stopped():
            try:
                r = c.rng.random()
                if r < (0.45 if slow else 0.4):
                    if slow:
                        idxs = c.own_keys(("absent",), 1)
                        if idxs:
                            c.slow_store(idxs[0])
                    elif c.rng.random() < BIG_SHARE:
                        # More than a region's worth in one reserve: placed only
                        # by taking a region from another node (phase 3).
                        idxs, size = [], 0
                        for i in c.own_keys(("absent",), KEYS):
                            if size > BIG_BATCH:
                                break
                            idxs.append(i)
                            size += size_of(c.proc, i)
                        if idxs:
                            c.store(idxs)
                    else:
                        idxs = c.own_keys(("absent",), c.rng.randint(1, 4))
                        if idxs:
                            c.store(idxs)
                elif r < 0.85:
                    c.read(c.pick_reads(cfg["procs"], c.rng.randint(1, 3)), inline=c.rng.random() < 0.2)
                else:
                    idxs = c.own_keys(("present", "maybe"), c.rng.randint(1, 4))
                    if idxs:
                        c.delete(idxs)
            except Exception as e:  # noqa: BLE001 - a bug of the client: an error of the scenario
                c.c["errors"] += 1
                c.note("exception in the client", error=repr(e))
            time.sleep(c.rng.uniform(0.01, 0.05))
    finally:
        print(json.dumps(c.report()), flush=True)
        c.close()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        sys.exit("started by scripts/faults_chaos.py (scripts/faults.py cluster-chaos)")
