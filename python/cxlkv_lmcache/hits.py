"""The in-process backend's read path: a hit is a view of the pool's pages
(no copy) under a lease of `views.py`, or, without a mapping of the pool
(mode 'inline'), a copy into LMCache's L1 through the sidecar. Also the
engine's chunk shapes, which give a loaded object its shape (the pool
stores bytes; a short last chunk has fewer tokens)."""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Callable, Optional

import torch
from lmcache.utils import get_size_bytes
from lmcache.v1.memory_management import MemoryFormat, MemoryObj, MemoryObjMetadata
from lmcache.v1.metadata import LMCacheMetadata

from cxlkv_lmcache import client as cl
from cxlkv_lmcache.core import Core
from cxlkv_lmcache.state import Task
from cxlkv_lmcache.views import Lease, PoolView, Slot, Views

log = logging.getLogger("cxlkv_lmcache")


def _view(addr: int, n: int) -> torch.Tensor:
    """A uint8 tensor over n bytes at addr (the pool mapping): no copy."""
    return torch.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=torch.uint8)


class ChunkShapes:
    """Shapes and dtypes of the engine's chunks (LMCache's metadata)."""

    def __init__(self, metadata: Optional[LMCacheMetadata]):
        self.shapes = self.dtypes = None
        self.fmt = MemoryFormat.KV_2LTD
        self.full = self._token_bytes = 0
        if metadata is None:
            return
        try:
            self.shapes = list(metadata.get_shapes())
            self.dtypes = list(metadata.get_dtypes())
            self.fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
            self.full = get_size_bytes(self.shapes, self.dtypes)
            self._token_bytes = self.full // metadata.chunk_size if metadata.chunk_size else 0
        except Exception:
            log.exception("cxlkv: cannot derive chunk shapes from LMCache's metadata; loads will miss")
            self.shapes = None

    def of(self, n: int):
        """(shapes, dtypes) of an object of n bytes, or None (a miss)."""
        if self.shapes is None:
            return None
        if n == self.full:
            return self.shapes, self.dtypes
        if not self._token_bytes or n % self._token_bytes or n > self.full:
            return None
        tokens = n // self._token_bytes
        dim = self.fmt.token_dim()
        shapes = []
        for s in self.shapes:
            s = list(s)
            s[dim] = tokens
            shapes.append(torch.Size(s))
        return shapes, self.dtypes


class Hits:
    """Hits of one backend: views (or inline copies) of located chunks."""

    def __init__(self, core: Core, views: Views, shapes: ChunkShapes, allocator, l1,
                 enc: Callable[[object], bytes]):
        self._core, self._views, self.shapes = core, views, shapes
        self._allocator = allocator  # the views' parent allocator: their last reference gives the lease back
        self._l1 = l1
        self._enc = enc
        self._whole: dict[int, tuple[cl.PoolMap, torch.Tensor]] = {}  # id(pool) -> a uint8 tensor over all of it

    def get(self, keys: list, prefix: bool) -> list:
        """A view per hit (sharing the key's lease, or under a lock taken
        now), None per miss. With `prefix`, everything after the first miss
        is given back and returned as None."""
        deadline = time.monotonic() + self._core.cfg.deadline_ms / 1000
        if not keys:
            return []
        conn = self._core.connect(deadline)
        if conn.pool is None or conn.inline:
            return self._copies(keys, deadline, prefix)
        encs = [self._enc(k) for k in keys]
        leases: dict[bytes, Lease] = {}
        for e in dict.fromkeys(encs):
            lease = self._views.shared(e)
            if lease is not None:
                leases[e] = lease
        ask = [e for e in dict.fromkeys(encs) if e not in leases]
        if ask:
            leases.update(self._lock_leases(deadline, ask))
        out: list = [None] * len(keys)
        stop, used = False, set()
        for i, (k, e) in enumerate(zip(keys, encs)):
            lease = leases.get(e)
            if lease is not None and e in used:  # the same key twice in one call: a user per view
                lease = lease if self._views.join(lease) else None
            used.add(e)
            obj = None if stop or lease is None else self._make_view(conn, k, lease)
            if obj is None:
                if lease is not None:
                    self._views.give(lease)
                stop = stop or prefix
                continue
            out[i] = obj
        if any(o is not None for o in out) and self._views.over_budget():
            # The least recently read go, down to three quarters of the
            # budget: an engine reading at its budget looks at every lease
            # once per quarter budget read, not at every get.
            self._views.shed(time.monotonic(), budget=self._views.budget() * 3 // 4)
        return out

    def _lock_leases(self, deadline: float, encs: list[bytes]) -> dict[bytes, Lease]:
        """Lock `encs` (one LookupAndLock) as leases. Refused because this
        engine pins as much as the sidecar allows: its least recently read
        views go, and the refused keys are asked once more."""
        hits, over = self._core.lock_keys_ex(deadline, encs)
        if over:
            self._views.shed(time.monotonic(), budget=self._views.budget() // 2 or 1)
            again = [e for e, h in zip(encs, hits) if not h]
            if again:
                got = dict(zip(again, self._core.lock_keys(deadline, again)))
                hits = [h or got.get(e, False) for e, h in zip(encs, hits)]
        out = {}
        for e, h in zip(encs, hits):
            lease = self._views.locked(e) if h else None
            if lease is not None:
                out[e] = lease
        return out

    def _make_view(self, conn, key, lease: Lease) -> Optional[MemoryObj]:
        loc = lease.loc
        shaped = self.shapes.of(loc.length)
        if shaped is None:
            log.warning("cxlkv object of %d bytes does not fit this engine's chunk shape: a miss", loc.length)
            return None
        pool = conn.pool
        addr = pool.addr(loc)
        if pool.software:
            pool.fresh(addr, loc.length)  # read what the writer flushed, not this host's cached lines
        if not self._core.checked(conn, loc, addr):
            return None
        shapes, dtypes = shaped
        meta = MemoryObjMetadata(shape=shapes[0], dtype=dtypes[0], address=addr - pool.base, phy_size=loc.length,
                                 ref_count=1, pin_count=0, fmt=self.shapes.fmt, shapes=list(shapes),
                                 dtypes=list(dtypes))
        view = PoolView(self._raw(pool, addr, loc.length), meta, self._allocator, Slot(lease, key))
        self._views.add_view(view)
        return view

    def _raw(self, pool: cl.PoolMap, addr: int, n: int) -> torch.Tensor:
        """n bytes of the mapping at addr as a uint8 tensor: a slice of one
        tensor over the whole mapping (made once per mapping)."""
        got = self._whole.get(id(pool))
        if got is None or got[0] is not pool:
            got = self._whole[id(pool)] = (pool, _view(pool.base, pool.size))
        off = addr - pool.base
        return got[1][off:off + n]

    def _copies(self, keys: list, deadline: float, prefix: bool) -> list:
        """Without a mapping of the pool (mode 'inline'): the objects copied
        into LMCache's L1 through the sidecar instead of viewed."""
        lcb, sh = self._l1, self.shapes
        if lcb is None or sh.shapes is None or self._core.conn.info is None or not self._core.conn.inline:
            return [None] * len(keys)
        out: list = [None] * len(keys)
        encs = [self._enc(k) for k in keys]
        objs = [lcb.allocate(sh.shapes, sh.dtypes, sh.fmt) for _ in keys]
        task = Task("load", deadline, len(keys))
        live = [i for i, o in enumerate(objs) if o is not None]
        loaded = set(self._core.load(task, [encs[i] for i in live], [(objs[i].data_ptr, sh.full) for i in live]))
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

    def close(self) -> None:
        self._whole.clear()
