"""``CxlKvBackend``: a storage backend for LMCache's in-process engine (vLLM's
``LMCacheConnectorV1``) whose hits are views of pool pages.

Load it with (LMCache YAML)::

    storage_plugins: ["cxlkv"]
    extra_config:
      storage_plugin.cxlkv.module_path: cxlkv_lmcache.backend
      storage_plugin.cxlkv.class_name: CxlKvBackend
      cxlkv.socket: /run/cxlkv/cxlkv.sock

**Stores.** The backend names LMCache's L1 (``LocalCPUBackend``) as its
allocator backend, so ``StorageManager.batched_put`` hands
``batched_submit_put_task`` the L1 objects themselves; the backend keeps a
reference to each until its store ends and stores the batch through the
client core off LMCache's thread: one Reserve, each chunk copied once from
L1 into its pages with streaming stores over the copy threads, one fence,
one Commit. ``allocate`` and ``batched_allocate`` hand out L1 memory (or
private host memory without an L1): nothing handed out for writing is ever
pool memory, so no writer can outlive a reservation.

**Loads.** ``get_blocking`` and the batched gets return views of the pool
pages (no copy; with CUDA the mapping is registered, so LMCache's GPU
connector reads them with one DMA), each covered by a sidecar lock this
backend keeps for as long as LMCache keeps the view, within a budget:
``views.py`` says how, docs/ARCHITECTURE.md why it is safe. Before handing
one out the backend checks the object is still the one located, and its
crc32 when ``verify_payload``: doubt is a miss.

Every public method returns a miss, False, 0 or None instead of raising, and
every call to the sidecar carries the ``deadline_ms`` budget.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, List, Optional, Sequence, Union

import grpc
import torch
from lmcache import torch_device_type
from lmcache.utils import CacheEngineKey, get_size_bytes
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import (
    MemoryAllocatorInterface,
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.abstract_backend import AllocatorBackendInterface, StoragePluginInterface

from cxlkv_lmcache import client as cl
from cxlkv_lmcache import gpu
from cxlkv_lmcache import keys as keycodec
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.config import BACKEND_DEFAULTS, inproc_settings
from cxlkv_lmcache.core import Core, Restarted
from cxlkv_lmcache.state import rpc_error
from cxlkv_lmcache.tokens import EngineTokens
from cxlkv_lmcache.hits import ChunkShapes, Hits
from cxlkv_lmcache.views import PoolView, Views

__all__ = ["CxlKvBackend"]

log = logging.getLogger("cxlkv_lmcache")


def _guard(default: Callable[..., Any]):
    """A public method never raises: errors become `default(*args)`."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except grpc.RpcError as e:
                self._core.rpc_failed(e)
                log.warning("cxlkv %s failed: %s", fn.__name__, rpc_error(e))
            except Exception:
                log.exception("cxlkv %s failed", fn.__name__)
            try:
                return default(*args, **kwargs)
            except Exception:
                return None

        return wrapper

    return deco


def _has_tensor(o: MemoryObj) -> bool:
    """`o.tensor is not None` without building the tensor: LMCache's
    TensorMemoryObj makes two views at each call, paid per chunk of every
    store, and a valid one always has a tensor."""
    if type(o).tensor is TensorMemoryObj.tensor:
        return bool(o.valid)
    return o.tensor is not None


class PoolAllocator(MemoryAllocatorInterface):
    """The backend's allocator as LMCache sees it: `free` (a view's last
    reference gone) gives its lease back."""

    def __init__(self, backend: "CxlKvBackend"):
        self._backend = backend

    def allocate(self, shapes, dtypes, fmt=MemoryFormat.UNDEFINED, allocator_type=None):
        return self._backend.allocate(shapes, dtypes, fmt)

    def batched_allocate(self, shapes, dtypes, batch_size, fmt=MemoryFormat.UNDEFINED, allocator_type=None):
        return self._backend.batched_allocate(shapes, dtypes, batch_size, fmt)

    def free(self, memory_obj, allocator_type=None):
        self._backend._free(memory_obj)

    def batched_free(self, memory_objs, allocator_type=None, update_stats=True):
        for o in memory_objs:
            self._backend._free(o)

    def memcheck(self) -> bool:
        return True


