"""Deterministic, reversible encoding of LMCache ``ObjectKey`` into sidecar key
bytes. Every field takes part. The binary form keeps keys short (the sidecar
stores keys up to 78 bytes inline in its registry entry)::

    0x01 | u8 len(model) | model utf-8 | i32 kv_rank | u32 group | u8 len(hash) | hash | salt utf-8

A model name over 255 bytes or a kv_rank outside int32 falls back to LMCache's
native-connector text form ``model@{kv_rank:08x}@{group:x}@{hash_hex}[@salt]``;
both decode.
"""

from __future__ import annotations

import struct

from lmcache.v1.distributed.api import ObjectKey

_TAG = 0x01


def encode(key: ObjectKey) -> bytes:
    model = key.model_name.encode()
    h = key.chunk_hash
    if len(model) < 256 and len(h) < 256 and -(2**31) <= key.kv_rank < 2**31 and 0 <= key.object_group_id < 2**32:
        return (bytes((_TAG, len(model))) + model + struct.pack(">iI", key.kv_rank, key.object_group_id)
                + bytes((len(h),)) + h + key.cache_salt.encode())
    s = f"{key.model_name}@{key.kv_rank:08x}@{key.object_group_id:x}@{h.hex()}"
    if key.cache_salt:
        s += "@" + key.cache_salt
    return s.encode()


def decode(raw: bytes) -> ObjectKey | None:
    """The ObjectKey for ``raw``, or None if it was not written by this encoder."""
    try:
        if raw[:1] == bytes((_TAG,)):
            m = raw[1]
            model = raw[2 : 2 + m].decode()
            rank, group = struct.unpack_from(">iI", raw, 2 + m)
            o = 2 + m + 8
            hn = raw[o]
            h = raw[o + 1 : o + 1 + hn]
            if len(h) != hn:
                return None
            salt = raw[o + 1 + hn :].decode()
            return ObjectKey(chunk_hash=h, model_name=model, kv_rank=rank, object_group_id=group, cache_salt=salt)
        parts = raw.decode().split("@")
        if len(parts) not in (4, 5):
            return None
        return ObjectKey(
            chunk_hash=bytes.fromhex(parts[3]),
            model_name=parts[0],
            kv_rank=int(parts[1], 16),
            object_group_id=int(parts[2], 16),
            cache_salt=parts[4] if len(parts) == 5 else "",
        )
    except (UnicodeDecodeError, ValueError, IndexError, struct.error):
        return None
