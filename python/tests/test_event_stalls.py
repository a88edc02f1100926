"""A stalled event subscriber (connected, never reading) on gRPC and on ZMQ
while tens of thousands of events flow (issue #37): the sidecar's heap stays
bounded, the drops are counted, live subscribers get every batch; the
stalled gRPC one, once it reads again, sees a jump of exactly the batches
the `lagging` drop counter counted. A replay peer that asks and never reads
holds nothing and blocks no other replay.
"""

from __future__ import annotations

import signal
import subprocess
import time

import zmq

from cxlkv_testkit import BIN, wait_for

from events_kit import Client, DECODE_026, block_hash, metric, rss_anon_kib, sidecar
from events_subscribers import GrpcSubscriber, ZmqSubscriber, diff, replay_raw




def pump(c: Client, tag: str, calls: int, per: int = 512) -> int:
    """`calls` × `per` 4 KiB stores on a full pool: each also evicts one
    key, two events a store."""
    n = 0
    for i in range(calls):
        n += len(c.store([f"{tag}-{i}-{j}".encode() for j in range(per)]))
    return n


def caught_up(sub, c: Client) -> bool:
    last = sub.rebuilt.last
    return last is not None and last + 1 == c.stats().events.next_seq


def caught_up_with(sub, c: Client, want: set) -> bool:
    """`sub` applied every batch published so far and holds `want`, the
    node's keys read once the calls that changed them returned. `caught_up`
    alone may hold before the last of those calls' events are a batch (cut
    up to batch_delay_ms later): the set tells when they arrived."""
    if sub.error is not None:
        raise sub.error
    return sub.held() == want and caught_up(sub, c)


def test_a_stalled_grpc_subscriber_holds_nothing_and_its_drops_are_counted_while_live_ones_keep_up(tmp_path):
    # Small batches and ring (256 batches of 8 events): a subscriber more
    # than 2,048 events behind has fallen off the ring.
    # The ZMQ replay ring small too: the heap's growth is the stalled
    # stream's and the ring's.
    s = sidecar(tmp_path, "n", "6MiB", metrics=True, batch_events=8, ring_batches=256,
                zmq_replay_bytes='"1MiB"', buffer_bytes='"1MiB"', ring_bytes='"1MiB"').start()
    c = Client(s.socket)
    # (The ZMQ publisher reads the same 256-batch ring: on a loaded machine
    # it may fall behind it too, which test_a_stalled_zmq_subscriber... does
    # not provoke; here only gRPC subscribers are checked.)
    live_g = GrpcSubscriber(s.socket)
    # The stalled subscriber: `cxlkv events` (a WatchEvents stream, a line
    # per event, the batch's sequence first), stopped with SIGSTOP once it
    # printed its first line: it reads nothing from its socket, so its
    # stream's flow-control window closes and its task on the sidecar waits.
    watcher = subprocess.Popen([BIN, "events", "--socket", s.socket], stdout=subprocess.PIPE, text=True)
    try:
        live_g.start()
        assert wait_for(lambda: caught_up(live_g, c), timeout=10)
        seqs = [int(watcher.stdout.readline().split()[0])]
        watcher.send_signal(signal.SIGSTOP)
        assert wait_for(lambda: c.stats().events.subscribers == 3, timeout=10)  # the ZMQ publisher, live, stalled
        assert metric(s.metrics, "cxlkv_events_dropped_total") == 0
        before = rss_anon_kib(s.proc.pid)
        stored = pump(c, "s", 40)
        # The live subscribers get every batch, contiguous (Rebuild checks
        # each step), and end holding the node's keys.
        want = c.keys()
        assert wait_for(lambda: caught_up_with(live_g, c, want), timeout=60), \
            (diff(live_g.held(), want), c.stats().events)
        # ~5,000 batches while it stalled; the sidecar's heap holds no more
        # for it than its stream's bound (events.stream_bytes, a batch, and
        # HTTP/2's 400 KiB), besides the bounds configured above (1 MiB each:
        # buffer, ring, ZMQ replay ring) and the allocator's slack.
        assert rss_anon_kib(s.proc.pid) - before < 12 << 10
        assert live_g.rebuilt.kinds["BlockStored"] >= stored and live_g.rebuilt.kinds["BlockRemoved"] > stored // 2
        # The stalled one reads again: it gets what its stream still had
        # queued, then jumps to the ring's oldest batch; the jump is exactly
        # what the `lagging` drop counter counted (no one else lagged).
        watcher.send_signal(signal.SIGCONT)
        end = c.stats().events.next_seq - 1
        while seqs[-1] != end:
            q = int(watcher.stdout.readline().split()[0])
            if q != seqs[-1]:
                seqs.append(q)
        jumps = [(x, y) for x, y in zip(seqs, seqs[1:]) if y != x + 1]
        assert len(jumps) == 1, jumps
        lost = jumps[0][1] - jumps[0][0] - 1
        assert lost > 1000, jumps
        # (the ZMQ publisher's subscribers count theirs too: at least this)
        assert metric(s.metrics, "cxlkv_events_dropped_total", 'reason="lagging"') >= lost
        assert metric(s.metrics, "cxlkv_events_dropped_total", 'reason="overflow"') == 0
        assert metric(s.metrics, "cxlkv_event_batches_total") == c.stats().events.next_seq
        assert metric(s.metrics, "cxlkv_events_oldest_seq") == c.stats().events.oldest_seq
    finally:
        watcher.send_signal(signal.SIGCONT)
        watcher.kill()
        watcher.wait()
        live_g.stop()
        c.close()
        s.kill()


