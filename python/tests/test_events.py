"""The pool's event plane (issue #37) seen by the consumers it is for: a
subscriber built on vLLM's published KV-events schema (pyzmq + msgspec, the
event classes exactly as vLLM defines them) and the gRPC WatchEvents stream,
against real sidecars (`events_kit.py`, `events_subscribers.py`).

Key-set reconstruction: three nodes on one small pool, thousands of stores,
deletes, evictions and a phase-3 region reclaim through all three; what the
subscribers rebuild from the events (by block hash on ZMQ, the primary's and
a follower's relayed stream alike; by key over gRPC) is the primary's key
set, with every sequence contiguous from the source's first batch. The
checker itself is shown to catch one event lost or two reordered. Replay,
stalled subscribers and failover are in `test_event_replay.py`,
`test_event_stalls.py` and `test_event_failover.py`.
"""

from __future__ import annotations


import pytest

from cxlkv_testkit import free_port, wait_for

from events_kit import CLUSTER_TIMINGS, Client, EvSidecar, block_hash, lmcache_key, sidecar
from events_subscribers import Broken, GrpcSubscriber, ZmqSubscriber, converged, diff, kind, rebuild



@pytest.fixture
def three(tmp_path):
    """Nodes a (the primary), b, c on one 6 MiB pool of 2 MiB regions: one
    region each, so every node evicts its own keys and a node whose keys
    are all locked takes another's region back (phase 3)."""
    peer = f"127.0.0.1:{free_port()}"
    nodes: dict[str, EvSidecar] = {}
    try:
        for name in "abc":
            role = ("--peer-addr", peer) if name == "a" else ("--primary-addr", peer)
            nodes[name] = sidecar(tmp_path, name, "6MiB", CLUSTER_TIMINGS,
                                  extra=("--node-name", name, "--primary", "a", *role))
            nodes[name].start()
        yield nodes
    finally:
        for s in nodes.values():
            s.kill()



