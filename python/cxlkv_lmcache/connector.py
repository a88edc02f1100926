"""``CxlKvConnector``: cxlkv as one of LMCache's remote connectors (seed 001's
``RemoteConnector`` family), for the in-process engine's
``remote_storage_plugins`` or the older ``external://`` URL.

LMCache wraps a remote connector in its ``RemoteBackend``, which keeps chunks
in its own L1 (``LocalCPUBackend``) and moves them to and from the connector:
a put copies the chunk from L1 into pages reserved in the pool (Reserve →
copy → publish → Commit), a get copies it from the pool into an L1 buffer
the connector allocates (LookupAndLock → copy → the checks after a read →
Unlock): one copy each way, through the same client core as the other
faces. Load it with (LMCache YAML)::

    remote_storage_plugins: ["cxlkv"]
    extra_config:
      remote_storage_plugin.cxlkv.module_path: cxlkv_lmcache.connector
      remote_storage_plugin.cxlkv.class_name: CxlKvConnector
      cxlkv.socket: /run/cxlkv/cxlkv.sock

or ``remote_url: "external://localhost:0/cxlkv_lmcache.connector/?connector_name=CxlKvConnector"``
with the same ``cxlkv.*`` settings. Every method answers a miss, False or
nothing instead of raising, within ``deadline_ms``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import List, Optional

import grpc
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from cxlkv_lmcache import keys as keycodec
from cxlkv_lmcache.config import inproc_settings
from cxlkv_lmcache.core import Core
from cxlkv_lmcache.state import Task, rpc_error

__all__ = ["CxlKvConnector", "CxlKvConnectorAdapter"]

log = logging.getLogger("cxlkv_lmcache")


class CxlKvConnector(RemoteConnector):
    """See the module doc."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend, config, endpoint: str = ""):
        metadata = getattr(local_cpu_backend, "metadata", None)
        if metadata is not None:
            super().__init__(config, metadata)  # meta_shapes, meta_dtypes, meta_fmt, full_chunk_size_bytes
        else:  # the scheduler role: it only asks whether keys exist
            self.meta_shapes = self.meta_dtypes = self.meta_fmt = None
            self.full_chunk_size_bytes = self.single_token_size = 0
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        extra = getattr(config, "extra_config", None) if config is not None else None
        extra = dict(extra or {})
        if endpoint:  # from a cxlkv:// URL: a socket path, or host:port of the TCP listener
            extra["cxlkv.socket" if endpoint.startswith("/") else "cxlkv.tcp_address"] = endpoint
        self._cfg, own = inproc_settings(extra)
        self._namespace = own["tenant"]
        self._core = Core(self._cfg)
        self._puts = 0  # put calls running (LMCache's RemoteBackend does not track batched ones)
        self._puts_lock = threading.Lock()
        self._core.start()

    def puts_in_flight(self) -> int:
        with self._puts_lock:
            return self._puts

    # ---------------------------------------------------------------- helpers

    def _deadline(self) -> float:
        return time.monotonic() + self._cfg.deadline_ms / 1000

    def _enc(self, key) -> bytes:
        return keycodec.encode_engine_key(key)

    def _failed(self, what: str, e: Exception) -> None:
        if isinstance(e, grpc.RpcError):
            self._core.rpc_failed(e)
            log.warning("cxlkv connector %s failed: %s", what, rpc_error(e))
        else:
            log.exception("cxlkv connector %s failed", what)

    def _put_many(self, keys: list, objs: list) -> int:
        """Reserve → copy → publish → Commit; the number stored (or there
        already, or declined by the sidecar's admission: a skipped put)."""
        with self._puts_lock:
            self._puts += 1
        try:
            return self._put_inner(keys, objs)
        finally:
            with self._puts_lock:
                self._puts -= 1

    def _put_inner(self, keys: list, objs: list) -> int:
        try:
            groups: dict[str, list] = {}
            for k, o in zip(keys, objs):
                groups.setdefault(keycodec.tenant_of(k, self._namespace), []).append(
                    (k, self._enc(k), o.data_ptr, o.get_size()))
            ok, _, new = self._core.store(self._core.task("store", len(keys)), list(groups.items()), account=False)
            return len(keys) if ok else len(new)
        except Exception as e:
            self._failed("put", e)
            return 0

    def _get_many(self, keys: list) -> list[Optional[MemoryObj]]:
        """Lock every key, copy each hit into an L1 buffer, check, unlock."""
        out: list = [None] * len(keys)
        if not keys or self.meta_shapes is None:
            return out
        encs = [self._enc(k) for k in keys]
        deadline = self._deadline()
        locked: list[bytes] = []
        objs: dict[int, MemoryObj] = {}
        try:
            hits = self._core.lock_keys(deadline, encs)
            locked = [e for e, h in zip(encs, hits) if h]
            dsts, idx = [], []
            for i, (e, h) in enumerate(zip(encs, hits)):
                loc = self._core.location(e) if h else None
                if loc is None or not 0 < loc.length <= self.full_chunk_size_bytes:
                    continue
                o = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
                if o is None:
                    break  # L1 full: the rest are misses
                objs[i] = o
                dsts.append((o.data_ptr, loc.length))
                idx.append(i)
            loaded = self._core.load(Task("load", deadline, len(idx)), [encs[i] for i in idx], dsts)
            for j in loaded:
                i = idx[j]
                o = objs.pop(i)
                n = dsts[j][1]
                out[i] = o if n == self.full_chunk_size_bytes else self.reshape_partial_chunk(o, n)
        except Exception as e:
            self._failed("get", e)
        finally:
            for o in objs.values():  # allocated, not loaded
                o.ref_count_down()
            if locked:
                self._core.release(locked)
        return out

    # ------------------------------------------------------- RemoteConnector

    async def exists(self, key: CacheEngineKey) -> bool:
        return await asyncio.to_thread(self.exists_sync, key)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key]) == 1

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return (await asyncio.to_thread(self._get_many, [key]))[0]

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj):
        await asyncio.to_thread(self._put_many, [key], [memory_obj])

    async def list(self) -> List[str]:
        return await asyncio.to_thread(self.list_sync)

    def list_sync(self) -> List[str]:
        """Every in-process key in the pool, as CacheEngineKey strings."""
        out, cursor = [], 0
        try:
            while True:
                rep = self._core.list_keys(10_000, cursor)
                for ki in rep.keys:
                    k = keycodec.decode_engine_key(ki.key)
                    if k is not None:
                        out.append(k.to_string())
                cursor = rep.next_cursor
                if not cursor:
                    return out
        except Exception as e:
            self._failed("list", e)
            return out

    async def close(self):
        await asyncio.to_thread(self.close_sync)

    def close_sync(self) -> None:
        try:
            self._core.close()
            self._core.close_io()
        except Exception as e:
            self._failed("close", e)

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the sidecar answers and serves, else 1."""
        return await asyncio.to_thread(self.ping_sync)

    def ping_sync(self) -> int:
        try:
            self._core.connect(self._deadline())
            return 0 if self._core.healthy() else 1
        except Exception as e:
            self._failed("ping", e)
            return 1

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        return await asyncio.to_thread(self._get_many, list(keys))

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]):
        await asyncio.to_thread(self._put_many, list(keys), list(memory_objs))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        return await asyncio.to_thread(self.batched_contains, list(keys))

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        got = await asyncio.to_thread(self._get_many, list(keys))
        prefix = list(itertools.takewhile(lambda o: o is not None, got))
        for o in got[len(prefix):]:
            if o is not None:
                o.ref_count_down()
        return prefix

    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            return self._core.delete([self._enc(key)])[0]
        except Exception as e:
            self._failed("remove", e)
            return False

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        try:
            found = self._core.exists([self._enc(k) for k in keys], self._deadline())
            return sum(1 for _ in itertools.takewhile(bool, found))
        except Exception as e:
            self._failed("contains", e)
            return 0

    def __repr__(self) -> str:
        return "<CxlKvConnector>"


class CxlKvConnectorAdapter(ConnectorAdapter):
    """LMCache's other plug-in form of a remote connector: an adapter for
    ``cxlkv://`` URLs (``cxlkv:///run/cxlkv/cxlkv.sock`` for a Unix socket,
    ``cxlkv://host:port`` for the TCP listener), listed in
    ``remote_storage_plugins`` with this class name; other settings from
    ``extra_config`` as for CxlKvConnector."""

    def __init__(self, schema: str = "cxlkv://") -> None:
        super().__init__(schema)

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        rest = context.url[len(self.schema):] if context.url.startswith(self.schema) else ""
        endpoint = rest.split("?", 1)[0].rstrip("/") if rest else ""
        if endpoint and not endpoint.startswith("/") and ":" not in endpoint:
            endpoint = ""  # a bare name (plugin://cxlkv): the settings say where
        return CxlKvConnector(loop=context.loop, local_cpu_backend=context.local_cpu_backend, config=context.config,
                              endpoint=endpoint)