class CxlKvBackend(AllocatorBackendInterface, StoragePluginInterface):
    """See the module doc."""

    def __init__(
        self,
        config: Optional[LMCacheEngineConfig] = None,
        dst_device: str = torch_device_type,
        metadata: Optional[LMCacheMetadata] = None,
        local_cpu_backend=None,
        loop: Optional[asyncio.AbstractEventLoop] = None,
    ):
        StoragePluginInterface.__init__(self, dst_device=dst_device, config=config, metadata=metadata,
                                        local_cpu_backend=local_cpu_backend, loop=loop)
        if config is not None and getattr(config, "use_layerwise", False):
            raise NotImplementedError("cxlkv backend does not support layerwise KV caches (use_layerwise)")
        extra = config.extra_config if config is not None else None
        self._cfg, own = inproc_settings(extra, BACKEND_DEFAULTS)
        self._namespace = own["tenant"]
        # As LMCache's Maru and remote backends: with MLA every worker holds the
        # same KV, so workers other than 0 store nothing and read worker 0's.
        self._mla_as0 = bool(
            config is not None and metadata is not None and metadata.use_mla and metadata.world_size > 1
            and metadata.worker_id != 0
            and config.get_extra_config_value("remote_enable_mla_worker_id_as0", metadata.use_mla))
        self._lock = threading.Lock()  # put tasks
        self._put_tasks: set = set()
        self._encs: dict = {}
        self._registered: list[cl.PoolMap] = []
        # A durable session of its own: the locks of its views outlive a
        # reset connection (docs/ARCHITECTURE.md, "Hits through the backend").
        self._core = Core(self._cfg, on_map=self._mapped, session=os.urandom(16).hex())
        self._tokens = EngineTokens(config)  # token ids for the sidecar's events (tokens.py)
        self._core.on_restart(self._restarted)
        self.views = Views(self._core, local_cpu_backend, own["max_view_bytes"], own["view_idle_ms"])
        self.memory_allocator = self.initialize_allocator(config, metadata)
        self._hits = Hits(self._core, self.views, ChunkShapes(metadata), self.memory_allocator, local_cpu_backend,
                          self._enc)
        self._renewer = threading.Thread(target=self.views.run, args=(self._core.closed, self._upkeep_failed),
                                         name="cxlkv-views", daemon=True)
        self._core.start()
        self._renewer.start()

    def __str__(self) -> str:
        return self.__class__.__name__

    # ----------------------------------------------------------- mapping

    def _mapped(self, old: cl.PoolMap | None, new: cl.PoolMap) -> None:
        if gpu.register(new.base, new.size):
            self._registered.append(new)

    def cuda_registered(self) -> bool:
        return bool(self._registered)

    def _deadline(self) -> float:
        return time.monotonic() + self._cfg.deadline_ms / 1000

    def _enc(self, key) -> bytes:
        """The key's sidecar key (memoized: LMCache asks about the same key
        several times per put or get)."""
        e = self._encs.get(key)
        if e is None:
            e = keycodec.encode_engine_key(key.with_new_worker_id(0) if self._mla_as0 else key)
            if len(self._encs) >= 65536:
                self._encs.clear()
            self._encs[key] = e
        return e

    def _tenant(self, key) -> str:
        return keycodec.tenant_of(key, self._namespace)

    # ----------------------------------------------------- the allocator

    def initialize_allocator(self, config: LMCacheEngineConfig, metadata: LMCacheMetadata) -> MemoryAllocatorInterface:
        return PoolAllocator(self)

    def get_memory_allocator(self) -> MemoryAllocatorInterface:
        return self.memory_allocator

    def get_allocator_backend(self):
        """LMCache's L1 where there is one: `StorageManager.batched_put` then
        hands `batched_submit_put_task` the L1 objects themselves (one copy
        into the pool, no allocation here)."""
        return self.local_cpu_backend if self.local_cpu_backend is not None else self

    def calculate_chunk_budget(self) -> int:
        info = self._core.conn.info
        full = self._hits.shapes.full
        if info is None or not full:
            return 0
        return int(info.capacity_bytes // full)

    @staticmethod
    def _norm(shapes, dtypes):
        shapes = [shapes] if isinstance(shapes, torch.Size) else list(shapes)
        dtypes = [dtypes] if isinstance(dtypes, torch.dtype) else list(dtypes)
        if len(dtypes) == 1 and len(shapes) > 1:
            dtypes = dtypes * len(shapes)
        return shapes, dtypes

    @_guard(lambda *a, **k: None)
    def allocate(
        self,
        shapes: Union[torch.Size, list[torch.Size]],
        dtypes: Union[torch.dtype, list[torch.dtype]],
        fmt: MemoryFormat = MemoryFormat.KV_2LTD,
        eviction: bool = True,
        busy_loop: bool = True,
    ) -> Optional[MemoryObj]:
        objs = self.batched_allocate(shapes, dtypes, 1, fmt, eviction, busy_loop)
        return objs[0] if objs else None

    @_guard(lambda *a, **k: None)
    def batched_allocate(
        self,
        shapes: Union[torch.Size, list[torch.Size]],
        dtypes: Union[torch.dtype, list[torch.dtype]],
        batch_size: int,
        fmt: MemoryFormat = MemoryFormat.KV_2LTD,
        eviction: bool = True,
        busy_loop: bool = True,
    ) -> Optional[list[MemoryObj]]:
        """Memory to write a chunk into before a put: LMCache's L1 (its own
        allocator) or private host memory, never pool pages (a writer could
        outlive any reservation of them). The put copies it into the pool."""
        shapes, dtypes = self._norm(shapes, dtypes)
        if self.local_cpu_backend is not None:
            return self.local_cpu_backend.batched_allocate(shapes, dtypes, batch_size, fmt, eviction=eviction,
                                                           busy_loop=busy_loop)
        size = get_size_bytes(shapes, dtypes)
        pin = torch.cuda.is_available()
        out = []
        for _ in range(batch_size):
            raw = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            meta = MemoryObjMetadata(shape=shapes[0], dtype=dtypes[0], address=0, phy_size=size, ref_count=1,
                                     pin_count=0, fmt=fmt, shapes=list(shapes), dtypes=list(dtypes))
            out.append(TensorMemoryObj(raw, meta, parent_allocator=None))
        return out

    def _free(self, obj: MemoryObj) -> None:
        """A view's last reference is gone: its lease has one user fewer."""
        if isinstance(obj, PoolView):
            self.views.freed(obj)

    # -------------------------------------------------------------- puts

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return self._enc(key) in self._put_tasks

    @_guard(lambda *a, **k: None)
    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: List[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Optional[Callable[[CacheEngineKey], None]] = None,
    ) -> Union[List[Future], None]:
        keys, objs = list(keys), list(objs)
        if len(keys) != len(objs):
            raise ValueError(f"{len(keys)} keys but {len(objs)} objects")
        if not keys or self._mla_as0:
            return None
        encs = [self._enc(k) for k in keys]
        with self._lock:
            fresh = [i for i, e in enumerate(encs) if e not in self._put_tasks]  # one put of a key at a time
            self._put_tasks.update(encs[i] for i in fresh)
        keys, encs, objs = [keys[i] for i in fresh], [encs[i] for i in fresh], [objs[i] for i in fresh]
        self._tokens.hand(self._core, keys, encs, self._enc)
        # Reserved and copied now, committed off LMCache's thread: LMCache may
        # free or reuse the sources once this returns (closing its L1 frees
        # every object of it at once, whatever their references).
        finish = self._put_begin(keys, encs, objs)
        try:
            fut = self._core.exec.submit(self._put_end, keys, encs, finish, on_complete_callback)
        except RuntimeError:  # closing
            self._put_done(encs)
            return None
        return [fut]

    def submit_put_task(self, key: CacheEngineKey, memory_obj: MemoryObj,
                        on_complete_callback: Optional[Callable[[CacheEngineKey], None]] = None) -> Optional[Future]:
        futs = self.batched_submit_put_task([key], [memory_obj], on_complete_callback=on_complete_callback)
        if futs:
            return futs[0]
        done: Future = Future()  # nothing to do (skipped, as in MLA worker != 0): already complete
        done.set_result(None)
        return done

    async def async_batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: List[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Optional[Callable[[CacheEngineKey], None]] = None,
    ) -> None:
        futs = self.batched_submit_put_task(keys, objs, transfer_spec, on_complete_callback)
        for f in futs or []:
            await asyncio.wrap_future(f)

    def _put_done(self, encs) -> None:
        with self._lock:
            self._put_tasks.difference_update(encs)

    def _put_begin(self, keys, encs, objs) -> Callable[[], tuple]:
        """Reserve and copy (the core's `store_begin`); a failure is a
        skipped put, logged, never raised."""
        try:
            groups: dict[str, list] = {}
            for k, e, o in zip(keys, encs, objs):
                if o is not None and _has_tensor(o):
                    groups.setdefault(self._tenant(k), []).append((k, e, o.data_ptr, o.get_size()))
            return self._core.store_begin(self._core.task("store", len(keys)), list(groups.items()))
        except Exception as e:
            self._put_failed(len(keys), e)
            return lambda: (False, 0, [])

    def _put_end(self, keys, encs, finish, on_complete) -> None:
        """Commit what `_put_begin` copied, then tell LMCache per key."""
        stored: list = []
        try:
            stored = [k for k, _, _, _ in finish()[2]]
        except Exception as e:
            self._put_failed(len(keys), e)
        finally:
            self._put_done(encs)
        if on_complete is not None:
            for k in stored:
                try:
                    on_complete(k)
                except Exception as e:
                    log.warning("on_complete_callback failed for key %s: %s", k, e)

    def _put_failed(self, n: int, e: Exception) -> None:
        if isinstance(e, grpc.RpcError):
            self._core.rpc_failed(e)
            log.warning("cxlkv put of %d chunks failed: %s; skipped", n, rpc_error(e))
        else:
            log.error("cxlkv put of %d chunks failed; skipped", n, exc_info=e)

    # -------------------------------------------------------------- gets

    @_guard(lambda *a, **k: None)
    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return self._hits.get([key], prefix=False)[0]

    @_guard(lambda keys, *a, **k: [None] * len(keys))
    def batched_get_blocking(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        return self._hits.get(list(keys), prefix=False)

    def get_non_blocking(self, key: CacheEngineKey, location: Optional[str] = None) -> Optional[Future]:
        try:
            return self._core.exec.submit(self.get_blocking, key)
        except RuntimeError:
            return None

    async def batched_get_non_blocking(
        self,
        lookup_id: str,
        keys: list[CacheEngineKey],
        transfer_spec: Any = None,
    ) -> list[MemoryObj]:
        """The prefix of keys that are hits, as views (the first miss ends it)."""
        views = await asyncio.to_thread(self._guarded_views, list(keys))
        return [v for v in itertools.takewhile(lambda v: v is not None, views)]

    def _guarded_views(self, keys: list) -> list:
        try:
            return self._hits.get(keys, prefix=True)
        except grpc.RpcError as e:
            self._core.rpc_failed(e)
            log.warning("cxlkv get of %d chunks failed: %s", len(keys), rpc_error(e))
        except Exception:
            log.exception("cxlkv get of %d chunks failed", len(keys))
        return [None] * len(keys)

    # ------------------------------------------------- contains and pins

    def _contains_rpc(self, keys: list, pin: bool) -> int:
        """Hit chunks by prefix match; with `pin` each counted one is locked
        (given back by unpin)."""
        if not keys:
            return 0
        deadline = self._deadline()
        encs = [self._enc(k) for k in keys]
        if not pin:
            found = self._core.exists(encs, deadline)
            return sum(1 for _ in itertools.takewhile(bool, found))
        leases = [self.views.locked(e) if h else None for e, h in zip(encs, self._core.lock_keys(deadline, encs))]
        n = sum(1 for _ in itertools.takewhile(lambda x: x is not None, leases))
        for i, lease in enumerate(leases):
            if lease is None:
                continue
            if i < n:
                self.views.pin(lease)
            else:  # found after a miss: not counted, not kept
                self.views.give(lease)
        return n

    @_guard(lambda *a, **k: False)
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self._contains_rpc([key], pin) == 1

    @_guard(lambda *a, **k: 0)
    def batched_contains(self, keys: List[CacheEngineKey], pin: bool = False) -> int:
        return self._contains_rpc(list(keys), pin)

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        return await asyncio.to_thread(self.batched_contains, list(keys), pin)

    @_guard(lambda *a, **k: False)
    def pin(self, key: CacheEngineKey) -> bool:
        return self._contains_rpc([key], True) == 1

    @_guard(lambda *a, **k: False)
    def unpin(self, key: CacheEngineKey) -> bool:
        return self.views.unpin(self._enc(key))

    @_guard(lambda *a, **k: None)
    def batched_unpin(self, keys: List[CacheEngineKey]) -> None:
        for k in keys:
            self.unpin(k)

    @_guard(lambda *a, **k: False)
    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self._core.delete([self._enc(key)])[0]

    @_guard(lambda keys, *a, **k: 0)
    def batched_remove(self, keys: list[CacheEngineKey], force: bool = True) -> int:
        return sum(self._core.delete([self._enc(k) for k in keys]))

    def touch_cache(self) -> None:
        """Reads count in the sidecar's eviction order already (each lookup)."""
        return

    # ------------------------------------------------------ lock upkeep

    def _upkeep_failed(self, e: Exception) -> None:
        if isinstance(e, Restarted):
            return  # the restart hook locks the views again
        if isinstance(e, grpc.RpcError):
            self._core.rpc_failed(e)
            log.warning("cxlkv lock renewal failed: %s", rpc_error(e))
        else:
            log.error("cxlkv view upkeep failed", exc_info=e)

    def renew_now(self, within: float) -> int:
        """Renew now every current lease with less than `within` seconds
        left (tests; the upkeep thread does this on its own)."""
        with self._core.lock:
            due = [e for e in self.views.keys() if (h := self._core.held.get(e)) is not None
                   and h.expires - time.monotonic() < within]
        self.views.renew(time.monotonic() + self.views.ttl / 2 - within)
        return len(due)

    def _restarted(self) -> None:
        """The sidecar lost every lock: lock the views' keys again (it removes
        nothing committed until the old locks could have lapsed)."""
        try:
            self._core.exec.submit(self.views.relock, self._deadline())
        except RuntimeError:
            pass

    # --------------------------------------------------------------- state

    def report_status(self) -> dict:
        c = self._core.conn
        with self._lock:
            puts = len(self._put_tasks)
        return {
            "is_healthy": self._core.healthy(),
            "mode": "inline" if c.inline else ("mmap" if c.pool else "not connected"),
            "pool_path": c.info.path if c.info else None,
            "cuda_registered": self.cuda_registered(),
            **self.views.report(),
            "inflight_puts": puts,
            "locked_key_count": len(self._core.held),
            "pending_unlocks": self._core.unlocks.pending(),
            "last_error": c.last_error,
        }

    def close(self) -> None:
        """Wait (within the deadline) for puts in flight, take every view out
        of LMCache's L1 and invalidate it, give every lock back, then close
        the connection."""
        if self._core.closed.is_set():
            return
        deadline = self._deadline()
        while time.monotonic() < deadline:
            with self._lock:
                if not self._put_tasks:
                    break
            time.sleep(0.01)
        live = self.views.has_live_views()
        with self._core.lock:
            held = [k for k, h in self._core.held.items() for _ in range(h.count)]
        for e in self.views.keys():
            self.views.lose(e, "the backend closed")
        if held:
            try:  # the session is durable: its locks would outlive the connection
                self._core.stub.Unlock(pb.UnlockRequest(keys=held), timeout=max(0.001, deadline - time.monotonic()))
            except grpc.RpcError as e:
                log.warning("cxlkv: giving locks back at close failed (%s); they lapse at their TTL", rpc_error(e))
        self._core.close()
        if self._renewer.is_alive():
            self._renewer.join(timeout=5)
        for pool in self._registered:
            gpu.unregister(pool.base)
        self._registered.clear()
        self._hits.close()
        # A view LMCache still references must never point at unmapped
        # memory: then the mapping stays until the process ends.
        self._core.close_io(unmap=not live)
        log.info("cxlkv backend closed")
