"""The `views` fault scenario: LMCache's in-process engine (its own
StorageManager, LocalCPUBackend as L1, the cxlkv backend as a storage
plugin) reading chunks that its L1 keeps as views of the pool, while the
engines' connections are reset (`ss -K` on the sidecar's TCP port), the
sidecar is killed (-9) and restarted on the same pool, another client
deletes the engines' chunks and refills the pool, and the engines hold more
views than their budget. Every read (from L1 or from the pool) is
byte-checked against the chunk's seed: the verdict needs 0 foreign bytes,
every call within its deadline, every engine able to store at the end, and
the sidecar back to no locks and no reservations once the engines closed.
docs/FAULTS.md has the figures of a long run."""

from __future__ import annotations

import pathlib
import random
import subprocess
import threading
import time

import grpc
from faultkit import Stats, back_to_baseline, log, status, verdict

from cxlkv_testkit import (Sidecar, clear_l1, engine_chunk, engine_key, engine_storage_manager, free_port,
                           same_chunk, wait_for)

DEADLINE_MS = 1000
LATE_S = 2.0  # a call may end this much after its deadline on a loaded 2-core machine
ENGINES = 2
KEYS = 160  # chunks each engine writes and reads (64 KiB each)


class Counts(Stats):
    def __init__(self) -> None:
        super().__init__()
        self.c.update({"reads": 0, "pool_views": 0, "foreign": 0, "stored": 0, "resets": 0, "restarts": 0, "deletes": 0,
                       "refills": 0, "max_call_s": 0.0})

    def timed(self, t0: float) -> None:
        dt = time.monotonic() - t0
        with self.lock:
            self.c["max_call_s"] = max(self.c["max_call_s"], dt)
        if dt > DEADLINE_MS / 1000 + LATE_S:
            self.add(hangs=1)


def check(obj, seed: int, n: Counts, pool) -> None:
    """One object LMCache handed out for `seed`: its bytes, or a miss.
    `pool_views` counts the hits that were views of the pool."""
    if obj is None:
        n.add(reads=1, misses=1)
        return
    try:
        if not obj.is_valid() or obj.tensor is None:
            n.add(reads=1, misses=1)
        elif same_chunk(obj, seed):
            n.add(reads=1, hits=1, pool_views=int(pool is not None and pool.contains(obj.data_ptr)))
        else:
            n.add(reads=1, foreign=1)
            log(f"FOREIGN bytes read for chunk {seed}")
    finally:
        obj.ref_count_down()


def engine(sm, seeds: list[int], n: Counts, stop: threading.Event, rng: random.Random) -> None:
    """Store the engine's chunks, then read them (L1 first, as LMCache's
    retrieve does; a pool hit is written back into L1 as a view), now and
    then storing them again and reading a prefix in one batch."""
    core = sm.storage_backends["cxlkv"]._core

    def pool():
        return core.conn.pool

    while not stop.is_set():
        try:
            if rng.random() < 0.1:
                batch = rng.sample(seeds, 16)
                t0 = time.monotonic()
                sm.batched_put([engine_key(s) for s in batch], [engine_chunk(sm, s) for s in batch])
                n.timed(t0)
            seed = rng.choice(seeds)
            t0 = time.monotonic()
            obj = sm.get(engine_key(seed))  # L1, else the pool (written back into L1)
            n.timed(t0)
            check(obj, seed, n, pool())
            if rng.random() < 0.02:
                clear_l1(sm)  # views referenced elsewhere stay
            if rng.random() < 0.05:
                run = seeds[rng.randrange(0, len(seeds) - 8):][:8]
                t0 = time.monotonic()
                objs = sm.batched_get([engine_key(s) for s in run])
                n.timed(t0)
                for o, s in zip(objs, run):
                    check(o, s, n, pool())
        except Exception as e:  # the backend never raises: anything here is a defect
            n.add(errors=1)
            log(f"engine error: {e!r}")


def attacker(sock: str, seeds: list[int], n: Counts, stop: threading.Event, rng: random.Random) -> None:
    """Another client: deletes the engines' chunks and refills the pool."""
    from cxlkv_lmcache import client as cl
    from cxlkv_lmcache import keys as keycodec
    from cxlkv_lmcache._proto import cxlkv_pb2 as pb

    filler = None
    base = 1_000_000
    while not stop.is_set():
        try:
            if filler is None:
                filler = engine_storage_manager(sock, cpu_gb=0.1, deadline_ms=DEADLINE_MS)
            ch = cl.channel(sock)
            try:
                keys = [keycodec.encode_engine_key(engine_key(s)) for s in rng.sample(seeds, 16)]
                rep = cl.stub(ch).Delete(pb.DeleteRequest(keys=keys), timeout=2)
                n.add(deletes=sum(st.code == 0 for st in rep.statuses))
            except grpc.RpcError:
                pass
            finally:
                ch.close()
            batch = list(range(base, base + 32))
            base += 32
            filler.batched_put([engine_key(s) for s in batch], [engine_chunk(filler, s) for s in batch])
            clear_l1(filler)
            n.add(refills=1)
            time.sleep(0.05)
        except Exception as e:
            log(f"attacker: {e!r}")
            time.sleep(0.2)
    if filler is not None:
        filler.close()


