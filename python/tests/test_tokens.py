"""Token ids for the sidecar's events (docs/EVENTS.md "Tokens").

- The multiprocess adapter's bindings come from LMCache's own observability
  bus (a real `EventBus`, `EventType.MP_TOKENS` published as LMCache's
  lmcache_driven transfer module publishes it) and become ReserveItem
  fields: the chunk's tokens and its parent's key.
- A real sidecar carries them from the Reserve to the commit's event
  (WatchEvents shows them, announced once per hash), bounds them per item
  (INVALID_ARGUMENT past events.max_item_tokens, or a parent without
  tokens), and splits them into the router's blocks on ZMQ.
(The in-process engine's path, a real LMCacheEngine storing known tokens
through the cxlkv backend, is crates/dynamo-check's test.)
"""

from __future__ import annotations

import time

import grpc
import msgspec
import pytest
import zmq

from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.keys import encode
from cxlkv_lmcache.tokens import MpTokens

from events_kit import Client, sidecar
from events_subscribers import GrpcSubscriber


def object_key(h: bytes, rank: int = 0):
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=h, model_name="m", kv_rank=rank)


def test_the_mp_adapter_learns_tokens_from_lmcaches_bus():
    from lmcache.v1.mp_observability.event import Event, EventType
    from lmcache.v1.mp_observability.event_bus import EventBus, EventBusConfig

    bus = EventBus(EventBusConfig(enabled=True))
    bus.start()
    try:
        t = MpTokens(bus)
        assert bus.has_subscribers(EventType.MP_TOKENS), "LMCache publishes bindings only to a subscriber"
        h0, h1 = b"\x01" * 8, b"\x02" * 8
        bus.publish(Event(event_type=EventType.MP_TOKENS, session_id="r",
                          metadata={"chunk_hashes": [h0, h1], "token_chunks": [[1, 2, 3], [4, 5, 6]],
                                    "token_offsets": [0, 3], "parent_hashes": [None, h0]}))
        deadline = time.monotonic() + 5
        while len(t.bindings) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        fields = t.fields([object_key(h0), object_key(h1), object_key(b"\x09" * 8)], encode)
        assert fields == [{"token_ids": [1, 2, 3]}, {"token_ids": [4, 5, 6], "parent_key": encode(object_key(h0))},
                          {}]
    finally:
        bus.stop()


def test_tokens_ride_from_the_reserve_to_the_commits_event_and_are_bounded(tmp_path):
    s = sidecar(tmp_path, "n", "64MiB", block_size=4).start()
    c = Client(s.socket)
    watch = GrpcSubscriber(s.socket, rebuild=False)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(s.pub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        watch.start()
        time.sleep(0.3)
        parent, child = encode(object_key(b"\x01" * 8)), encode(object_key(b"\x02" * 8))
        twin = encode(object_key(b"\x02" * 8, rank=1))  # another TP rank's key over the same chunk
        items = [pb.ReserveItem(key=parent, size=4096, token_ids=list(range(10))),
                 pb.ReserveItem(key=child, size=4096, token_ids=list(range(10, 18)), parent_key=parent),
                 pb.ReserveItem(key=twin, size=4096, token_ids=list(range(10, 18)), parent_key=parent)]
        r = c.stub.Reserve(pb.ReserveRequest(tenant="t", items=items), timeout=10)
        ids = [x.reservation_id for x in r.reservations]
        assert all(x.status.code == 0 for x in r.reservations)
        c.stub.Commit(pb.CommitRequest(reservation_ids=ids), timeout=10)

        def stored() -> list:
            with watch.lock:
                return [e for b in watch.batches for e in b.events if e.kind == pb.Event.STORED]

        deadline = time.monotonic() + 10
        while len(stored()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        ev = {e.key: e for e in stored()}
        assert list(ev[parent].token_ids) == list(range(10)) and ev[parent].announce
        assert not ev[parent].HasField("parent_block_hash")
        assert list(ev[child].token_ids) == list(range(10, 18)) and ev[child].announce
        assert ev[child].parent_block_hash == ev[parent].block_hash
        # The other rank's key carries the same hash: not announced again.
        assert not ev[twin].announce and ev[twin].block_hash == ev[child].block_hash

        # On ZMQ: the parent's 10 tokens are 2 blocks of 4, the child's 8 two.
        got = []
        while sub.poll(2000):
            for e in msgspec.msgpack.decode(sub.recv_multipart()[2])[1]:
                if e["type"] == "BlockStored":
                    got.append(e)
        assert [(len(e["block_hashes"]), e["token_ids"], e["block_size"]) for e in got] == \
            [(2, list(range(8)), 4), (2, list(range(10, 18)), 4)]
        assert got[1]["parent_block_hash"] == got[0]["block_hashes"][-1], "the child chains on to its parent"

        # Bounded per item; a parent without tokens is refused.
        for bad in (pb.ReserveItem(key=b"x", size=1, token_ids=[0] * 8193),
                    pb.ReserveItem(key=b"y", size=1, parent_key=parent)):
            with pytest.raises(grpc.RpcError) as e:
                c.stub.Reserve(pb.ReserveRequest(tenant="t", items=[bad]), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    finally:
        watch.stop()
        ctx.destroy(linger=0)
        c.close()
        s.kill()
