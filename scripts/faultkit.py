"""What the fault scenarios (`scripts/faults.py`, `scripts/faults_cluster.py`)
share: content derived from each key, the plugin driven through LMCache's
adapter interface with every task timed, the sidecar's state read back
through `cxlkv status`, the verdict line, and the soak client processes."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import pathlib
import random
import select
import subprocess
import sys
import threading
import time

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd

from cxlkv_testkit import BIN, ROOT, Sidecar, free_port, plugin_spec  # noqa: F401 - free_port: for the scenarios

EMPTY = MemoryLayoutDesc(shapes=[], dtypes=[])
DEADLINE_MS = 2000
MARGIN_S = 1.0  # scheduling slack on a loaded 2-core machine, on top of the deadline
SIZE = 64 << 10


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- content derived from the key -------------------------------------------------

def key(idx: int, salt: int = 0) -> ObjectKey:
    return ObjectKey(chunk_hash=((salt << 64) | idx).to_bytes(32, "big"), model_name="faults/model", kv_rank=0)


def expected(k: ObjectKey, n: int = SIZE) -> torch.Tensor:
    """Pseudo-random bytes seeded by a hash of the key. Not a short periodic
    pattern: one repeating every 256 bytes could not tell pages handed out in
    the wrong order, and keys whose patterns coincide could not tell one
    key's bytes delivered for another."""
    seed = int.from_bytes(hashlib.blake2b(k.chunk_hash, digest_size=8).digest(), "little") >> 1
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def make_obj(n: int = SIZE) -> TensorMemoryObj:
    raw = torch.zeros(n, dtype=torch.uint8)
    meta = MemoryObjMetadata(shape=torch.Size([n]), dtype=torch.uint8, address=0, phy_size=n,
                             fmt=MemoryFormat.KV_2LTD, ref_count=1, shapes=[torch.Size([n])], dtypes=[torch.uint8])
    return TensorMemoryObj(raw, meta, parent_allocator=None)


def filled(k: ObjectKey) -> TensorMemoryObj:
    o = make_obj()
    o.tensor.copy_(expected(k))
    return o


# ---- the adapter, timed -------------------------------------------------------------

def build(spec: dict):
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    ns = argparse.Namespace(l2_adapter=[json.dumps(spec)])
    return create_l2_adapter(parse_args_to_l2_adapters_config(ns).adapters[0])


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.c = {"tasks": 0, "hits": 0, "misses": 0, "lookup_misses": 0, "wrong_bytes": 0, "hangs": 0, "store_failed": 0,
                  "errors": 0, "max_task_s": 0.0}

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                if k == "max_task_s":
                    self.c[k] = max(self.c[k], v)
                else:
                    self.c[k] += v

    def merge(self, other: dict) -> None:
        self.add(**other)


def _wait_fd(fd: int, timeout: float) -> None:
    p = select.poll()
    p.register(fd, select.POLLIN)
    if p.poll(max(timeout, 0.001) * 1000):
        try:
            consume_fd(fd)
        except BlockingIOError:
            pass


def _timed(stats: Stats, t0: float) -> bool:
    dt = time.monotonic() - t0
    stats.add(tasks=1, max_task_s=dt)
    if dt > DEADLINE_MS / 1000 + MARGIN_S:
        stats.add(hangs=1)
        return False
    return True


HARD_S = DEADLINE_MS / 1000 + 30  # stop waiting for a task altogether (counted as a hang long before)


def store(a, keys, objs, stats: Stats) -> bool:
    """Store several batches at once (all in flight), wait for every one."""
    t0 = time.monotonic()
    tids = {a.submit_store_task(k, o) for k, o in zip(keys, objs)}
    ok = True
    while tids and time.monotonic() - t0 < HARD_S:
        _wait_fd(a.get_store_event_fd(), 0.05)
        for tid, r in a.pop_completed_store_tasks().items():
            if tid in tids:
                tids.discard(tid)
                ok &= r.is_successful()
                _timed(stats, t0)
    if tids:
        stats.add(hangs=len(tids))
        return False
    if not ok:
        stats.add(store_failed=1)
    return ok


def query_all(a, submits, fd, query, stats: Stats) -> list:
    t0 = time.monotonic()
    tids = [s() for s in submits]
    res: list = [None] * len(tids)
    left = set(range(len(tids)))
    while left and time.monotonic() - t0 < HARD_S:
        for i in list(left):
            r = query(tids[i])
            if r is not None:
                res[i] = r
                left.discard(i)
                _timed(stats, t0)
        if left:
            _wait_fd(fd, 0.05)
    stats.add(hangs=len(left))
    return res


