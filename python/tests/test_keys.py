"""Key encoding: every ObjectKey field takes part, and encoding round-trips."""

import pytest
from lmcache.v1.distributed.api import ObjectKey

from cxlkv_lmcache import keys


@pytest.mark.parametrize("key", [
    ObjectKey(chunk_hash=bytes(range(32)), model_name="meta-llama/Llama-3.1-8B", kv_rank=0x02010201),
    ObjectKey(chunk_hash=b"\x00@\xff\x01", model_name="m", kv_rank=0, object_group_id=3, cache_salt="tenant-a"),
    ObjectKey(chunk_hash=b"x" * 8, model_name="x" * 300, kv_rank=1),          # text fallback
    ObjectKey(chunk_hash=b"y" * 8, model_name="m", kv_rank=-(2**40)),          # text fallback
])
def test_round_trip(key):
    assert keys.decode(keys.encode(key)) == key


def test_every_field_distinguishes_keys():
    base = dict(chunk_hash=b"h" * 32, model_name="org/m", kv_rank=5, object_group_id=1, cache_salt="s")
    variants = [dict(base, chunk_hash=b"g" * 32), dict(base, model_name="org/n"), dict(base, kv_rank=6),
                dict(base, object_group_id=2), dict(base, cache_salt="t"), dict(base, cache_salt="")]
    encoded = {keys.encode(ObjectKey(**base))} | {keys.encode(ObjectKey(**v)) for v in variants}
    assert len(encoded) == len(variants) + 1


def test_llama_keys_fit_the_sidecar_inline_key_size():
    k = ObjectKey(chunk_hash=b"\x07" * 32, model_name="meta-llama/Llama-3.1-8B", kv_rank=0x02010201)
    assert len(keys.encode(k)) <= 78


def test_foreign_keys_do_not_decode():
    assert keys.decode(b"not-a-key") is None
    assert keys.decode(b"\x01\x05ab") is None


def test_batch_encoding_equals_one_by_one():
    # Mixed prefixes, salts, hash lengths and text-fallback keys in one batch.
    batch = [
        ObjectKey(chunk_hash=bytes([i]) * 32, model_name="org/m", kv_rank=7, object_group_id=i % 2,
                  cache_salt="s" if i % 3 else "")
        for i in range(10)
    ] + [
        ObjectKey(chunk_hash=b"z" * 16, model_name="org/m", kv_rank=7),
        ObjectKey(chunk_hash=b"x" * 8, model_name="x" * 300, kv_rank=1),
        ObjectKey(chunk_hash=b"y" * 8, model_name="m", kv_rank=-(2**40), cache_salt="t"),
        ObjectKey(chunk_hash=b"x" * 8, model_name="x" * 300, kv_rank=1),
    ]
    assert keys.encode_many(batch) == [keys.encode(k) for k in batch]
    assert [keys.decode(e) for e in keys.encode_many(batch)] == batch
    assert keys.encode_many([]) == []
