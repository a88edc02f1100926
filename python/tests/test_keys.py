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


def bench_hash(i: int) -> bytes:
    """The chunk hash of the Rust bench's key i (crates/bench/src/keys.rs)."""
    return i.to_bytes(8, "little") + (i * 0x9E37_79B9_7F4A_7C15 % 2**64).to_bytes(8, "little") + bytes(16)


# The Rust bench builds its keys by hand (Rust cannot call this encoder); it is
# held to these bytes too (crates/bench/src/keys.rs), so both encode alike.
BENCH_PREFIX = "01176d6574612d6c6c616d612f4c6c616d612d332e312d3842020102010000000020"
BENCH_HASHES = {
    0: "0000000000000000000000000000000000000000000000000000000000000000",
    1: "0100000000000000157c4a7fb979379e00000000000000000000000000000000",
    123456789: "15cd5b0700000000b9feefc404d071be00000000000000000000000000000000",
}


@pytest.mark.parametrize("i", sorted(BENCH_HASHES))
def test_the_rust_bench_encodes_keys_as_the_plugin_does(i):
    k = ObjectKey(chunk_hash=bench_hash(i), model_name="meta-llama/Llama-3.1-8B", kv_rank=0x02010201)
    assert keys.encode(k).hex() == BENCH_PREFIX + BENCH_HASHES[i]