def churn(clients: dict[str, Client], base: int, rounds: int, per: int, live: dict[str, set]) -> None:
    """Each round: `per` new keys stored through each node (half LMCache
    chunk keys, half plain), then a third of the keys it stored deleted;
    the small pool evicts the rest as it fills."""
    for r in range(rounds):
        for t, (name, c) in enumerate(clients.items()):
            tag = base + r * 8 + t
            keys = [lmcache_key(i, tag) if i % 2 else f"k-{tag}-{i}".encode() for i in range(per)]
            stored = c.store(keys)
            assert len(stored) == len(keys), f"{name}: {len(stored)} of {len(keys)} stored"
            live[name].update(stored)
            gone = sorted(live[name])[::3][:per // 3]
            c.delete(gone)
            live[name].difference_update(gone)


def test_the_subscribers_rebuild_the_primarys_key_set_through_stores_deletes_evictions_and_a_reclaim(three):
    a, b, c = three["a"], three["b"], three["c"]
    clients = {n: Client(s.socket) for n, s in three.items()}
    # Subscribers from the start of the source's stream: vLLM's on the
    # primary's ZMQ and on follower b's (its relay of the primary's), and a
    # WatchEvents stream by key.
    wait_for(lambda: clients["b"].stats().events.epoch != 0 and clients["c"].stats().events.epoch != 0, timeout=20)
    subs = [ZmqSubscriber(a.pub, a.rep, "zmq-a"), ZmqSubscriber(b.pub, b.rep, "zmq-b")]
    grpc_sub = GrpcSubscriber(a.socket)
    for s in [*subs, grpc_sub]:
        s.start()
    live = {n: set() for n in clients}
    try:
        # Thousands of stores and deletes through all three nodes; each node
        # has one region of 512 pages, so it evicts its own keys as it goes.
        churn(clients, 0, rounds=12, per=128, live=live)
        # Phase 3: every key b holds locked, then b stores on: its own
        # eviction cannot help and no region is free, so the primary takes an
        # idle region (a's or c's) back; its keys leave as `reclaimed`.
        cb = clients["b"]
        locked = cb.lock(sorted(live["b"]))
        assert locked, "b holds no key"
        n = 0
        while not grpc_sub.reasons().get("reclaimed"):
            n += 1
            assert n < 40, f"no region was taken back: {grpc_sub.reasons()} {cb.stats()}"
            keys = [f"b-locked-{n}-{i}".encode() for i in range(32)]
            stored = cb.store(keys)
            assert cb.lock(stored) == stored
            if len(stored) < len(keys):
                wait_for(lambda: grpc_sub.reasons().get("reclaimed"), timeout=5)
        # More churn after the reclaim (the region changed hands).
        churn(clients, 1000, rounds=3, per=64, live=live)
        want_keys = clients["a"].keys()
        want = {block_hash(k) for k in want_keys}
        assert len(want) == len(want_keys), "two keys share a block hash"
        assert converged([*subs], want), "\n".join(f"{s.name}: {diff(s.held(), want)}" for s in subs)
        assert wait_for(lambda: grpc_sub.held() == want_keys, timeout=30), diff(grpc_sub.held(), want_keys)
        reasons = grpc_sub.reasons()
        assert reasons.get("deleted", 0) > 500 and reasons.get("evicted", 0) > 500 and reasons.get("reclaimed"), \
            reasons
        # Every message the ZMQ subscribers applied: the primary's and its
        # relay's numbered alike (each PUB numbers its own messages from 0:
        # a batch that changes no hash is no message), the same events,
        # contiguous from the source's first; the first ones came through
        # the replay socket (they subscribed after the source started), the
        # rest live. The gRPC stream has every batch, from 0.
        for s in subs:
            s.check()
        last = clients["a"].stats().events.next_seq - 1
        assert wait_for(lambda: grpc_sub.rebuilt.last == last)
        assert wait_for(lambda: subs[0].rebuilt.last == subs[1].rebuilt.last)
        assert [q for q, _ in subs[0].batches] == [q for q, _ in subs[1].batches]
        seqs = [q for q, _ in subs[0].batches]
        assert seqs == list(range(0, len(seqs)))
        assert [q.seq for q in grpc_sub.batches][0] == 0
        stored = sum(s.rebuilt.kinds.get("BlockStored", 0) for s in subs[:1])
        assert stored > 3000, subs[0].rebuilt.kinds

        # The check is sharp: the same batches with one event lost, or two
        # events of one key swapped, do not rebuild the primary's set.
        batches = subs[0].batches
        assert rebuild(batches).held == want
        positions = [(i, j) for i, (_, ev) in enumerate(batches) for j in range(len(ev))]
        for i, j in positions[1::max(1, len(positions) // 25)]:
            lost = [(q, ev if k != i else ev[:j] + ev[j + 1:]) for k, (q, ev) in enumerate(batches)]
            with pytest.raises(Broken):
                r = rebuild(lost)
                if r.held != want:
                    raise Broken("the set differs")
        # A batch lost (its sequence skipped) is caught by the sequence alone.
        with pytest.raises(Broken, match="sequence"):
            rebuild(batches[:5] + batches[6:])
        # A removal moved before its key's store.
        flat = [(i, j, e) for i, (_, ev) in enumerate(batches) for j, e in enumerate(ev)]
        rm = next((i, j, e) for i, j, e in flat if kind(e) == "BlockRemoved" and len(e.block_hashes) == 1 and i > 2)
        st = next((i, j) for i, j, e in flat if kind(e) == "BlockStored" and e.block_hashes == rm[2].block_hashes
                  and (i, j) < rm[:2])
        swapped = [(q, list(ev)) for q, ev in batches]
        swapped[st[0]][1][st[1]], swapped[rm[0]][1][rm[1]] = swapped[rm[0]][1][rm[1]], swapped[st[0]][1][st[1]]
        with pytest.raises(Broken, match="removed while not held"):
            rebuild(swapped)
    finally:
        for s in subs:
            s.stop()
        grpc_sub.stop()
        for cl_ in clients.values():
            cl_.close()
