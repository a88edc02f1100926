"""The store path's Reserve sends its items packed (ReserveRequest's
packed_keys, key_lengths, sizes) where the sidecar says it reads them
(PoolInfo.packed_reserve), as messages where it does not (an older
sidecar) or where items carry token ids. Against a real sidecar."""

from __future__ import annotations

from cxlkv_lmcache import client as cl
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_testkit import make_adapter
from cxlkv_testkit.l2 import bits, key, load, obj, store

CHUNK = 64 << 10


def sent_reserves(core) -> list:
    """Every ReserveRequest the store path sends."""
    sent: list = []
    real = core.rides._stub.Reserve

    def spy(req, **kw):
        sent.append(req)
        return real(req, **kw)

    core.rides._stub = type("Stub", (), {"Reserve": staticmethod(spy), "Commit": core.rides._stub.Commit})()
    return sent


def stored_and_read_back(a, reader, first: int, sizes: list[int]) -> bool:
    keys = [key(first + i) for i in range(len(sizes))]
    objs = [obj(n, seed=first + i) for i, n in enumerate(sizes)]
    if not store(a, keys, objs).is_successful():
        return False
    outs = [obj(n, seed=999) for n in sizes]
    found = bits(load(reader, keys, outs), len(keys))
    return all(found) and all(bytes(o.tensor.numpy()) == bytes(x.tensor.numpy()) for o, x in zip(outs, objs))


def test_a_store_reserves_packed_where_the_sidecar_reads_it_and_as_messages_where_it_does_not(sidecar):
    a = make_adapter(sidecar.socket, lease_ahead_bytes=0)
    reader = make_adapter(sidecar.socket)
    try:
        sent = sent_reserves(a._core)
        assert stored_and_read_back(a, reader, 0, [CHUNK] * 6)
        assert a._core.conn.info.packed_reserve, "this sidecar reads packed items"
        assert len(sent) == 1 and not sent[0].items and list(sent[0].key_lengths) == [len(sent[0].packed_keys) // 6] * 6
        assert list(sent[0].sizes) == [CHUNK], "one size for all"
        # An older sidecar (no packed_reserve in its PoolInfo) gets messages.
        a._core.conn.info.packed_reserve = False
        assert stored_and_read_back(a, reader, 100, [CHUNK, CHUNK // 2, 3])
        assert len(sent) == 2 and len(sent[1].items) == 3 and not sent[1].key_lengths
    finally:
        a.close()
        reader.close()


def test_reserve_fields_packs_pairs_and_leaves_messages_as_they_are():
    f = cl.reserve_fields([(b"ab", 5), (b"c", 5), (b"", 5)])
    assert (f["packed_keys"], f["key_lengths"], f["sizes"]) == (b"abc", [2, 1, 0], [5])
    assert cl.reserve_keys(pb.ReserveRequest(**f)) == [b"ab", b"c", b""]
    assert cl.reserve_fields([(b"x", 1), (b"y", 2)])["sizes"] == [1, 2]
    items = [pb.ReserveItem(key=b"k", size=1, token_ids=[7])]
    assert cl.reserve_fields(items) == {"items": items}
    assert cl.reserve_keys(pb.ReserveRequest(items=items)) == [b"k"]
    assert cl.reserve_fields([]) == {"items": []}