def faults(sc: Sidecar, port: int, n: Counts, stop: threading.Event, rng: random.Random) -> None:
    """Every 1-3 s: reset the engines' TCP connections, or kill -9 and
    restart the sidecar on the same pool."""
    while not stop.wait(rng.uniform(1.0, 3.0)):
        if rng.random() < 0.6:
            subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", f":{port}"], capture_output=True)
            n.add(resets=1)
        else:
            sc.kill()
            time.sleep(rng.uniform(0.0, 1.5))
            sc.start()
            n.add(restarts=1)


def stores_again(sm, fresh: list[int]) -> bool:
    """The engine's backend is healthy and a batch it stores is there. A
    sidecar restarted by the last fault evicts nothing during its grace
    period (readers of the old instance may still hold what it would
    evict), and the pool is full: a put in that window is skipped, as the
    sidecar says (RESOURCE_EXHAUSTED). So the engine puts again, once a
    second, for at most a minute; each put is LMCache's own."""
    be = sm.storage_backends.get("cxlkv")
    if be is None:
        log("an engine has no cxlkv backend")
        return False
    if not wait_for(lambda: be.report_status()["is_healthy"], timeout=15):
        return False
    t = time.monotonic()
    while time.monotonic() - t < 60:
        sm.batched_put([engine_key(s) for s in fresh], [engine_chunk(sm, s) for s in fresh])
        if wait_for(lambda: sum(be.contains(engine_key(s)) for s in fresh) == len(fresh), timeout=1):
            log(f"an engine stored again {time.monotonic() - t:.1f} s after the faults")
            return True
    return False


def s_views(tmp: pathlib.Path, args) -> bool:
    port = free_port()
    sc = Sidecar(tmp, pool_size="32MiB", extra=("--tcp", f"127.0.0.1:{port}")).start()
    base = status(sc.socket)
    n = Counts()
    rng = random.Random(args.seed if args.seed is not None else 11)
    # One engine over TCP (its connection is what ss -K resets), one over the
    # Unix socket; both with view budgets smaller than what they read.
    sms = [engine_storage_manager(sc.socket, cpu_gb=0.1, deadline_ms=DEADLINE_MS, poll_interval_ms=100,
                                  max_view_bytes=48 << 16, lock_ttl_ms=3000,
                                  **({"tcp_address": f"127.0.0.1:{port}"} if i == 0 else {}))
           for i in range(ENGINES)]
    if missing := [i for i, sm in enumerate(sms) if "cxlkv" not in sm.storage_backends]:
        raise RuntimeError(f"engines {missing} did not load the cxlkv backend (see LMCache's log above)")
    seeds = [list(range(i * 10_000, i * 10_000 + KEYS)) for i in range(ENGINES)]
    for sm, ss in zip(sms, seeds):
        for i in range(0, len(ss), 16):
            sm.batched_put([engine_key(s) for s in ss[i:i + 16]], [engine_chunk(sm, s) for s in ss[i:i + 16]])
    stop = threading.Event()
    threads = [threading.Thread(target=engine, args=(sm, ss, n, stop, random.Random(rng.random())))
               for sm, ss in zip(sms, seeds)]
    threads.append(threading.Thread(target=attacker, args=(sc.socket, sum(seeds, []), n, stop,
                                                           random.Random(rng.random()))))
    threads.append(threading.Thread(target=faults, args=(sc, port, n, stop, random.Random(rng.random()))))
    able, leased = 0, 0
    try:
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        hung = any(t.is_alive() for t in threads)
        # Every engine stores again once the faults stop.
        for i, sm in enumerate(sms):
            able += stores_again(sm, list(range(500_000 + i * 100, 500_000 + i * 100 + 8)))
        # Chunks stored through pages leased ahead (the stores' other path).
        leased = sum(sm.storage_backends["cxlkv"]._core.leases.bound for sm in sms)
    finally:
        stop.set()
        for sm in sms:
            sm.close()
    if hung or able < ENGINES:
        n.add(errors=1)
    n.c["wrong_bytes"] = n.c["foreign"]
    ok, st = back_to_baseline(sc.socket, base, 30, pages=False)
    sc.stop()
    c = n.c
    return verdict("views", n, ok, st, zero={"foreign": c["foreign"]}, extra=(
                   f"reads={c['reads']} hits={c['hits']} pool_views={c['pool_views']} foreign={c['foreign']} "
                   f"misses={c['misses']} "
                   f"resets={c['resets']} restarts={c['restarts']} deletes={c['deletes']} refills={c['refills']} "
                   f"engines_storing_at_end={able}/{ENGINES} stored_through_leases={leased} "
                   f"max_call_s={c['max_call_s']:.2f}"))
