"""What the event-plane tests share: vLLM's published KV-events schema (the
subscribers decode every event with it), a key's block hash as the sidecar
computes it, sidecars with ZMQ endpoints on free ports, and a small gRPC
client for the calls that make events."""

from __future__ import annotations

import re
import zlib
import urllib.request
from typing import Any, Optional, Union

import msgspec
from msgspec.msgpack import Decoder

from cxlkv_testkit import Sidecar, free_port

from cxlkv_lmcache import client as cl
from cxlkv_lmcache._proto import cxlkv_pb2 as pb

import vllm026_kv_events as v026

# ------------------------------------------------------------ vLLM's schema
#
# Copied verbatim from vLLM's vllm/distributed/kv_events.py as it stood after
# vllm-project/vllm#27577 added `lora_name` to BlockStored and before
# vllm-project/vllm#33304 added `extra_keys` (both array-like; #42892 later
# dropped array_like from the events). This is the strictest array form: its
# BlockStored has seven fields without a default, so an array of fewer fails
# to decode. `ExternalBlockHash` is vLLM's alias from
# vllm/v1/core/kv_cache_utils.py.

ExternalBlockHash = bytes | int


class EventBatch(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
    tag=True,
):
    """Base class for all KV cache-related events"""


MEDIUM_GPU = "GPU"


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int

    lora_id: int | None
    """Deprecated: use `lora_name` for KV block key hash.
    Retained for backward compatibility.
    """

    medium: str | None
    lora_name: str | None

    def __hash__(self) -> int:
        return hash(
            (
                tuple(self.block_hashes),
                self.parent_block_hash,
                tuple(self.token_ids),
                self.block_size,
                self.lora_id,
                self.medium,
            )
        )


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None

    def __hash__(self) -> int:
        return hash((tuple(self.block_hashes), self.medium))


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The types of vLLM's own subscriber, examples/online_serving/kv_events_subscriber.py
# ("Types copied from vllm.distributed.kv_events", the release before
# `lora_name`), verbatim but for the `Legacy` prefix on each name: every batch
# must decode with these too (they skip the trailing `lora_name` and the
# batch's data_parallel_rank).
class LegacyEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class LegacyKVCacheEvent(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True
):
    """Base class for all KV cache-related events"""


