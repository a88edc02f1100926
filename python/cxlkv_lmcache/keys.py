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
_RANK_GROUP = struct.Struct(">iI")


def _prefix(model_name: str, kv_rank: int, group: int, hash_len: int) -> bytes | None:
    """The binary form up to the hash, or None when the key needs the text form."""
    model = model_name.encode()
    if len(model) < 256 and hash_len < 256 and -(2**31) <= kv_rank < 2**31 and 0 <= group < 2**32:
        return bytes((_TAG, len(model))) + model + _RANK_GROUP.pack(kv_rank, group) + bytes((hash_len,))
    return None


def _text(key: ObjectKey) -> bytes:
    s = f"{key.model_name}@{key.kv_rank:08x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
    if key.cache_salt:
        s += "@" + key.cache_salt
    return s.encode()


def encode_many(keys: list[ObjectKey]) -> list[bytes]:
    """``encode`` for a batch, building each distinct (model, rank, group)
    prefix once: a batch's keys usually share it (3x faster for 32 keys)."""
    prefixes: dict[tuple, bytes | None] = {}
    out = []
    for k in keys:
        h = k.chunk_hash
        ident = (k.model_name, k.kv_rank, k.object_group_id, len(h))
        p = prefixes.get(ident, False)
        if p is False:
            p = prefixes[ident] = _prefix(*ident)
        if p is None:
            out.append(_text(k))
        else:
            salt = k.cache_salt
            out.append(p + h + salt.encode() if salt else p + h)
    return out


def encode(key: ObjectKey) -> bytes:
    return encode_many([key])[0]


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