def lookup_load_verify(a, batches, stats: Stats, pause: float = 0.0) -> int:
    """Lookup-and-lock, (wait `pause` s, as LMCache plans between the two),
    load the found keys, check every hit's bytes, unlock. Returns the number
    of hits whose bytes were right."""
    bms = query_all(a, [lambda b=b: a.submit_lookup_and_lock_task(b, {0: EMPTY}) for b in batches],
                    a.get_lookup_and_lock_event_fd(), a.query_lookup_and_lock_result, stats)
    time.sleep(pause)
    found = [[k for i, k in enumerate(b) if bm is not None and bm.test(i)] for b, bm in zip(batches, bms)]
    stats.add(lookup_misses=sum(len(b) for b in batches) - sum(len(f) for f in found))
    found = [f for f in found if f]
    dsts = [[make_obj() for _ in f] for f in found]
    lbms = query_all(a, [lambda f=f, d=d: a.submit_load_task(f, d) for f, d in zip(found, dsts)],
                     a.get_load_event_fd(), a.query_load_result, stats)
    good = 0
    for f, d, bm in zip(found, dsts, lbms):
        for i, (k, o) in enumerate(zip(f, d)):
            if bm is not None and bm.test(i):
                if torch.equal(o.tensor, expected(k)):
                    good += 1
                else:
                    stats.add(wrong_bytes=1)
            else:
                stats.add(misses=1)
    stats.add(hits=good)
    for f in found:
        a.submit_unlock(f)
    return good


# ---- the sidecar's state ---------------------------------------------------------

def status(sock: str) -> dict:
    out = subprocess.run([BIN, "status", "--socket", sock, "--json"], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout)


def removal_log_full(sock: str) -> bool:
    """The sidecar's removal log has dropped its oldest entries (it is at its
    fixed capacity): asked from its first position, it says truncated."""
    from cxlkv_lmcache._proto import cxlkv_pb2 as pb
    from cxlkv_lmcache.client import channel, stub

    ch = channel(sock)
    try:
        return stub(ch).Removed(pb.RemovedRequest(since=1, max=1), timeout=5).truncated
    finally:
        ch.close()


