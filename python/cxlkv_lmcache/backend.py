"""``CxlKvBackend``: a storage backend for LMCache's in-process engine (vLLM's
``LMCacheConnectorV1``) whose memory objects ARE pool pages.

Load it with (LMCache YAML)::

    storage_plugins: ["cxlkv"]
    extra_config:
      storage_plugin.cxlkv.module_path: cxlkv_lmcache.backend
      storage_plugin.cxlkv.class_name: CxlKvBackend
      cxlkv.socket: /run/cxlkv/cxlkv.sock

**Stores.** LMCache's StorageManager gives every backend that is its own
allocator a copy of each new chunk in a per-key loop
(``allocate_and_copy_objects``: ``contains(key)``, ``allocate(shape,
dtype)``, a ``tensor.copy_`` into the object), then
``batched_submit_put_task``. LMCache's ``allocate`` carries no key, while the
sidecar reserves pages for a key, so the backend recognizes that loop as its
caller and stores the whole batch at its first ``contains``, through the
client core: one Reserve, each chunk copied once from LMCache's L1 into its
pages with streaming stores over the copy threads (written back where the
pool is software-coherent), one fence, one Commit. ``contains`` then answers
from that store and LMCache skips its own copy; a chunk that could not be
stored is skipped (``allocate`` returns None there). Called from anywhere
else, ``allocate`` / ``batched_allocate`` hand out views of pages reserved
under placeholder keys (the sidecar binds a reservation to its key and
cannot rename it), and the submit stores each object under its key through
the core: a second copy, off LMCache's put path. A reservation never committed is
aborted when its object is freed, never leaked (docs/ARCHITECTURE.md, "One
client, three faces").

**Loads.** ``get_blocking`` and the batched gets return objects that view
the pool pages directly (no copy; with CUDA the mapping is registered, so
LMCache's GPU connector reads them with one DMA). Each view holds one of the
sidecar's locks on its key from its lookup until its last reference is
dropped (``ref_count_down`` to 0 frees it here: the lock is released); a
background thread renews the locks of live views before they lapse (a second
lock first, then one unlock: the key is never unlocked in between). A view
whose key cannot be re-locked at the same location (a sidecar restart that
lost it, say) is dropped from LMCache's L1 and invalidated. Before handing
one out the backend checks the object is still the one located, and its
crc32 when ``verify_payload``: doubt is a miss.

Every public method returns a miss, False, 0 or None instead of raising, and
every call to the sidecar carries the ``deadline_ms`` budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import itertools
import logging
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
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
from lmcache.v1.storage_backend import storage_manager as _sm
from lmcache.v1.storage_backend.abstract_backend import AllocatorBackendInterface, StoragePluginInterface

from cxlkv_lmcache import client as cl
from cxlkv_lmcache import gpu
from cxlkv_lmcache import keys as keycodec
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.config import inproc_settings
from cxlkv_lmcache.tokens import EngineTokens
from cxlkv_lmcache.core import Core, crc32_at
from cxlkv_lmcache.state import Task, rpc_error

__all__ = ["CxlKvBackend"]

log = logging.getLogger("cxlkv_lmcache")

# StorageManager.batched_put's copy loop (LMCache 0.5.6): contains → allocate → copy, per key.
_PUT_LOOP = _sm.allocate_and_copy_objects.__code__
# Placeholder keys of allocations made outside that loop (see the module doc).
_ANON = b"\x04cxlkv-anon-"

# Slot states of a memory object this backend made.
RESERVED, VIEW, FREED = "reserved", "view", "freed"


@dataclass
class Slot:
    """What a memory object of this backend stands for in the sidecar."""

    state: str
    enc: bytes  # the key its pages are reserved or locked under
    loc: pb.Location
    pool: cl.PoolMap
    rid: int = 0  # reservation id (RESERVED)
    tenant: str = ""
    expires: float = 0.0  # unix time: no copy into a reservation may start after it
    key: Any = None  # the CacheEngineKey (a view's, for dropping it from L1)


@dataclass
class PutBatch:
    """One StorageManager.batched_put, stored at its first `contains`."""

    keys: list  # LMCache's list itself (identity marks the batch)
    made: float
    present: set = field(default_factory=set)  # encs stored now, or that the sidecar already had


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


def _view(addr: int, n: int) -> torch.Tensor:
    """A uint8 tensor over n bytes at addr (the pool mapping): no copy."""
    return torch.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=torch.uint8)


class PoolAllocator(MemoryAllocatorInterface):
    """The backend's allocator as LMCache sees it: objects over pool pages;
    `free` (an object's last reference gone) gives its reservation or lock
    back."""

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
        self._cfg, own = inproc_settings(extra)
        self._namespace = own["tenant"]
        # As LMCache's Maru and remote backends: with MLA every worker holds the
        # same KV, so workers other than 0 store nothing and read worker 0's.
        self._mla_as0 = bool(
            config is not None and metadata is not None and metadata.use_mla and metadata.world_size > 1
            and metadata.worker_id != 0
            and config.get_extra_config_value("remote_enable_mla_worker_id_as0", metadata.use_mla))
        self._geometry(metadata)
        self._lock = threading.Lock()  # batches, pins, live views, put tasks
        self._batches: dict[int, PutBatch] = {}
        self._pins: dict[bytes, int] = {}
        self._live: dict[bytes, weakref.WeakSet] = {}  # enc -> live view objects
        # enc -> pins + live views: each holds a share of this backend's
        # sidecar lock(s) on the key, all given back when the last share goes.
        self._users: dict[bytes, int] = {}
        self._put_tasks: set = set()
        self._encs: dict = {}
        self._whole: dict[int, tuple[cl.PoolMap, torch.Tensor]] = {}  # id(pool) -> a uint8 tensor over all of it
        self._anon = itertools.count(1)
        self._anon_prefix = _ANON + f"{time.time_ns():x}-{id(self):x}-".encode()
        self._registered: list[cl.PoolMap] = []
        self._core = Core(self._cfg, on_map=self._mapped)
        self._tokens = EngineTokens(config)  # token ids for the sidecar's events (tokens.py)
        self._core.on_restart(self._restarted)
        self.memory_allocator = self.initialize_allocator(config, metadata)
        self._renewer = threading.Thread(target=self._renew_loop, name="cxlkv-renew", daemon=True)
        self._core.start()
        self._renewer.start()

    def __str__(self) -> str:
        return self.__class__.__name__

    # ------------------------------------------------------------ geometry

    def _geometry(self, metadata: Optional[LMCacheMetadata]) -> None:
        """Shapes of a full chunk, to give a loaded object its shape (the
        pool stores bytes; a short last chunk has fewer tokens)."""
        self._shapes = self._dtypes = None
        self._fmt = MemoryFormat.KV_2LTD
        self._full = self._token_bytes = 0
        if metadata is None:
            return
        try:
            self._shapes = list(metadata.get_shapes())
            self._dtypes = list(metadata.get_dtypes())
            self._fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
            self._full = get_size_bytes(self._shapes, self._dtypes)
            self._token_bytes = self._full // metadata.chunk_size if metadata.chunk_size else 0
        except Exception:
            log.exception("cxlkv: cannot derive chunk shapes from LMCache's metadata; loads will miss")
            self._shapes = None

    def _shape_for(self, n: int):
        """(shapes, dtypes) of an object of n bytes, or None (a miss)."""
        if self._shapes is None:
            return None
        if n == self._full:
            return self._shapes, self._dtypes
        if not self._token_bytes or n % self._token_bytes or n > self._full:
            return None
        tokens = n // self._token_bytes
        dim = self._fmt.token_dim()
        shapes = []
        for s in self._shapes:
            s = list(s)
            s[dim] = tokens
            shapes.append(torch.Size(s))
        return shapes, self._dtypes

    # ----------------------------------------------------------- mapping

    def _mapped(self, old: cl.PoolMap | None, new: cl.PoolMap) -> None:
        if gpu.register(new.base, new.size):
            self._registered.append(new)

    def cuda_registered(self) -> bool:
        return bool(self._registered)

    def _conn(self, deadline: float):
        """The connection with a pool mapping, or None (views need one)."""
        conn = self._core.connect(deadline)
        return conn if conn.pool is not None and not conn.inline else None

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

    def get_allocator_backend(self) -> "CxlKvBackend":
        return self

    def calculate_chunk_budget(self) -> int:
        info = self._core.conn.info
        if info is None or not self._full:
            return 0
        return int(info.capacity_bytes // self._full)

    def _raw(self, pool: cl.PoolMap, addr: int, n: int) -> torch.Tensor:
        """n bytes of the mapping at addr as a uint8 tensor: a slice of one
        tensor over the whole mapping (made once per mapping)."""
        got = self._whole.get(id(pool))
        if got is None or got[0] is not pool:
            got = self._whole[id(pool)] = (pool, _view(pool.base, pool.size))
        off = addr - pool.base
        return got[1][off:off + n]

    def _object(self, slot: Slot, shapes, dtypes, fmt, addr: int = 0) -> TensorMemoryObj:
        addr = addr or slot.pool.addr(slot.loc)
        meta = MemoryObjMetadata(shape=shapes[0], dtype=dtypes[0], address=addr - slot.pool.base,
                                 phy_size=slot.loc.length, ref_count=1, pin_count=0, fmt=fmt,
                                 shapes=list(shapes), dtypes=list(dtypes))
        obj = TensorMemoryObj(self._raw(slot.pool, addr, slot.loc.length), meta, parent_allocator=self.memory_allocator)
        obj._cxlkv = slot
        return obj

    @staticmethod
    def _norm(shapes, dtypes):
        shapes = [shapes] if isinstance(shapes, torch.Size) else list(shapes)
        dtypes = [dtypes] if isinstance(dtypes, torch.dtype) else list(dtypes)
        if len(dtypes) == 1 and len(shapes) > 1:
            dtypes = dtypes * len(shapes)
        return shapes, dtypes

    def _put_loop_frame(self):
        """The StorageManager copy loop calling us, if that is who calls."""
        f = sys._getframe(2)
        for _ in range(4):
            if f is None:
                return None
            if f.f_code is _PUT_LOOP:
                return f
            f = f.f_back
        return None

    def _batch(self, frame) -> PutBatch | None:
        """The put batch of this StorageManager loop, stored the first time
        the loop asks (see `_store_batch`)."""
        local = frame.f_locals
        keys, srcs = local.get("keys"), local.get("src_memory_objs")
        if keys is None or srcs is None:
            return None
        with self._lock:
            b = self._batches.get(id(keys))
            if b is not None and b.keys is keys:
                return b
        b = PutBatch(keys=keys, made=time.monotonic())
        self._store_batch(b, list(keys), list(srcs))
        with self._lock:
            self._sweep_batches_locked(self._batch_life())
            self._batches[id(keys)] = b
        return b

    def _store_batch(self, b: PutBatch, keys: list, srcs: list) -> None:
        """Store every chunk of LMCache's put batch the way every face of the
        client stores (Core.store): one Reserve, the chunks copied from
        LMCache's L1 into their pages with streaming stores spread over the
        copy threads (written back where the pool is software-coherent), one
        fence, one Commit. LMCache's own loop would copy each chunk into an
        `allocate`d view with a plain copy (each destination line read
        first: on CXL memory, a trip across the link) after a per-chunk call
        or two: this is the same single copy, batched."""
        deadline = self._deadline()
        try:
            self._core.connect(deadline)  # mapped, or inline (bytes through the sidecar)
        except grpc.RpcError as e:
            self._core.rpc_failed(e)
            return  # sidecar away: every put of the batch is skipped
        groups: dict[str, list] = {}
        seen = set()
        for k, src in zip(keys, srcs):
            e = self._enc(k)
            if e in seen or src is None or src.tensor is None:
                continue
            seen.add(e)
            groups.setdefault(self._tenant(k), []).append((k, e, src.data_ptr, src.get_size()))
        self._tokens.hand(self._core, keys, [self._enc(k) for k in keys], self._enc)
        with self._lock:
            self._put_tasks.update(seen)
        try:
            with self._skipped_on_failure(len(seen)):
                _, _, new = self._core.store(self._core.task("store", len(seen)), list(groups.items()),
                                             account=False, present=b.present)
                b.present.update(e for _, e, _, _ in new)
        finally:
            with self._lock:
                self._put_tasks.difference_update(seen)

    @contextlib.contextmanager
    def _skipped_on_failure(self, n: int):
        """A put of `n` chunks that fails in the block is logged and skipped,
        never raised (a failed RPC also tells the core)."""
        try:
            yield
        except grpc.RpcError as e:
            self._core.rpc_failed(e)
            log.warning("cxlkv put of %d chunks failed: %s; skipped", n, rpc_error(e))
        except Exception:
            log.exception("cxlkv put of %d chunks failed; skipped", n)

    def _batch_life(self) -> float:
        """How long a put loop's batch is remembered (a loop takes far less)."""
        return max(10.0, self._cfg.deadline_ms / 1000)

    def _sweep_batches_locked(self, older_than: float) -> None:
        now = time.monotonic()
        for k, b in list(self._batches.items()):
            if now - b.made > older_than:
                del self._batches[k]

    def _sweep_batches(self, older_than: float) -> None:
        with self._lock:
            self._sweep_batches_locked(older_than)

    @_guard(lambda *a, **k: None)
    def allocate(
        self,
        shapes: Union[torch.Size, list[torch.Size]],
        dtypes: Union[torch.dtype, list[torch.dtype]],
        fmt: MemoryFormat = MemoryFormat.KV_2LTD,
        eviction: bool = True,
        busy_loop: bool = True,
    ) -> Optional[MemoryObj]:
        shapes, dtypes = self._norm(shapes, dtypes)
        size = get_size_bytes(shapes, dtypes)
        if self._put_loop_frame() is not None:
            # StorageManager's loop asks only for chunks its batch could not
            # store (pool full, sidecar away, the deadline): skip them.
            return None
        objs = self._anonymous([size], shapes, dtypes, fmt)
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
        shapes, dtypes = self._norm(shapes, dtypes)
        size = get_size_bytes(shapes, dtypes)
        return self._anonymous([size] * batch_size, shapes, dtypes, fmt)

    def _anonymous(self, sizes: list[int], shapes, dtypes, fmt) -> Optional[list[MemoryObj]]:
        """Pages reserved under placeholder keys (no key known yet); all or
        nothing."""
        deadline = self._deadline()
        conn = self._conn(deadline)
        if conn is None or not sizes:
            return None
        encs = [self._anon_prefix + f"{next(self._anon):x}".encode() for _ in sizes]
        rep = self._core.reserve(Task("store", deadline, len(sizes)), self._namespace,
                                 [pb.ReserveItem(key=e, size=n) for e, n in zip(encs, sizes)])
        until = Core.last_copy_start(conn, rep)
        ok = [r for r in rep.reservations if r.status.code == cl.OK]
        if len(ok) != len(sizes):
            self._core.abort_quietly([r.reservation_id for r in ok])
            return None
        return [self._reserved_object(r, e, self._namespace, until, shapes, dtypes, fmt)
                for r, e in zip(rep.reservations, encs)]

    def _reserved_object(self, r: pb.Reservation, enc: bytes, tenant: str, until: float, shapes, dtypes, fmt):
        pool = self._core.conn.pool
        slot = Slot(RESERVED, enc, r.location, pool, rid=r.reservation_id, tenant=tenant, expires=until)
        addr = pool.addr(r.location)
        tail = r.location.length % cl.LINE
        if tail:  # the sidecar may keep a long name after the payload in the last line: read it fresh
            pool.fresh(addr + r.location.length - tail, tail)
        return self._object(slot, shapes, dtypes, fmt)

    def _free(self, obj: MemoryObj) -> None:
        """An object's last reference is gone: a reservation never committed
        is aborted, a view's lock released."""
        slot = getattr(obj, "_cxlkv", None)
        if slot is None:
            return
        with self._lock:
            state, slot.state = slot.state, FREED
            if state == VIEW:
                live = self._live.get(slot.enc)
                if live is not None:
                    live.discard(obj)
                    if not live:
                        del self._live[slot.enc]
        try:
            if state == RESERVED:
                self._core.exec.submit(self._core.abort_quietly, [slot.rid])
            elif state == VIEW:
                self._give(slot.enc)
        except RuntimeError:  # closing: the sidecar reclaims and releases on its own
            pass

    # ------------------------------------------------------ lock shares

    def _take(self, enc: bytes) -> None:
        """One more user (a pin or a view) of this backend's lock on enc;
        the caller holds a lock on it (just taken, or borrowed)."""
        with self._lock:
            self._users[enc] = self._users.get(enc, 0) + 1

    def _give(self, enc: bytes) -> None:
        """A user of the lock is done; the last gives every sidecar lock
        this backend holds on the key back."""
        with self._lock:
            n = self._users.get(enc, 0) - 1
            if n > 0:
                self._users[enc] = n
                return
            self._users.pop(enc, None)
            count = self._held(enc)
        self._release_held(enc, count)

    def _held(self, enc: bytes) -> int:
        """How many sidecar locks on the key the core holds for this backend."""
        with self._core.lock:
            h = self._core.held.get(enc)
            return h.count if h is not None else 0

    def _release_held(self, enc: bytes, count: int) -> None:
        """Give `count` sidecar locks on the key back (taken with `_held`)."""
        if count:
            self._core.release([enc] * count)

    def _borrowable(self, encs: list[bytes]) -> set:
        """Keys this backend holds a fresh lock on for a pin or view: a new
        view shares it (no lookup), as a retrieve after LMCache's pinned
        lookup does."""
        now = time.monotonic()
        margin = self._cfg.lock_ttl_ms / 1000 / 4
        with self._lock, self._core.lock:
            return {e for e in encs if self._users.get(e, 0) > 0 and e in self._core.held
                    and self._core.held[e].expires - now > margin}

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
        self._tokens.hand(self._core, keys, encs, self._enc)
        with self._lock:
            self._put_tasks.update(encs)
        for o in objs:
            o.ref_count_up()  # held until the commit answered
        try:
            fut = self._core.exec.submit(self._put, keys, encs, objs, on_complete_callback)
        except RuntimeError:  # closing
            self._put_done(encs, objs)
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

    def _put_done(self, encs, objs) -> None:
        with self._lock:
            self._put_tasks.difference_update(encs)
        for o in objs:
            o.ref_count_down()

    def _put(self, keys, encs, objs, on_complete) -> None:
        """Store what LMCache handed over; never raises."""
        stored: list = []
        try:
            with self._skipped_on_failure(len(keys)):
                stored = self._put_inner(keys, encs, objs)
        finally:
            self._put_done(encs, objs)
        if on_complete is not None:
            for k in stored:
                try:
                    on_complete(k)
                except Exception as e:
                    log.warning("on_complete_callback failed for key %s: %s", k, e)

    def _put_inner(self, keys, encs, objs) -> list:
        """Objects handed to the submit are stored through the client core: a
        reservation of each chunk's own key, one copy into it, one Commit.
        (An object this backend allocated sits in pages reserved under a
        placeholder key, which the sidecar cannot rename: its bytes move into
        the key's own pages, and its placeholder is aborted when LMCache
        frees it.)"""
        groups: dict[str, list] = {}
        for k, e, o in zip(keys, encs, objs):
            groups.setdefault(self._tenant(k), []).append((k, e, o.data_ptr, o.get_size()))
        _, _, new = self._core.store(self._core.task("store", len(keys)), list(groups.items()), account=False)
        return [k for k, _, _, _ in new]

    # -------------------------------------------------------------- gets

    def _views(self, keys: list, prefix: bool) -> list:
        """One LookupAndLock for every key; a view per hit (with its lock),
        None per miss. With `prefix`, everything after the first miss is
        released and returned as None."""
        deadline = self._deadline()
        n = len(keys)
        if not n:
            return []
        conn = self._conn(deadline)
        if conn is None:
            return self._copies(keys, deadline, prefix)
        encs = [self._enc(k) for k in keys]
        shared = self._borrowable(encs)
        ask = [e for e in encs if e not in shared]
        hits = dict(zip(ask, self._core.lock_keys(deadline, ask))) if ask else {}
        for e in shared:
            hits[e] = True
        for e, h in hits.items():
            if h:
                self._take(e)  # the lock just taken, or a share of the one held
        out: list = [None] * n
        stop = False
        for i, (k, e) in enumerate(zip(keys, encs)):
            if not hits.get(e):
                stop = stop or prefix
                continue
            loc = self._core.location(e)
            obj = None if stop or loc is None else self._make_view(conn, k, e, loc)
            if obj is None:
                self._give(e)
                stop = stop or prefix
                continue
            out[i] = obj
            if encs.count(e) > 1 and i != encs.index(e):
                self._take(e)  # the same key twice in one call: a share per view
        return out

    def _make_view(self, conn, key, enc: bytes, loc: pb.Location) -> Optional[MemoryObj]:
        shaped = self._shape_for(loc.length)
        if shaped is None:
            log.warning("cxlkv object of %d bytes does not fit this engine's chunk shape: a miss", loc.length)
            return None
        pool = conn.pool
        addr = pool.addr(loc)
        if pool.software:
            pool.fresh(addr, loc.length)  # read what the writer flushed, not this host's cached lines
        if not self._core.checked(conn, loc, addr):
            return None
        obj = self._object(Slot(VIEW, enc, loc, pool, key=key), shaped[0], shaped[1], self._fmt, addr)
        with self._lock:
            live = self._live.get(enc)
            if live is None:
                live = self._live[enc] = weakref.WeakSet()
            live.add(obj)
        return obj

    def _copies(self, keys: list, deadline: float, prefix: bool) -> list:
        """Without a mapping of the pool (mode 'inline'): the objects copied
        into LMCache's L1 through the sidecar instead of viewed."""
        lcb = self.local_cpu_backend
        if lcb is None or self._shapes is None or self._core.conn.info is None or not self._core.conn.inline:
            return [None] * len(keys)
        out: list = [None] * len(keys)
        encs = [self._enc(k) for k in keys]
        objs = [lcb.allocate(self._shapes, self._dtypes, self._fmt) for _ in keys]
        task = Task("load", deadline, len(keys))
        live = [i for i, o in enumerate(objs) if o is not None]
        loaded = set(self._core.load(task, [encs[i] for i in live], [(objs[i].data_ptr, self._full) for i in live]))
        for j, i in enumerate(live):
            if j in loaded:
                out[i] = objs[i]
            else:
                objs[i].ref_count_down()
        if prefix and None in out:
            cut = out.index(None)
            for o in out[cut:]:
                if o is not None:
                    o.ref_count_down()
            out = out[:cut] + [None] * (len(out) - cut)
        return out

    @_guard(lambda *a, **k: None)
    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return self._views([key], prefix=False)[0]

    @_guard(lambda keys, *a, **k: [None] * len(keys))
    def batched_get_blocking(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        return self._views(list(keys), prefix=False)

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
            return self._views(keys, prefix=True)
        except grpc.RpcError as e:
            self._core.rpc_failed(e)
            log.warning("cxlkv get of %d chunks failed: %s", len(keys), rpc_error(e))
        except Exception:
            log.exception("cxlkv get of %d chunks failed", len(keys))
        return [None] * len(keys)

    # ------------------------------------------------- contains and pins

    def _contains_rpc(self, keys: list, pin: bool) -> int:
        """Hit chunks by prefix match; with `pin` each counted one is locked
        (released by unpin)."""
        if not keys:
            return 0
        deadline = self._deadline()
        encs = [self._enc(k) for k in keys]
        if not pin:
            found = self._core.exists(encs, deadline)
            return sum(1 for _ in itertools.takewhile(bool, found))
        hits = self._core.lock_keys(deadline, encs)
        n = sum(1 for _ in itertools.takewhile(bool, hits))
        for e, h in zip(encs, hits):
            if h:
                self._take(e)
        with self._lock:
            for e in encs[:n]:
                self._pins[e] = self._pins.get(e, 0) + 1
        for e, h in zip(encs[n:], hits[n:]):
            if h:  # found after a miss: not counted, not kept
                self._give(e)
        return n

    @_guard(lambda *a, **k: False)
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        frame = self._put_loop_frame() if not pin else None
        if frame is not None:
            b = self._batch(frame)
            if b is not None:
                return self._enc(key) in b.present
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
        e = self._enc(key)
        with self._lock:
            n = self._pins.get(e, 0)
            if not n:
                return False
            if n == 1:
                del self._pins[e]
            else:
                self._pins[e] = n - 1
        self._give(e)
        return True

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

    def _renew_loop(self) -> None:
        """Every third of the lock TTL: renew the locks of live views and
        pins that would lapse within half of it."""
        ttl = self._cfg.lock_ttl_ms / 1000
        every = max(0.05, min(ttl / 3, 1.0))
        while not self._core.closed.wait(every):
            try:
                self._sweep_batches(self._batch_life())
                self.renew_now(ttl / 2)
            except grpc.RpcError as e:
                self._core.rpc_failed(e)
            except Exception:
                log.exception("cxlkv lock renewal failed")

    def renew_now(self, within: float) -> int:
        """Renew every held lock that lapses within `within` seconds; views
        of keys no longer where they were are dropped. Returns how many
        keys were renewed."""
        now = time.monotonic()
        with self._core.lock:
            due = [e for e, h in self._core.held.items() if h.expires - now < within]
        if not due:
            return 0
        locs = self._core.renew(due, self._deadline())
        lost = [e for e, loc in zip(due, locs) if loc is None or not self._same_place(e, loc)]
        for e in lost:
            self._drop_views(e, "its lock could not be renewed at the same location")
        return len(due) - len(lost)

    def _same_place(self, enc: bytes, loc: pb.Location) -> bool:
        with self._lock:
            views = list(self._live.get(enc, ()))
        return all((v._cxlkv.loc.region, v._cxlkv.loc.offset, v._cxlkv.loc.length, v._cxlkv.loc.version) ==
                   (loc.region, loc.offset, loc.length, loc.version) for v in views)

    def _drop_views(self, enc: bytes, why: str) -> None:
        """Views whose pages may be reused: out of LMCache's L1, invalid."""
        with self._lock:
            views = list(self._live.pop(enc, ()))
            self._pins.pop(enc, None)
            self._users.pop(enc, None)
            count = self._held(enc)
        self._release_held(enc, count)
        if not views:
            return
        log.warning("cxlkv: %d view(s) of a chunk dropped: %s", len(views), why)
        for v in views:
            if self.local_cpu_backend is not None and v._cxlkv.key is not None:
                try:
                    self.local_cpu_backend.remove(v._cxlkv.key)
                except Exception:
                    pass
            v._cxlkv.state = FREED
            v.invalidate()

    def _restarted(self) -> None:
        """The sidecar lost every lock: take one again for each key with live
        views or pins, or drop the views."""
        with self._lock:
            wanted = {e: 1 for e, n in self._users.items() if n > 0}  # one lock per key carries every share
        if not wanted:
            return
        try:
            self._core.exec.submit(self._relock, wanted)
        except RuntimeError:
            pass

    def _relock(self, wanted: dict) -> None:
        encs = [e for e, n in wanted.items() for _ in range(n)]
        try:
            hits = self._core.lock_keys(self._deadline(), encs)
        except Exception as e:  # grpc.RpcError included: nothing is protected, drop them all
            log.warning("cxlkv: re-locking views after a sidecar restart failed: %s", e)
            hits = [False] * len(encs)
        for e in wanted:
            loc = self._core.location(e)
            if loc is None or not all(h for h, x in zip(hits, encs) if x == e) or not self._same_place(e, loc):
                self._drop_views(e, "the sidecar restarted without it")

    # --------------------------------------------------------------- state

    def report_status(self) -> dict:
        c = self._core.conn
        with self._lock:
            views = sum(len(v) for v in self._live.values())
            pins = sum(self._pins.values())
            puts = len(self._put_tasks)
        return {
            "is_healthy": self._core.healthy(),
            "mode": "inline" if c.inline else ("mmap" if c.pool else "not connected"),
            "pool_path": c.info.path if c.info else None,
            "cuda_registered": self.cuda_registered(),
            "live_views": views,
            "pins": pins,
            "inflight_puts": puts,
            "locked_key_count": len(self._core.held),
            "pending_unlocks": self._core.unlocks.pending(),
            "last_error": c.last_error,
        }

    def close(self) -> None:
        """Wait (within the deadline) for puts in flight, abort unsubmitted
        reservations, then close the connection: the sidecar releases every
        lock this backend held."""
        if self._core.closed.is_set():
            return
        deadline = self._deadline()
        while time.monotonic() < deadline:
            with self._lock:
                if not self._put_tasks:
                    break
            time.sleep(0.01)
        self._sweep_batches(-1)
        self._core.close()
        if self._renewer.is_alive():
            self._renewer.join(timeout=5)
        for pool in self._registered:
            gpu.unregister(pool.base)
        self._registered.clear()
        self._whole.clear()
        with self._lock:
            live = any(self._live.values())
        # A view LMCache still holds (its L1, closed before us) must never
        # point at unmapped memory: then the mapping stays until the process ends.
        self._core.close_io(unmap=not live)
        log.info("cxlkv backend closed")
