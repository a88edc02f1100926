"""Fault injection and soak runs of the cxlkv LMCache plugin against a real
sidecar. Every scenario ends with a machine-checked verdict:

- wrong bytes: every hit's bytes are compared with content derived from its key
  (a hit with other bytes is counted; the verdict needs 0);
- hangs: every adapter task is timed from submit to result; one taking longer
  than the plugin's deadline plus a margin is counted (the verdict needs 0);
- baseline: after the scenario the sidecar (`cxlkv status --json`) is back to
  no locked keys, no reservations and the pages it used before it.

Scenarios: `fault-inject` (LMCache's fault_inject L2 adapter wrapper around the
plugin, 10 % of loads failing, 16 submits in flight), `kill9` (kill -9 of the
sidecar under load, restart on the same pool), `stop-cont` (SIGSTOP/SIGCONT of
the sidecar under load), `client-kill` (a client process killed with -9 while
it copies), `cluster` (three nodes on one pool small enough to evict, clients
on every node reading every node's keys, followers answering from their
holds), and `soak` (N client processes of mixed store/lookup/load/delete on
a pool small enough to evict, sidecar RSS sampled at start/middle/end).
Prints `VERDICT <scenario> PASS|FAIL ...` lines; exits 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python" / "tests"))

import torch  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402
from lmcache.v1.platform import consume_fd  # noqa: E402

from cxlkv_testkit import BIN, Sidecar, free_port, plugin_spec  # noqa: E402

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


def delete_all(sock: str) -> None:
    """Delete every key through the plain gRPC API (ListKeys + Delete)."""
    from cxlkv_lmcache._proto import cxlkv_pb2 as pb
    from cxlkv_lmcache._proto import cxlkv_pb2_grpc as pbg
    from cxlkv_lmcache.client import channel

    ch = channel(sock)
    try:
        stub = pbg.CxlkvStub(ch)
        while True:
            keys = [k.key for k in stub.ListKeys(pb.ListKeysRequest(page_size=1000), timeout=10).keys]
            if not keys:
                return
            stub.Delete(pb.DeleteRequest(keys=keys), timeout=10)
    finally:
        ch.close()


def verdict(name: str, stats: Stats, base_ok: bool, base: dict, extra: str = "", need_hits: bool = True) -> bool:
    c = stats.c
    ok = (c["wrong_bytes"] == 0 and c["hangs"] == 0 and base_ok and c["errors"] == 0
          and (c["hits"] > 0 or not need_hits))
    print(f"VERDICT {name} {'PASS' if ok else 'FAIL'} tasks={c['tasks']} hits={c['hits']} load_misses={c['misses']} "
          f"lookup_misses={c['lookup_misses']} wrong_bytes={c['wrong_bytes']} hangs={c['hangs']} errors={c['errors']} store_failed={c['store_failed']} "
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


# ---- scenarios --------------------------------------------------------------------

def s_fault_inject(tmp: pathlib.Path, args) -> bool:
    sc, base = new_sidecar(tmp)
    stats = Stats()
    spec = {"type": "fault_inject", "rate": 0.1, "seed": 7, "inner": plugin(sc.socket)}
    a = build(spec)
    try:
        for r in range(args.rounds):
            round_trip(a, 1000 + r, 16, 8, stats)
    finally:
        a.close()
    # The same wrapper under LMCache's own benchmark entry point (its own
    # verification compares failed loads too, so it runs with --skip-verify;
    # the verdict needs it to finish within its time and exit 0).
    t0 = time.monotonic()
    cli = subprocess.run([str(pathlib.Path(sys.executable).parent / "lmcache"), "bench", "l2", "--l2-adapter",
                          json.dumps(spec), "--in-flight", "32", "--num-keys", "16", "--data-size-kb", "64",
                          "--rounds", str(max(2, args.rounds // 4)), "--lookup-max-hit-rate", "1.0"],
                         capture_output=True, text=True, timeout=300)
    cli_s = time.monotonic() - t0
    if cli.returncode != 0:
        log(cli.stdout[-3000:] + cli.stderr[-3000:])
        stats.add(errors=1)
    ok, st = back_to_baseline(sc.socket, base, 15)
    sc.stop()
    faulted = stats.c["misses"] / max(1, stats.c["misses"] + stats.c["hits"])
    if not 0.03 < faulted < 0.2:  # the wrapper must really have failed about 10 % of loads
        stats.add(errors=1)
    return verdict("fault-inject", stats, ok, st, f"faulted_share={faulted:.3f} lmcache_bench_l2_rc={cli.returncode} "
                   f"lmcache_bench_l2_s={cli_s:.1f}")


def _under_load(tmp: pathlib.Path, name: str, disturb, seconds: float) -> bool:
    sc, base = new_sidecar(tmp)
    stats, after = Stats(), Stats()
    a = build(plugin(sc.socket))
    stop = threading.Event()
    th = threading.Thread(target=loop, args=(a, stats, stop, 1))
    th.start()
    time.sleep(seconds / 3)
    disturb(sc)
    time.sleep(seconds / 3)
    stop.set()
    th.join(timeout=HARD_S * 4)
    hung = th.is_alive()
    # After the disturbance the same adapter must serve again: a few rounds, all checked.
    for r in range(5):
        round_trip(a, 900_000 + r, 8, 4, after)
    a.close()
    stats.merge({k: v for k, v in after.c.items()})
    if hung or after.c["hits"] == 0:
        stats.add(errors=1)
    ok, st = back_to_baseline(sc.socket, base, 15)
    sc.stop()
    return verdict(name, stats, ok, st, f"hits_after={after.c['hits']}")


def s_kill9(tmp: pathlib.Path, args) -> bool:
    def disturb(sc: Sidecar) -> None:
        log("kill -9 of the sidecar under load")
        sc.kill()
        time.sleep(1)
        sc.start()
        log("sidecar restarted on the same pool")
    return _under_load(tmp, "kill9", disturb, args.seconds)


def s_stop_cont(tmp: pathlib.Path, args) -> bool:
    def disturb(sc: Sidecar) -> None:
        log(f"SIGSTOP of the sidecar for {2 * DEADLINE_MS / 1000:.0f} s under load")
        sc.signal(signal.SIGSTOP)
        time.sleep(2 * DEADLINE_MS / 1000)
        sc.signal(signal.SIGCONT)
        log("SIGCONT")
    return _under_load(tmp, "stop-cont", disturb, args.seconds)


BIG = 1 << 20  # the killed client copies 1 MiB objects, so a kill lands mid-copy


def child_writer(sock: str, salt: int) -> None:
    """Store 1 MiB objects and take locks without unlocking, until killed."""
    a = build(plugin(sock, lock_ttl_ms=2000))
    stats = Stats()
    i = 0
    while True:
        keys = [key(i + j, salt) for j in range(8)]
        objs = []
        for k in keys:
            o = make_obj(BIG)
            o.tensor.copy_(expected(k, BIG))
            objs.append(o)
        store(a, [keys], [objs], stats)
        query_all(a, [lambda: a.submit_lookup_and_lock_task(keys, {0: EMPTY})], a.get_lookup_and_lock_event_fd(),
                  a.query_lookup_and_lock_result, stats)
        print(i + 8, flush=True)
        i += 8


def s_client_kill(tmp: pathlib.Path, args) -> bool:
    sc, base = new_sidecar(tmp, pool="128MiB")
    stats = Stats()
    rng = random.Random(5)
    salts = []
    for n in range(args.kills):
        salt = 500 + n
        salts.append(salt)
        p = subprocess.Popen([sys.executable, __file__, "--child-writer", sc.socket, str(salt)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        p.stdout.readline()  # it has stored and locked once: now kill it while it copies
        time.sleep(rng.uniform(0.05, 0.5))
        p.kill()
        p.wait()
        log(f"client {n} killed with -9")
    # Whatever the dead clients committed is checked byte for byte.
    a = build(plugin(sc.socket))
    for salt in salts:
        for start in range(0, 400, 8):
            keys = [key(start + j, salt) for j in range(8)]
            bm = query_all(a, [lambda: a.submit_lookup_and_lock_task(keys, {0: EMPTY})],
                           a.get_lookup_and_lock_event_fd(), a.query_lookup_and_lock_result, stats)[0]
            found = [k for i, k in enumerate(keys) if bm is not None and bm.test(i)]
            if not found:
                continue
            dst = [make_obj(BIG) for _ in found]
            lbm = query_all(a, [lambda: a.submit_load_task(found, dst)], a.get_load_event_fd(), a.query_load_result,
                            stats)[0]
            for i, (k, o) in enumerate(zip(found, dst)):
                if lbm is not None and lbm.test(i):
                    if torch.equal(o.tensor, expected(k, BIG)):
                        stats.add(hits=1)
                    else:
                        stats.add(wrong_bytes=1)
            a.submit_unlock(found)
    a.close()
    # Locks of the dead clients end with their 2 s TTL, their reservations
    # with the sidecar's reservation timeout (10 s by default).
    ok, st = back_to_baseline(sc.socket, base, 30)
    sc.stop()
    return verdict("client-kill", stats, ok, st, f"kills={args.kills}")


# ---- soak -------------------------------------------------------------------------

SOAK_KEYS = 96  # per client; 8 clients x 96 x 64 KiB = 48 MiB against a 16 MiB pool: eviction runs


def child_soak(sock: str, worker: int, seconds: float, readers_of: int = 0) -> None:
    """Mixed store / lookup+load / delete on this worker's keys; prints its
    counters as JSON at the end. With `readers_of` > 0, lookups read the keys
    of any of that many workers (in a cluster: keys other nodes stored)."""
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
    print(json.dumps({**stats.c, "ops": ops}), flush=True)


def start_soakers(socks: list[str], args, readers_of: int = 0) -> list[subprocess.Popen]:
    """`args.clients` child_soak processes, worker w on socks[w % len(socks)];
    returns once every one is ready (LMCache's import takes seconds)."""
    extra = [str(readers_of)] if readers_of else []
    kids = [subprocess.Popen([sys.executable, __file__, "--child-soak", socks[w % len(socks)], str(w),
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


def s_soak(tmp: pathlib.Path, args) -> bool:
    sc, base = new_sidecar(tmp, pool="16MiB")
    pid = sc.proc.pid
    kids = start_soakers([sc.socket], args)
    t0 = time.monotonic()  # from when every client is ready
    # The baseline is steady state: after 10 % of the run and once the
    # removal log (a fixed number of entries kept for clients catching up,
    # ~10 MiB here when full) has filled, or at 60 % of the run if it never
    # fills. Middle: halfway from there to the end.
    time.sleep(max(0.0, t0 + args.seconds * 0.1 - time.monotonic()))
    while not removal_log_full(sc.socket) and time.monotonic() < t0 + args.seconds * 0.6:
        time.sleep(1)
    at = {"start": (time.monotonic() - t0) / args.seconds}
    at["middle"] = (at["start"] + 0.97) / 2
    at["end"] = 0.97
    log_full = removal_log_full(sc.socket)
    rss = {}
    for label in ("start", "middle", "end"):
        time.sleep(max(0.0, t0 + args.seconds * at[label] - time.monotonic()))
        rss[label] = rss_kib(pid)
        log(f"sidecar RSS at {label} ({at[label]:.0%} of the run, removal log full: {log_full}) (KiB): {rss[label]}")
    stats, ops = collect_soakers(kids, args)
    evictions = status(sc.socket)["evictions"]
    # Flat: the sidecar's own memory (RssAnon) at the middle and the end at
    # most 1.25 x its value at the start (steady state, above) plus 4 MiB.
    # RssShmem (pool pages touched) is reported but bounded by the pool, not
    # checked.
    bound = int(rss["start"]["RssAnon"] * 1.25) + 4096
    flat = max(rss["middle"]["RssAnon"], rss["end"]["RssAnon"]) <= bound
    if not flat or evictions == 0:
        stats.add(errors=1)
    ok, st = back_to_baseline(sc.socket, base, 15)
    sc.stop()
    return verdict("soak", stats, ok, st, f"clients={args.clients} seconds={args.seconds:.0f} ops={ops} "
                   f"evictions={evictions} rss_kib={json.dumps(rss)} rss_at={json.dumps(at)} "
                   f"removal_log_full={log_full} rss_bound_kib={bound} rss_flat={flat}")


CLUSTER_TIMINGS = "[cluster]\nheartbeat_ms = 100\nlease_ms = 600\ndead_after_ms = 1000\nforward_timeout_ms = 500\n"


def s_cluster(tmp: pathlib.Path, args) -> bool:
    """Three nodes on one pool small enough to evict (a the primary, b and c
    followers that hold what their clients read): clients on every node store
    their own keys and read everyone's, so most hits are bytes another node
    wrote, many answered from a follower's holds while that node's stores
    evict (FIFO, so only a lock keeps a just-read entry; readers pause up to
    50 ms between lookup and load). Store failures (a node whose every entry some reader holds) are
    counted, not errors; wrong bytes, a hit that does not load, hangs and a
    primary left with locks or reservations fail it."""
    cfg = tmp / "cluster.toml"
    cfg.write_text(CLUSTER_TIMINGS)
    peer = f"127.0.0.1:{free_port()}"
    nodes = {}
    try:
        for name, role in (("a", ("--peer-addr", peer)), ("b", ("--primary-addr", peer)),
                           ("c", ("--primary-addr", peer))):
            # FIFO: a read does not save an entry from eviction, only its lock
            # (here mostly a follower's hold) does.
            nodes[name] = Sidecar(tmp, name, pool_size="16MiB",
                                  extra=("--config", str(cfg), "--node-name", name, "--primary", "a",
                                         "--eviction-policy", "fifo", *role))
            nodes[name].start()
        base = status(nodes["a"].socket)
        kids = start_soakers([nodes[n].socket for n in "abc"], args, readers_of=args.clients)
        # What the followers hold, sampled through the run (it must exercise
        # holds): the most each held at once.
        held_max = {"a": 0, "b": 0, "c": 0}
        end = time.monotonic() + args.seconds * 0.9
        while time.monotonic() < end:
            for n in status(nodes["a"].socket)["cluster_nodes"]:
                held_max[n["name"]] = max(held_max[n["name"]], n["held_keys"])
            time.sleep(0.25)
        stats, ops = collect_soakers(kids, args)
        st = status(nodes["a"].socket)
        evictions, held = st["evictions"], {n["name"]: n["held_keys"] for n in st["cluster_nodes"]}
        # A locked hit is never evicted before its unlock, through a
        # follower's hold as at the primary: every hit loads.
        if evictions == 0 or held_max["b"] + held_max["c"] == 0 or stats.c["misses"]:
            stats.add(errors=1)
        # The followers give their holds back once idle; then nothing is
        # locked or reserved, and every key deletes.
        ok, left = back_to_baseline(nodes["a"].socket, base, 15, pages=False)
        return verdict("cluster", stats, ok, left, f"clients={args.clients} seconds={args.seconds:.0f} ops={ops} "
                       f"evictions={evictions} held_keys_max={json.dumps(held_max)} held_keys_end={json.dumps(held)}")
    finally:
        for n in reversed(list(nodes.values())):
            n.kill()


SCENARIOS = {"fault-inject": s_fault_inject, "kill9": s_kill9, "stop-cont": s_stop_cont,
             "client-kill": s_client_kill, "soak": s_soak, "cluster": s_cluster}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child-writer":
        return child_writer(sys.argv[2], int(sys.argv[3]))
    if len(sys.argv) > 1 and sys.argv[1] == "--child-soak":
        return child_soak(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5:6] and sys.argv[5] or 0))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenarios", nargs="*", help=f"some of {', '.join(SCENARIOS)} (default: all but soak)")
    ap.add_argument("--rounds", type=int, default=40, help="fault-inject: rounds of 16 x 8 keys in flight")
    ap.add_argument("--seconds", type=float, default=30, help="kill9/stop-cont: load time; soak: run time")
    ap.add_argument("--kills", type=int, default=5, help="client-kill: clients killed mid-copy")
    ap.add_argument("--clients", type=int, default=8, help="soak, cluster: client processes")
    args = ap.parse_args()
    args.scenarios = args.scenarios or ["fault-inject", "kill9", "stop-cont", "client-kill", "cluster"]
    if unknown := [s for s in args.scenarios if s not in SCENARIOS]:
        ap.error(f"unknown scenarios {unknown}: choose from {list(SCENARIOS)}")
    ok = True
    for name in args.scenarios:
        t = time.monotonic()
        log(f"== {name}")
        with tempfile.TemporaryDirectory(prefix=f"cxlkv-{name}-") as d:
            ok &= SCENARIOS[name](pathlib.Path(d), args)
        log(f"== {name} took {time.monotonic() - t:.1f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