class LegacyBlockStored(LegacyKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class LegacyBlockRemoved(LegacyKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str]


class LegacyAllBlocksCleared(LegacyKVCacheEvent, tag="AllBlocksCleared"):
    pass


class LegacyKVEventBatch(LegacyEventBatch):
    events: list[Union[LegacyBlockStored, LegacyBlockRemoved, LegacyAllBlocksCleared]]


DECODE = Decoder(type=KVEventBatch)
DECODE_LEGACY = Decoder(type=LegacyKVEventBatch)
# vLLM 0.26's own classes (map-form events): the default contract.
DECODE_026 = Decoder(type=v026.KVEventBatch)
END_SEQ = -1

# ------------------------------------------------------------ keys → hashes


def signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def block_hash(key: bytes) -> int:
    """BlockStored.block_hashes[0] for a cxlkv key, as docs/EVENTS.md and
    src/events/zmq.rs define it: a multiprocess LMCache key (0x01 | len model
    | model | i32 rank | u32 group | len hash | hash | salt) names its chunk
    hash (its first 8 bytes, big-endian, signed); any other key (in these
    tests: plain text) is two zlib CRC-32s as one signed 64-bit int."""
    if key[:1] == b"\x01" and len(key) > 2:
        o = 2 + key[1] + 8
        if o < len(key) and o + 1 + key[o] <= len(key):
            h = key[o + 1:o + 1 + key[o]]
            return int.from_bytes(h[:8].rjust(8, b"\0"), "big", signed=True)
    assert key[:1] not in (b"\x01", b"\x02"), key
    return signed(zlib.crc32(key) << 32 | zlib.crc32(key, 0x9E3779B9))


def lmcache_key(i: int, tag: int) -> bytes:
    """The plugin's key for an LMCache chunk (cxlkv_lmcache.keys), chunk hash
    distinct per (tag, i)."""
    from lmcache.v1.distributed.api import ObjectKey

    from cxlkv_lmcache.keys import encode

    h = ((tag << 40) | i).to_bytes(8, "big") + b"\x5a" * 8
    return encode(ObjectKey(chunk_hash=h, model_name="cxlkv-events", kv_rank=0))


# ------------------------------------------------------------ the sidecars


def events_toml(**kw) -> str:
    """An [events] section with ZMQ on two free loopback ports (returned as
    the `pub`/`replay` keys of the dict too)."""
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    lines = [f'zmq_publish = "{pub}"', f'zmq_replay = "{rep}"']
    lines += [f"{k} = {v}" for k, v in kw.items()]
    return "[events]\n" + "\n".join(lines) + "\n", pub, rep


class EvSidecar(Sidecar):
    """A Sidecar with its ZMQ endpoints and, optionally, its metrics on a
    free port (the kit turns metrics off)."""

    pub = rep = ""
    metrics = ""

    def args(self) -> list[str]:
        a = super().args()
        if self.metrics:
            a[a.index("--metrics-addr") + 1] = self.metrics
        return a


def sidecar(dir, name: str, pool: str, base_toml: str = "", metrics: bool = False, extra: tuple = (),
            **events) -> EvSidecar:
    text, pub, rep = events_toml(**events)
    cfg = dir / f"{name}-events.toml"
    cfg.write_text(base_toml + text)
    s = EvSidecar(dir, name, pool_size=pool, extra=("--config", str(cfg), *extra))
    s.pub, s.rep = pub, rep
    if metrics:
        s.metrics = f"127.0.0.1:{free_port()}"
    return s


CLUSTER_TIMINGS = "[cluster]\nheartbeat_ms = 100\nlease_ms = 1500\ndead_after_ms = 3000\nforward_timeout_ms = 2000\n"


# ------------------------------------------------------------ gRPC helpers


class Client:
    def __init__(self, sock: str):
        self.sock = sock
        self.ch = cl.channel(sock)
        self.stub = cl.stub(self.ch)

    def store(self, keys: list[bytes], size: int = 4096, tenant: str = "t") -> list[bytes]:
        """Reserve and commit `keys` (no bytes written: the events are about
        the registry); returns the keys committed."""
        r = self.stub.Reserve(pb.ReserveRequest(tenant=tenant, items=[pb.ReserveItem(key=k, size=size) for k in keys]),
                              timeout=30)
        got = [(k, x.reservation_id) for k, x in zip(keys, r.reservations) if x.status.code == 0]
        if not got:
            return []
        c = self.stub.Commit(pb.CommitRequest(reservation_ids=[i for _, i in got]), timeout=30)
        return [k for (k, _), s in zip(got, c.statuses) if s.code == 0]

    def delete(self, keys: list[bytes]) -> int:
        r = self.stub.Delete(pb.DeleteRequest(keys=keys), timeout=30)
        return sum(1 for s in r.statuses if s.code == 0)

    def lock(self, keys: list[bytes]) -> list[bytes]:
        r = self.stub.LookupAndLock(pb.LookupRequest(keys=keys, lock_ttl_ms=600_000), timeout=30)
        return [k for k, x in zip(keys, r.results) if x.found]

    def keys(self) -> set[bytes]:
        """Every key the node's registry lists (ListKeys, paged)."""
        out: set[bytes] = set()
        cursor = 0
        while True:
            r = self.stub.ListKeys(pb.ListKeysRequest(page_size=1000, cursor=cursor), timeout=30)
            out.update(k.key for k in r.keys)
            if not r.next_cursor:
                return out
            cursor = r.next_cursor

    def stats(self):
        return self.stub.Stats(pb.StatsRequest(), timeout=10)

    def close(self) -> None:
        self.ch.close()


def metric(addr: str, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
    pat = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.M)
    total = 0.0
    for m in pat.finditer(text):
        if labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def rss_anon_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon")
