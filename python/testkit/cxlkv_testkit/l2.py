"""LMCache's L2 adapter interface as the tests drive it: keys, memory
objects, and store / lookup-and-lock / load tasks waited on through the
adapter's event fds."""

from __future__ import annotations

import time

import torch
# Block until an event fd is signalled or the timeout passes (and drain it).
from lmcache.cli.commands.bench.l2_adapter_bench.data import wait_eventfd as wait_fd
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

from cxlkv_testkit import make_adapter  # noqa: F401 - with the helpers below, for scripts run in a child process

EMPTY = MemoryLayoutDesc(shapes=[], dtypes=[])


def key(i: int, salt: str = "", model: str = "org/model") -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(32, "big"), model_name=model, kv_rank=0x02010201, cache_salt=salt)


def obj(nbytes: int, seed: int = 0) -> TensorMemoryObj:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    meta = MemoryObjMetadata(shape=torch.Size([nbytes]), dtype=torch.uint8, address=0, phy_size=nbytes,
                             fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(raw, meta, parent_allocator=None)


def store(a, keys, objs, timeout=10.0):
    tid = a.submit_store_task(keys, objs)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        wait_fd(a.get_store_event_fd(), 0.5)
        done = a.pop_completed_store_tasks()
        if tid in done:
            return done[tid]
    raise AssertionError("store task never completed")


def lookup(a, keys, timeout=10.0):
    tid = a.submit_lookup_and_lock_task(keys, {0: EMPTY})
    return _query(a, a.get_lookup_and_lock_event_fd(), a.query_lookup_and_lock_result, tid, timeout)


def load(a, keys, objs, timeout=10.0):
    tid = a.submit_load_task(keys, objs)
    return _query(a, a.get_load_event_fd(), a.query_load_result, tid, timeout)


def _query(a, fd, q, tid, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        wait_fd(fd, 0.2)
        r = q(tid)
        if r is not None:
            return r
    raise AssertionError("task never completed")


def bits(bm, n):
    return [bm.test(i) for i in range(n)]
