"""Deterministic, reversible encoding of LMCache ``ObjectKey`` into sidecar
key bytes. It is LMCache's own native-connector wire format
``model@{kv_rank:08x}@{group:x}@{chunk_hash_hex}[@salt]``: every field takes
part, and ``model_name`` / ``cache_salt`` cannot contain ``@``."""

from __future__ import annotations

from lmcache.v1.distributed.api import ObjectKey


def encode(key: ObjectKey) -> bytes:
    s = f"{key.model_name}@{key.kv_rank:08x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
    if key.cache_salt:
        s += "@" + key.cache_salt
    return s.encode()


def decode(raw: bytes) -> ObjectKey | None:
    """The ObjectKey for ``raw``, or None if it was not written by this encoder."""
    try:
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
    except (UnicodeDecodeError, ValueError):
        return None