TOPIC = 16 << 10


def test_a_stalled_zmq_subscriber_holds_bounded_memory_while_a_live_one_keeps_up(tmp_path):
    # Each batch carries a 16 KiB topic frame (a legal topic, if a long one):
    # what a publisher holds per batch for a subscriber is then large enough
    # to measure against the process's heap.
    # A subscriber's queue of 8 MiB (zmq_queue_bytes), a replay ring of 2
    # MiB (zmq_replay_bytes): the stalled subscriber may hold the first, the
    # ring the second; the live subscriber, when it falls behind on a busy
    # machine, may hold a queue of its own; the log's ring grows by the
    # batches it keeps (~1 KiB each here, under 3 MiB).
    s = sidecar(tmp_path, "n", "6MiB", metrics=True, batch_events=8, topic='"' + "t" * TOPIC + '"',
                zmq_queue_bytes='"8MiB"', zmq_replay_bytes='"2MiB"').start()
    c = Client(s.socket)
    ctx = zmq.Context()
    st = ctx.socket(zmq.SUB)
    st.setsockopt(zmq.LINGER, 0)
    st.setsockopt(zmq.RCVHWM, 1)
    st.setsockopt(zmq.RCVBUF, 4096)
    st.connect(s.pub)
    st.setsockopt(zmq.SUBSCRIBE, b"")
    live = ZmqSubscriber(s.pub, s.rep, "live")
    try:
        live.start()
        assert wait_for(lambda: caught_up(live, c), timeout=10)
        time.sleep(0.3)  # the stalled SUB's subscription reached the PUB
        pump(c, "w", 4, per=256)
        assert wait_for(lambda: caught_up(live, c), timeout=30)
        before = rss_anon_kib(s.proc.pid)
        n0 = c.stats().events.next_seq
        pump(c, "s", 56, per=256)  # ~28,700 events: ~3,600 batches of 16 KiB+
        want = {block_hash(k) for k in c.keys()}
        assert wait_for(lambda: caught_up_with(live, c, want), timeout=60), \
            (diff(live.held(), want), live.error, [metric(s.metrics, "cxlkv_events_dropped_total", f'reason="{r}"')
                                                   for r in ("lagging", "overflow")])
        batches = c.stats().events.next_seq - n0
        grew = rss_anon_kib(s.proc.pid) - before
        # What the stalled subscriber gets once it reads: what the sidecar
        # held for it (plus the kernel's socket buffers, a few MiB at most).
        held = 0
        while st.poll(1000):
            held += sum(len(f) for f in st.recv_multipart())
        published = batches * TOPIC
        bound = (8 + 2 + 8 + 3 + 1) << 10  # KiB: both queues, the replay ring, the log's ring, slack
        assert published >> 10 > 2 * bound
        assert held < 12 << 20 and grew < bound, \
            f"the stalled subscriber was held {held >> 20} MiB of {published >> 20} MiB; the heap grew {grew >> 10} MiB"
        # What it lost is counted (batches dropped for it), and the live one
        # lost nothing: every batch applied in order, no replay but its first.
        dropped = metric(s.metrics, "cxlkv_events_dropped_total", 'reason="lagging"')
        assert dropped > batches // 2, (dropped, batches)
        assert live.replayed == [live.batches[0][0]]
    finally:
        live.stop()
        st.close()
        ctx.term()
        c.close()
        s.kill()


def test_a_replay_peer_that_never_reads_holds_nothing_and_blocks_no_other(tmp_path):
    s = sidecar(tmp_path, "n", "6MiB", batch_events=8, ring_batches=4096).start()
    c = Client(s.socket)
    ctx = zmq.Context()
    socks = []

    def sock(kind, small: bool = False):
        x = ctx.socket(kind)
        x.setsockopt(zmq.LINGER, 0)
        if small:
            x.setsockopt(zmq.RCVHWM, 1)
            x.setsockopt(zmq.RCVBUF, 4096)
        x.connect(s.rep)
        socks.append(x)
        return x

    try:
        pump(c, "f", 40)  # ~40,000 events
        time.sleep(0.1)  # the last batch cut (batch_delay_ms = 10): the replay ring holds still
        held = [q for q, _ in replay_raw(s.rep, 0)]
        n = len(held)
        assert held == list(range(n)) and n > 2000, n
        before = rss_anon_kib(s.proc.pid)
        # 200 requests for the whole ring (~1 MiB of messages each), never read.
        stalled = sock(zmq.DEALER, small=True)
        for _ in range(200):
            stalled.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(2)
        assert rss_anon_kib(s.proc.pid) - before < 8 << 10
        # Another peer is answered meanwhile, in full.
        assert [q for q, _ in replay_raw(s.rep, 0)] == held
        # A REQ socket gets [topic, seq, payload] each, the first message asked for.
        req = sock(zmq.REQ)
        req.send((n - 1).to_bytes(8, "big"))
        assert req.poll(10_000)
        topic, q, payload = req.recv_multipart()
        assert topic.startswith(b"kv@pool:cxlkv@") and int.from_bytes(q, "big") == n - 1
        assert DECODE_026.decode(payload).events
    finally:
        for x in socks:
            x.close()
        ctx.term()
        c.close()
        s.kill()
