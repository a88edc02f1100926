"""``BoundedL2Adapter``: any LMCache L2 adapter (the second tier behind the
pool, e.g. LMCache's own ``resp`` adapter on Redis) whose lookups end by a
deadline.

LMCache's prefetch asks every L2 adapter to look a request's keys up and
waits for all of them; its controllers have no timeouts. A second tier that
is hung (a stopped Redis: no error, no answer) therefore stalls every
lookup, also of chunks the pool holds in full. Wrapped, that tier's lookup
answers "none found" at ``lookup_deadline_ms`` and the prefetch goes on with
what the other adapters found; the keys the tier locks later are unlocked
as soon as its late answer comes. Stores and loads pass through unchanged:
ending one early would let LMCache reuse a buffer the tier may still read or
write (another chunk's bytes stored, or written into L1). While the tier has
work past the deadline, ``report_status()`` says unhealthy.

Load it (the inner adapter's own JSON under ``inner``)::

    --l2-adapter '{"type":"plugin","module_path":"cxlkv_lmcache.bounded","class_name":"BoundedL2Adapter",
                   "adapter_params":{"lookup_deadline_ms":1000,"inner":{"type":"resp","host":"redis","port":6379}}}'
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import select
import threading
import time

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import consume_fd, create_event_notifier

__all__ = ["BoundedL2Adapter"]

log = logging.getLogger("cxlkv_lmcache")


def _inner(spec: dict, l1_memory_desc):
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters[0]
    return create_l2_adapter(cfg, l1_memory_desc)


class _Lookup:
    __slots__ = ("inner", "keys", "deadline", "result")

    def __init__(self, inner: int, keys: list, deadline: float):
        self.inner, self.keys, self.deadline, self.result = inner, keys, deadline, None


class BoundedL2Adapter(L2AdapterInterface):
    """See the module doc."""

    def __init__(self, config: dict, **kwargs):
        params = dict(config)
        spec = params.pop("inner", None)
        deadline_ms = params.pop("lookup_deadline_ms", 1000)
        if params:
            raise ValueError(f"unknown BoundedL2Adapter adapter_params {sorted(params)}; known: inner, "
                             "lookup_deadline_ms")
        if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
            raise ValueError("BoundedL2Adapter adapter_params.inner must be an L2 adapter's JSON object with a type")
        if not isinstance(deadline_ms, int) or isinstance(deadline_ms, bool) or deadline_ms <= 0:
            raise ValueError(f"BoundedL2Adapter adapter_params.lookup_deadline_ms must be > 0, got {deadline_ms!r}")
        self._in = _inner(spec, kwargs.get("l1_memory_desc"))
        super().__init__(max_capacity_bytes=getattr(self._in, "_max_capacity_bytes", 0) or 0)
        self._deadline = deadline_ms / 1000
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._lookups: dict[int, _Lookup] = {}
        self._abandoned: dict[int, list] = {}  # inner task -> its keys, answered late
        self._started: dict[tuple[str, int], float] = {}  # store/load tasks of the tier in flight
        self._late_lookups = 0
        self._ev = create_event_notifier()
        self._closed = threading.Event()
        self._watch = threading.Thread(target=self._run, name="cxlkv-bounded", daemon=True)
        self._watch.start()

    # ---------------------------------------------------------- lookups

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._ev.fileno()

    def submit_lookup_and_lock_task(self, keys, group_layout_descs) -> int:
        inner = self._in.submit_lookup_and_lock_task(keys, group_layout_descs)
        tid = next(self._ids)
        with self._lock:
            self._lookups[tid] = _Lookup(inner, list(keys), time.monotonic() + self._deadline)
        return tid

    def query_lookup_and_lock_result(self, task_id: int):
        with self._lock:
            t = self._lookups.get(task_id)
            if t is None or t.result is None:
                return None
            del self._lookups[task_id]
            return t.result

    def _run(self) -> None:
        """Collect the tier's lookup answers; answer for it at the deadline."""
        poll = select.poll()
        poll.register(self._in.get_lookup_and_lock_event_fd(), select.POLLIN)
        while not self._closed.is_set():
            if poll.poll(20):
                try:
                    consume_fd(self._in.get_lookup_and_lock_event_fd())
                except BlockingIOError:
                    pass
            try:
                self._collect(time.monotonic())
            except Exception:
                log.exception("cxlkv bounded adapter: collecting lookups failed")

    def _collect(self, now: float) -> None:
        ready = False
        with self._lock:
            pending = [(tid, t) for tid, t in self._lookups.items() if t.result is None]
            late = list(self._abandoned.items())
        for tid, t in pending:
            bm = self._in.query_lookup_and_lock_result(t.inner)
            if bm is None and now < t.deadline:
                continue
            with self._lock:
                if bm is None:  # past the deadline: nothing found; its late answer is unlocked
                    self._abandoned[t.inner] = t.keys
                    self._late_lookups += 1
                    bm = Bitmap(len(t.keys))
                t.result, ready = bm, True
        for inner, keys in late:
            bm = self._in.query_lookup_and_lock_result(inner)
            if bm is not None:
                with self._lock:
                    del self._abandoned[inner]
                found = [k for i, k in enumerate(keys) if bm.test(i)]
                if found:
                    self._in.submit_unlock(found)
        if ready:
            self._ev.notify()

    # ---------------------------------------------------- passed through

    def get_store_event_fd(self) -> int:
        return self._in.get_store_event_fd()

    def get_load_event_fd(self) -> int:
        return self._in.get_load_event_fd()

    def submit_store_task(self, keys, objects) -> int:
        tid = self._in.submit_store_task(keys, objects)
        with self._lock:
            self._started[("store", tid)] = time.monotonic()
        return tid

    def pop_completed_store_tasks(self):
        done = self._in.pop_completed_store_tasks()
        with self._lock:
            for tid in done:
                self._started.pop(("store", tid), None)
        return done

    def submit_load_task(self, keys, objects) -> int:
        tid = self._in.submit_load_task(keys, objects)
        with self._lock:
            self._started[("load", tid)] = time.monotonic()
        return tid

    def query_load_result(self, task_id: int):
        bm = self._in.query_load_result(task_id)
        if bm is not None:
            with self._lock:
                self._started.pop(("load", task_id), None)
        return bm

    def submit_unlock(self, keys) -> None:
        self._in.submit_unlock(keys)

    def delete(self, keys) -> None:
        self._in.delete(keys)

    def list_l2_keys(self, *args, **kwargs):
        return self._in.list_l2_keys(*args, **kwargs)

    def get_usage(self):
        return self._in.get_usage()

    def register_listener(self, listener) -> None:
        self._in.register_listener(listener)

    def set_backend_identity(self, *args, **kwargs) -> None:
        super().set_backend_identity(*args, **kwargs)
        self._in.set_backend_identity(*args, **kwargs)

    @property
    def supports_global_eviction(self) -> bool:
        return self._in.supports_global_eviction

    # ------------------------------------------------------------ state

    def report_status(self) -> dict:
        now = time.monotonic()
        with self._lock:
            overdue_lookups = sum(t.result is None and now > t.deadline for t in self._lookups.values())
            unanswered = len(self._abandoned)
            overdue = sum(now - t > self._deadline for t in self._started.values())
            late = self._late_lookups
        try:
            inner = self._in.report_status()
        except Exception as e:
            inner = {"is_healthy": False, "error": repr(e)}
        healthy = bool(inner.get("is_healthy", False)) and not (unanswered or overdue or overdue_lookups)
        return {"is_healthy": healthy, "inner": inner, "lookups_answered_at_deadline": late,
                "lookups_still_unanswered": unanswered, "stores_and_loads_past_deadline": overdue,
                "lookup_deadline_ms": int(self._deadline * 1000)}

    def close(self) -> None:
        self._closed.set()
        self._watch.join(timeout=5)
        self._in.close()
        self._ev.close()