def rss_kib(pid: int) -> dict:
    """VmRSS and its parts: RssFile/RssShmem are the pool file's pages the
    sidecar has touched (they grow with the pool's use, up to the pool size,
    and are not the process's own memory); RssAnon is its heap and stacks."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name = line.split(":")[0]
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[name] = int(line.split()[1])
    return out


def back_to_baseline(sock: str, base: dict, timeout: float, pages: bool = True) -> tuple[bool, dict]:
    """No locked keys, no reservations and (once every key is deleted) no
    keys and, with `pages`, the pages in use before the scenario. Locks of a
    dead client end with their TTL, reservations with the reservation
    timeout, a follower's holds once idle, and after a restart the pages of
    objects that were being written stay quarantined for the reservation
    timeout (a writer of the old process may still be copying): wait up to
    `timeout` for all of them."""
    deadline = time.monotonic() + timeout
    s = status(sock)
    while time.monotonic() < deadline:
        s = status(sock)
        if s["locked_keys"] == 0 and s["reserved"] == 0:
            break
        time.sleep(0.2)
    delete_all(sock)
    s = status(sock)
    while pages and s["pages_used"] != base["pages_used"] and time.monotonic() < deadline:
        time.sleep(0.2)
        s = status(sock)
    ok = s["locked_keys"] == 0 and s["reserved"] == 0 and s["keys"] == 0
    shown = ["locked_keys", "reserved", "keys"]
    if pages:
        ok &= s["pages_used"] == base["pages_used"]
        shown.append("pages_used")
    return ok, {k: s[k] for k in shown}


def delete_all(sock: str, timeout: float = 20.0) -> None:
    """Delete every key through the plain gRPC API (ListKeys + Delete). A
    primary that took over moments ago deletes nothing until the holds the
    previous one granted have lapsed, and says UNAVAILABLE, retry: so do
    that, within `timeout`."""
    import grpc

    from cxlkv_lmcache._proto import cxlkv_pb2 as pb
    from cxlkv_lmcache._proto import cxlkv_pb2_grpc as pbg
    from cxlkv_lmcache.client import channel

    ch = channel(sock)
    deadline = time.monotonic() + timeout
    try:
        stub = pbg.CxlkvStub(ch)
        while True:
            keys = [k.key for k in stub.ListKeys(pb.ListKeysRequest(page_size=1000), timeout=10).keys]
            if not keys:
                return
            try:
                stub.Delete(pb.DeleteRequest(keys=keys), timeout=10)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        ch.close()


def verdict(name: str, stats: Stats, base_ok: bool, base: dict, extra: str = "", need_hits: bool = True,
            zero: dict | None = None) -> bool:
    """Print the VERDICT line; `zero`: more counters that must be 0 to pass
    (printed after wrong_bytes)."""
    c = stats.c
    zero = zero or {}
    ok = (c["wrong_bytes"] == 0 and c["hangs"] == 0 and base_ok and c["errors"] == 0
          and (c["hits"] > 0 or not need_hits) and not any(zero.values()))
    more = "".join(f"{k}={v} " for k, v in zero.items())
    print(f"VERDICT {name} {'PASS' if ok else 'FAIL'} tasks={c['tasks']} hits={c['hits']} load_misses={c['misses']} "
          f"lookup_misses={c['lookup_misses']} wrong_bytes={c['wrong_bytes']} {more}hangs={c['hangs']} "
          f"errors={c['errors']} store_failed={c['store_failed']} "
          f"max_task_s={c['max_task_s']:.2f} deadline_s={DEADLINE_MS / 1000:.1f} baseline={'ok' if base_ok else 'NOT'} "
          f"{json.dumps(base)} {extra}", flush=True)
    return ok


# ---- load loops -------------------------------------------------------------------

def plugin(sock: str, **kw) -> dict:
    return plugin_spec(sock, deadline_ms=DEADLINE_MS, **kw)


def round_trip(a, salt: int, in_flight: int, per: int, stats: Stats) -> None:
    """One round: `in_flight` batches of `per` keys stored at once, looked up,
    loaded and checked at once, then deleted."""
    batches = [[key(b * per + i, salt) for i in range(per)] for b in range(in_flight)]
    store(a, batches, [[filled(k) for k in b] for b in batches], stats)
    lookup_load_verify(a, batches, stats)
    a.delete([k for b in batches for k in b])


def loop(a, stats: Stats, stop: threading.Event, salt0: int, in_flight: int = 8, per: int = 4) -> None:
    salt = salt0
    while not stop.is_set():
        try:
            round_trip(a, salt, in_flight, per, stats)
        except Exception as e:  # an exception out of the adapter is an error, not a miss
            log(f"error: {e!r}")
            stats.add(errors=1)
        salt += 1


def new_sidecar(tmp: pathlib.Path, pool: str = "64MiB", extra: tuple = ()) -> tuple[Sidecar, dict]:
    sc = Sidecar(tmp, pool_size=pool, extra=extra).start()
    return sc, status(sc.socket)


# ---- soak -------------------------------------------------------------------------

class Tracebacks(logging.Handler):
    """Counts the exceptions the plugin logs (a task that failed on a bug of
    its own, not on the sidecar's answer): each is an error of the scenario."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.n += 1

    def __enter__(self) -> "Tracebacks":
        logging.getLogger("cxlkv_lmcache").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("cxlkv_lmcache").removeHandler(self)


SOAK_KEYS = 96  # per client; 8 clients x 96 x 64 KiB = 48 MiB against a 16 MiB pool: eviction runs


def child_soak(sock: str, worker: int, seconds: float, readers_of: int = 0) -> None:
    """Mixed store / lookup+load / delete on this worker's keys; prints its
    counters as JSON at the end. With `readers_of` > 0, lookups read the keys
    of any of that many workers (in a cluster: keys other nodes stored)."""
    with Tracebacks() as tracebacks:
        a = build(plugin(sock))
        print("ready", flush=True)
        stats = Stats()
        rng = random.Random(worker)
        end = time.monotonic() + seconds
        ops = 0
        while time.monotonic() < end:
            try:
                op = rng.random()
                keys = [key(rng.randrange(SOAK_KEYS), worker) for _ in range(4)]
                keys = list(dict.fromkeys(keys))
                if op < 0.5:
                    if not store(a, [keys], [[filled(k) for k in keys]], stats) and not readers_of:
                        stats.add(errors=1)
                elif op < 0.95:
                    owner = rng.randrange(readers_of) if readers_of else worker
                    keys = list(dict.fromkeys(key(rng.randrange(SOAK_KEYS), owner) for _ in range(4)))
                    lookup_load_verify(a, [keys], stats, pause=rng.uniform(0, 0.05) if readers_of else 0.0)
                else:
                    a.delete(keys)
                ops += 1
            except Exception as e:
                print(f"error: {e!r}", file=sys.stderr, flush=True)
                stats.add(errors=1)
        a.close()
    stats.add(errors=tracebacks.n)
    print(json.dumps({**stats.c, "ops": ops}), flush=True)


def start_soakers(socks: list[str], args, readers_of: int = 0) -> list[subprocess.Popen]:
    """`args.clients` child_soak processes, worker w on socks[w % len(socks)];
    returns once every one is ready (LMCache's import takes seconds)."""
    extra = [str(readers_of)] if readers_of else []
    kids = [subprocess.Popen([sys.executable, str(ROOT / "scripts" / "faults.py"), "--child-soak", socks[w % len(socks)], str(w),
                              str(args.seconds), *extra], stdout=subprocess.PIPE, text=True)
            for w in range(args.clients)]
    for p in kids:
        p.stdout.readline()
    return kids


def collect_soakers(kids: list[subprocess.Popen], args) -> tuple[Stats, int]:
    """Every child's counters merged (a child that failed counts an error),
    and the ops they made."""
    stats = Stats()
    ops = 0
    for p in kids:
        out, _ = p.communicate(timeout=args.seconds + 120)
        if p.returncode != 0:
            stats.add(errors=1)
            continue
        c = json.loads(out.strip().splitlines()[-1])
        ops += c.pop("ops")
        stats.merge(c)
    return stats, ops
