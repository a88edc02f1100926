"""The event plane's figures (issue #37), against one release sidecar with
its events published on ZMQ in vLLM's format:

- `events_store_ratio_2MiB`: stores of 2 MiB objects (Reserve, the copy
  into the mapped pool, Commit; the pool full, so each also evicts one) with
  one stalled and one live ZMQ subscriber, divided by the same stores with
  none; rounds of each interleaved in one sidecar, medians compared. The
  subscribers are separate processes (`--subscriber`), as a router's would
  be, so their CPU is not the store loop's.
- `events_per_s_churn`: events a live subscriber received per second, every
  sequence in order, while 4 KiB stores churn a full pool (two events a
  store: the stored key and the one evicted for it), with
  `events_published_per_s_churn` what the sidecar published meanwhile.
- `events_latency_p50_ms` / `events_latency_p99_ms`: from the Commit call's
  start to the live subscriber decoding that key's BlockStored, one store
  every few ms (the batcher's time bound, `[events] batch_delay_ms` = 10,
  is most of it).

Prints `BENCH <name> <value>` lines; `--quick` is a seconds-long smoke run
(timing not asserted). Full mode writes the "Event plane" section of
docs/BENCHMARKS.md (scripts/bench.sh runs it after bench.py, which writes
the rest of that file).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = os.environ.get("CXLKV_BIN", str(ROOT / "target" / "release" / "cxlkv"))
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fnv1a(k: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in k:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h - (1 << 64) if h >= 1 << 63 else h  # a plain key's block hash (src/events/zmq.rs)


# ------------------------------------------------------------ the subscriber


def subscriber(pub: str, rep: str, mode: str) -> None:
    """A ZMQ subscriber process. `stalled`: connects and never reads (small
    receive buffers, so the sidecar's side fills). `live`: reads and decodes
    every batch (vLLM's array form), prints `GAP` on a jump in sequence and,
    every second and at SIGTERM, `COUNT <events> <batches> <gaps>`."""
    import msgspec
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if mode == "stalled":
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.RCVBUF, 4096)
    sub.connect(pub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    print("READY", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if mode == "stalled":
        while not stop.is_set():
            time.sleep(0.05)
        return
    dec = msgspec.msgpack.Decoder()
    events = batches = gaps = 0
    last = None
    next_report = time.monotonic() + 1
    while not stop.is_set():
        if sub.poll(50):
            _, seq, payload = sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if last is not None and seq != last + 1:
                gaps += 1
            last = seq
            ts, evs, _rank = dec.decode(payload)
            events += len(evs)
            batches += 1
        if time.monotonic() >= next_report:
            print(f"COUNT {events} {batches} {gaps}", flush=True)
            next_report += 1
    print(f"COUNT {events} {batches} {gaps}", flush=True)


class Sub:
    def __init__(self, pub: str, rep: str, mode: str):
        self.p = subprocess.Popen([sys.executable, __file__, "--subscriber", pub, rep, mode],
                                  stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "READY"
        self.last = (0, 0, 0)
        if mode == "live":
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            if line.startswith("COUNT"):
                self.last = tuple(int(x) for x in line.split()[1:])

    def stop(self) -> tuple[int, int, int]:
        self.p.send_signal(signal.SIGTERM)
        self.p.wait(timeout=30)
        time.sleep(0.05)
        return self.last


# ------------------------------------------------------------ the sidecar


class Sidecar:
    def __init__(self, tmp: pathlib.Path, name: str, pool_size: str, page: str, region: str):
        self.pub, self.rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        self.metrics = f"127.0.0.1:{free_port()}"
        cfg = tmp / f"{name}.toml"
        cfg.write_text(f'[events]\nzmq_publish = "{self.pub}"\nzmq_replay = "{self.rep}"\n')
        self.sock = str(tmp / f"{name}.sock")
        self.pool = f"/dev/shm/cxlkv-bench-events-{os.getpid()}-{name}"
        self.p = subprocess.Popen([BIN, "serve", "--pool-path", self.pool, "--pool-size", pool_size, "--region-size",
                                   region, "--page-size", page, "--socket", self.sock, "--metrics-addr", self.metrics,
                                   "--format", "--config", str(cfg)],
                                  stdout=subprocess.DEVNULL, stderr=open(tmp / f"{name}.log", "wb"))
        deadline = time.monotonic() + 60
        while not os.path.exists(self.sock) or not self._answers():
            if self.p.poll() is not None or time.monotonic() > deadline:
                self.p.kill()
                raise SystemExit(f"cxlkv did not start: {(tmp / f'{name}.log').read_text()[-2000:]}")
            time.sleep(0.05)
        from cxlkv_lmcache import client as cl

        self.ch = cl.channel(self.sock)
        self.stub = cl.stub(self.ch)

    def _answers(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(self.sock)
            return True
        except OSError:
            return False

    def published(self) -> float:
        import urllib.request

        text = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith("cxlkv_events_published_total"):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> None:
        self.ch.close()
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.p.kill()
        if os.path.exists(self.pool):
            os.unlink(self.pool)


# ------------------------------------------------------------ the figures


def store_ratio(tmp: pathlib.Path, q: bool) -> dict[str, float]:
    """2 MiB stores into a full 256 MiB pool: rounds with no subscriber and
    with a stalled and a live one, interleaved."""
    from cxlkv_lmcache import client as cl
    from cxlkv_lmcache._proto import cxlkv_pb2 as pb

    size = 2 * MiB
    s = Sidecar(tmp, "ratio", "256MiB", "64KiB", "64MiB")
    try:
        pm = cl.PoolMap(s.stub.PoolInfo(pb.PoolInfoRequest(), timeout=10))
        src = (ctypes.c_char * size)()
        ctypes.memset(src, 0x5A, size)
        addr = ctypes.addressof(src)
        n = [0]

        def stores(count: int) -> float:
            t = time.perf_counter()
            for _ in range(count):
                n[0] += 1
                r = s.stub.Reserve(pb.ReserveRequest(tenant="t", items=[pb.ReserveItem(key=f"o{n[0]}".encode(),
                                                                                       size=size)]), timeout=30)
                res = r.reservations[0]
                assert res.status.code == 0, res.status
                pm.put(res.location, addr, size)
                c = s.stub.Commit(pb.CommitRequest(reservation_ids=[res.reservation_id]), timeout=30)
                assert c.statuses[0].code == 0, c.statuses[0]
            return count * size / (time.perf_counter() - t) / 1e9

        stores(160)  # fill the pool: every later store evicts one
        per, rounds = (40, 2) if q else (200, 9)
        base, subs = [], []
        for _ in range(rounds):
            base.append(stores(per))
            stalled, live = Sub(s.pub, s.rep, "stalled"), Sub(s.pub, s.rep, "live")
            time.sleep(0.3)  # both subscriptions reached the PUB
            subs.append(stores(per))
            got = live.stop()
            stalled.stop()
            assert got[2] == 0, f"the live subscriber saw {got[2]} gaps"
        pm.close()
        return {"events_store_gbps_2MiB_none": statistics.median(base),
                "events_store_gbps_2MiB_subscribed": statistics.median(subs),
                "events_store_ratio_2MiB": statistics.median(subs) / statistics.median(base)}
    finally:
        s.stop()


def churn(tmp: pathlib.Path, q: bool) -> dict[str, float]:
    """4 KiB stores (Reserve and Commit of 512 keys a call) on a full 64 MiB
    pool, a live subscriber counting what it receives."""
    from cxlkv_lmcache._proto import cxlkv_pb2 as pb

    s = Sidecar(tmp, "churn", "64MiB", "4KiB", "16MiB")
    try:
        def call(i: int) -> None:
            r = s.stub.Reserve(pb.ReserveRequest(tenant="t", items=[
                pb.ReserveItem(key=f"c{i}-{j}".encode(), size=4096) for j in range(512)]), timeout=30)
            ids = [x.reservation_id for x in r.reservations if x.status.code == 0]
            s.stub.Commit(pb.CommitRequest(reservation_ids=ids), timeout=30)

        i = 0
        while i < 40:  # fill (16,384 pages)
            call(i)
            i += 1
        live = Sub(s.pub, s.rep, "live")
        time.sleep(0.3)
        p0, t0 = s.published(), time.perf_counter()
        seconds = 1.5 if q else 10
        while time.perf_counter() - t0 < seconds:
            call(i)
            i += 1
        dt = time.perf_counter() - t0
        p1 = s.published()
        time.sleep(1.5)  # the subscriber drains what is queued for it
        events, batches, gaps = live.stop()
        assert gaps == 0, f"the live subscriber saw {gaps} gaps"
        return {"events_per_s_churn": events / dt, "events_published_per_s_churn": (p1 - p0) / dt,
                "events_per_batch_churn": events / max(1, batches)}
    finally:
        s.stop()


def latency(tmp: pathlib.Path, q: bool) -> dict[str, float]:
    """One 4 KiB store every 4 ms; for each, Commit's start to the subscriber
    decoding its BlockStored (a thread of this process: the clock is one)."""
    import msgspec
    import zmq

    from cxlkv_lmcache._proto import cxlkv_pb2 as pb

    s = Sidecar(tmp, "lat", "64MiB", "4KiB", "16MiB")
    seen: dict[int, float] = {}
    stop = threading.Event()

    def listen(ready: threading.Event) -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(s.pub)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        ready.set()
        dec = msgspec.msgpack.Decoder()
        while not stop.is_set():
            if sub.poll(20):
                _, _, payload = sub.recv_multipart()
                t = time.perf_counter()
                for e in dec.decode(payload)[1]:
                    if e[0] == "BlockStored":
                        seen[e[1][0]] = t
        sub.close()
        ctx.term()

    try:
        ready = threading.Event()
        th = threading.Thread(target=listen, args=(ready,), daemon=True)
        th.start()
        ready.wait(10)
        time.sleep(0.3)
        started: dict[int, float] = {}
        for i in range(60 if q else 1000):
            k = f"l{i}".encode()
            r = s.stub.Reserve(pb.ReserveRequest(tenant="t", items=[pb.ReserveItem(key=k, size=4096)]), timeout=10)
            started[fnv1a(k)] = time.perf_counter()
            s.stub.Commit(pb.CommitRequest(reservation_ids=[r.reservations[0].reservation_id]), timeout=10)
            time.sleep(0.004)
        deadline = time.monotonic() + 5
        while len(seen) < len(started) and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        th.join(5)
        assert set(started) <= set(seen), f"{len(set(started) - set(seen))} stores never seen"
        lat = sorted((seen[h] - t) * 1e3 for h, t in started.items())
        return {"events_latency_p50_ms": lat[len(lat) // 2], "events_latency_p99_ms": lat[int(len(lat) * 0.99)]}
    finally:
        s.stop()


SECTION = "## Event plane"


def document(r: dict[str, float]) -> None:
    """Replace (or append) the Event plane section of docs/BENCHMARKS.md."""
    doc = ROOT / "docs" / "BENCHMARKS.md"
    text = doc.read_text() if doc.exists() else "# cxlkv benchmarks\n"
    ok = "yes" if r["events_store_ratio_2MiB"] >= 0.95 else "**no**"
    section = f"""{SECTION}

Generated by `scripts/bench_events.py` (run by `scripts/bench.sh`) on {datetime.date.today()}; one release
sidecar publishing its events on ZMQ in vLLM's format (issue #37, docs/EVENTS.md). This VM has 2 noisy cores
that the sidecar, the store loop and the subscriber processes share: ratios within a run are what to read.

| figure | value | target | met |
|---|---|---|---|
| `events_store_ratio_2MiB` | {r['events_store_ratio_2MiB']:.3f} | >= 0.95 | {ok} |
| `events_per_s_churn` | {r['events_per_s_churn']:,.0f} | (reference) | |
| `events_latency_p50_ms` | {r['events_latency_p50_ms']:.2f} | (reference) | |
| `events_latency_p99_ms` | {r['events_latency_p99_ms']:.2f} | (reference) | |

- `events_store_ratio_2MiB`: 2 MiB stores (Reserve, copy into the mapped pool, Commit; the pool full, so each
  also evicts one) with one stalled and one live ZMQ subscriber ÷ the same with none, medians of interleaved
  rounds ({r['events_store_gbps_2MiB_subscribed']:.2f} vs {r['events_store_gbps_2MiB_none']:.2f} GB/s).
- `events_per_s_churn`: events a live vLLM-format subscriber decoded per second, no sequence skipped, while
  4 KiB stores churned a full pool (a stored and an evicted event per store; the sidecar published
  {r['events_published_per_s_churn']:,.0f}/s, {r['events_per_batch_churn']:.0f} events a batch): the
  registry's store rate through one gRPC client bounds it, not the event plane.
- `events_latency_p50_ms` / `p99`: Commit's start to the subscriber decoding the key's BlockStored, one store
  every 4 ms; the batcher's time bound (`[events] batch_delay_ms` = 10) is most of it.

```
{chr(10).join(f"BENCH {k} {r[k]:.4f}" for k in sorted(r))}
```
"""
    if SECTION in text:
        head, rest = text.split(SECTION, 1)
        nxt = rest.find("\n## ")
        text = head + section + (rest[nxt + 1:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    doc.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run; does not write docs/")
    ap.add_argument("--subscriber", nargs=3, metavar=("PUB", "REPLAY", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.subscriber:
        return subscriber(*args.subscriber)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="cxlkv-bench-events-"))
    r: dict[str, float] = {}
    r |= store_ratio(tmp, args.quick)
    r |= churn(tmp, args.quick)
    r |= latency(tmp, args.quick)
    for k in sorted(r):
        print(f"BENCH {k} {r[k]:.4f}")
    if not args.quick:
        document(r)


if __name__ == "__main__":
    main()
