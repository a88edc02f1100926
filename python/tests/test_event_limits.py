"""What one client can make the event plane hold or spend (issue #44's
scenarios a-e), against real sidecars, each with the bound it must keep
(docs/EVENTS.md "Memory and CPU"):

a. WatchEvents streams opened and never read: at most
   events.max_streams_per_connection (4) on one connection and
   events.max_streams (32) per sidecar are served (one more:
   RESOURCE_EXHAUSTED); what the open ones hold stays within their bound.
b. The ring with no subscriber at all, 4 KiB objects under 1000-byte keys:
   the heap with events on exceeds the heap with events off by at most the
   buffer's and the ring's bytes (events.buffer_bytes + ring_bytes) and the
   hash set.
c. Idle peers (handshake done, no subscription) and peers that never greet,
   64 of each, reconnecting: a real subscriber and a replay peer are served.
d. 64 peers sending 64 subscriptions of 64 KiB each: closed at their first
   oversized frame; the heap does not grow.
e. Junk flooded into the PUB socket: the sidecar accepts a bounded number
   of connections a second and spends a bounded share of a core on them
   (CPU seconds from /proc). The store latency under that flood
   against the same flood into another process is a benchmark figure
   (scripts/bench_events.py, docs/BENCHMARKS.md), not a timed test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import zmq

from cxlkv_testkit import wait_for

from events_kit import Client, rss_anon_kib, sidecar

KEY = 1000  # bytes: the long keys


def load(c: Client, tag: str, calls: int, per: int = 256, size: int = 4096) -> int:
    """4 KiB stores under 1000-byte keys on a full pool (each also evicts)."""
    n = 0
    for i in range(calls):
        keys = [f"{tag}-{i}-{j}-".encode().ljust(KEY, b"k") for j in range(per)]
        n += len(c.store(keys, size=size))
    return n


def settle_rss(pid: int) -> int:
    time.sleep(0.5)
    return rss_anon_kib(pid)


# ------------------------------------------------------------ a. streams

STREAMS_CLIENT = r"""
import sys, grpc
from cxlkv_lmcache import client as cl
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
ch = cl.channel(sys.argv[1])
stub = cl.stub(ch)
ok = refused = 0
calls = []
for _ in range(int(sys.argv[2])):
    it = stub.WatchEvents(pb.WatchEventsRequest(), timeout=3600)
    try:
        next(it)
        calls.append(it)
        ok += 1
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        refused += 1
print(ok, refused, flush=True)
sys.stdin.read()  # holds its streams, never reading them
"""


def open_streams(sock: str, n: int) -> tuple[subprocess.Popen, int, int]:
    """A client process with `n` WatchEvents calls on one connection: how
    many were served; then it stops (SIGSTOP), reading nothing."""
    p = subprocess.Popen([sys.executable, "-c", STREAMS_CLIENT, sock, str(n)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    ok, refused = map(int, p.stdout.readline().split())
    p.send_signal(signal.SIGSTOP)
    return p, ok, refused


def test_a_streams_never_read_are_bounded_per_connection_and_per_sidecar(tmp_path):
    # Two sidecars under the same load: one with 100 streams asked for on
    # one connection and never read, one without.
    s = sidecar(tmp_path, "n", "64MiB").start()
    quiet = sidecar(tmp_path, "q", "64MiB").start()
    cs = [Client(s.socket), Client(quiet.socket)]
    procs = []
    try:
        base = [settle_rss(x.proc.pid) for x in (s, quiet)]
        p, ok, refused = open_streams(s.socket, 100)
        procs.append(p)
        assert (ok, refused) == (4, 96), "events.max_streams_per_connection"
        for c in cs:
            load(c, "a", 120)  # ~60,000 events with 1000-byte keys while 4 streams hold still
        grew = [settle_rss(x.proc.pid) - b for x, b in zip((s, quiet), base)]
        # Bound (docs/EVENTS.md): 4 streams of 2 MiB each (stream_bytes 256
        # KiB queued, a batch read and its message, 3 × batch_bytes 64 KiB,
        # the one in tonic's encoder, HTTP/2's 400 KiB send buffer, and the
        # connection's HTTP/2 buffers: 0.9 MiB by the formula, about 2 MiB
        # measured), and the allocator's slack (4 MiB).
        bound = 4 * (2 << 10) + (4 << 10)
        assert grew[0] - grew[1] < bound, f"{grew[0] >> 10} MiB, without the streams {grew[1] >> 10} MiB"
        # Per sidecar: 32 streams in all (7 more connections of 4 each).
        served = 4
        for _ in range(8):
            p, ok, refused = open_streams(s.socket, 4)
            procs.append(p)
            served += ok
        assert served == 32, "events.max_streams"
        assert cs[0].stats().events.subscribers == 32 + 1  # and the ZMQ publisher
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()
        for c in cs:
            c.close()
        s.kill()
        quiet.kill()


# ------------------------------------------------------------ b. the ring


def test_b_the_ring_with_no_subscriber_is_bounded_in_bytes(tmp_path):
    on = sidecar(tmp_path, "on", "64MiB").start()
    off_cfg = tmp_path / "off.toml"
    off_cfg.write_text("[events]\nenabled = false\n")
    from cxlkv_testkit import Sidecar

    (tmp_path / "off").mkdir()
    off = Sidecar(tmp_path / "off", "off", pool_size="64MiB", extra=("--config", str(off_cfg))).start()
    cs = [Client(on.socket), Client(off.socket)]
    try:
        before = [settle_rss(x.proc.pid) for x in (on, off)]
        for c in cs:
            load(c, "b", 160)  # ~80,000 events of ~1.1 KB: ~90 MB unbounded
        grew = [settle_rss(x.proc.pid) - b for x, b in zip((on, off), before)]
        ev = cs[0].stats().events
        assert ev.next_seq > 150, ev
        # Bound: buffer_bytes (8 MiB) + ring_bytes (16 MiB) + the hash set
        # and slack.
        assert grew[0] - grew[1] < (8 + 16 + 8) << 10, f"on {grew[0] >> 10} MiB, off {grew[1] >> 10} MiB"
    finally:
        for c in cs:
            c.close()
        on.kill()
        off.kill()


# ------------------------------------------------------------ c. idle peers


def greet(ty: bytes) -> bytes:
    g = bytearray(64)
    g[0], g[9], g[10] = 0xFF, 0x7F, 3
    g[12:16] = b"NULL"
    ready = b"\x05READY\x0bSocket-Type" + len(ty).to_bytes(4, "big") + ty
    return bytes(g) + bytes([0x04, len(ready)]) + ready


class Flood(threading.Thread):
    """`n` connections to `at` that do `what` and, when closed, connect
    again, until stopped."""

    def __init__(self, at: str, n: int, what: bytes, repeat: bytes = b""):
        super().__init__(daemon=True)
        host, port = at.removeprefix("tcp://").rsplit(":", 1)
        self.addr, self.n, self.what, self.repeat = (host, int(port)), n, what, repeat
        self.stop = threading.Event()
        self.connects = 0

    def run(self) -> None:
        socks: list = [None] * self.n
        while not self.stop.is_set():
            for i in range(self.n):
                s = socks[i]
                if s is None:
                    try:
                        s = socket.create_connection(self.addr, timeout=1)
                        s.setblocking(False)
                        s.send(self.what)
                        socks[i] = s
                        self.connects += 1
                    except OSError:
                        continue
                try:
                    if self.repeat:
                        s.send(self.repeat)
                    elif s.recv(65536) == b"":
                        raise OSError("closed")
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    socks[i] = None
            time.sleep(0.001)
        for s in socks:
            if s is not None:
                s.close()


def test_c_idle_and_silent_peers_cannot_keep_a_subscriber_or_a_replay_peer_out(tmp_path):
    s = sidecar(tmp_path, "n", "64MiB").start()
    c = Client(s.socket)
    floods = [Flood(s.pub, 64, greet(b"SUB")), Flood(s.pub, 64, b""),
              Flood(s.rep, 64, greet(b"DEALER")), Flood(s.rep, 64, b"")]
    ctx = zmq.Context()
    try:
        for f in floods:
            f.start()
        time.sleep(2)  # every place taken, idle ones past their grace
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(s.pub)
        sub.setsockopt(zmq.SUBSCRIBE, b"")

        def got_one() -> bool:
            c.store([f"c-{time.monotonic_ns()}".encode()])
            return sub.poll(200) != 0

        assert wait_for(got_one, timeout=20), "a real subscriber was kept out"
        topic, seq, payload = sub.recv_multipart()
        assert topic.startswith(b"kv@pool:cxlkv@")
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(s.rep)
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        assert d.poll(20_000), "a replay peer was kept out"
        assert floods[0].connects > 64 and floods[1].connects > 64, "the flood kept reconnecting"
    finally:
        for f in floods:
            f.stop.set()
        ctx.destroy(linger=0)
        c.close()
        s.kill()


# ------------------------------------------------------------ d. subscriptions


def test_d_peers_with_many_large_subscriptions_hold_nothing(tmp_path):
    s = sidecar(tmp_path, "n", "64MiB").start()
    try:
        base = settle_rss(s.proc.pid)
        host, port = s.pub.removeprefix("tcp://").rsplit(":", 1)
        big = b"\x02" + (64 << 10).to_bytes(8, "big") + b"\x01" + b"t" * ((64 << 10) - 1)
        closed = 0
        for _ in range(64):
            x = socket.create_connection((host, int(port)))
            x.sendall(greet(b"SUB"))
            try:
                for _ in range(64):
                    x.sendall(big)
            except OSError:
                pass  # closed at its first oversized frame
            x.settimeout(5)
            try:
                while x.recv(65536):
                    pass
                closed += 1
            except OSError:
                closed += 1
            x.close()
        assert closed == 64
        # Legal subscriptions: at most 64 and 4 KiB of them per subscriber.
        peers = []
        for _ in range(16):
            x = socket.create_connection((host, int(port)))
            x.sendall(greet(b"SUB"))
            for i in range(64):
                x.sendall(bytes([0, 61, 1]) + bytes([i]) * 60)
            peers.append(x)
        time.sleep(1)
        grew = settle_rss(s.proc.pid) - base
        assert grew < 4 << 10, f"{grew} KiB"
        for x in peers:
            x.close()
    finally:
        s.kill()


# ------------------------------------------------------------ e. junk


@pytest.mark.parametrize("greeted", [True, False])
def test_e_junk_into_the_pub_socket_costs_bounded_cpu(tmp_path, greeted):
    s = sidecar(tmp_path, "n", "64MiB").start()
    junk = b"\x02" + (64 << 10).to_bytes(8, "big") + os.urandom(64 << 10)
    flood = Flood(s.pub, 16, greet(b"SUB") if greeted else b"", repeat=junk)
    try:
        t0, w0 = s.cpu_seconds(), time.monotonic()
        flood.start()
        time.sleep(5)
        flood.stop.set()
        flood.join(5)
        spent, elapsed = s.cpu_seconds() - t0, time.monotonic() - w0
        # The sidecar closes each flood connection (its 64 KiB frame is
        # past the 4 KiB bound, or no greeting) only once it has accepted
        # it, so the flood's connects are its accepts and the 16 open at
        # most: 16 at once, then 200 a second (peers.rs `Pace`; a 2 ms pace
        # let 1,946 in). The work counted, not timed: a slow machine
        # accepts fewer, never more.
        assert flood.connects <= 16 + 1 + 200 * elapsed + 16, (flood.connects, elapsed)
        # And it costs a bounded share of a core: 0.12-0.2 of one in this
        # debug build (0.6 ms an accepted connection; its release figure is
        # events_junk_sidecar_cores in scripts/bench_events.py); the flood
        # took 1.2 cores before accepts were paced and reads bounded.
        assert spent < 0.5 * 5, f"{spent:.2f} CPU seconds in 5 s"
    finally:
        flood.stop.set()
        s.kill()
