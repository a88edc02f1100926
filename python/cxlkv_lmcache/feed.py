"""Keeps LMCache's byte accounting exact: follows the sidecar's log of removed
keys (evictions, deletes by anyone) and notices sidecar restarts."""

from __future__ import annotations

import logging
import time

import grpc

from cxlkv_lmcache._proto import cxlkv_pb2 as pb

log = logging.getLogger("cxlkv_lmcache")


class RemovalFeed:
    def _poller(self) -> None:
        interval = self._cfg.poll_interval_ms / 1000
        while True:
            self._poll_now.wait(interval)  # or sooner, when the health watch asks
            self._poll_now.clear()
            if self._closed.is_set():
                return
            try:
                self._poll_once()
            except grpc.RpcError as e:
                self._rpc_failed(e)
            except Exception:
                log.exception("cxlkv poll failed")

    def _poll_once(self) -> None:
        c = self._conn
        if c.info is None:
            c = self._connect(time.monotonic() + 1.0)
        while True:
            rep = self._stub.Removed(pb.RemovedRequest(since=c.removed_seq, max=5000), timeout=2.0)
            if rep.instance_id != c.instance:
                log.warning("cxlkv sidecar restarted; dropping held locations and rechecking stored keys")
                self._restarted()
                self._resync()
                self._connect(time.monotonic() + 1.0)  # the new instance, at once
                return
            c.healthy = True
            gone = []
            with self._lock:
                for r in rep.keys:
                    s = self._stored.get(r.key)
                    # A removal logged before our commit is of an older incarnation.
                    if s is not None and r.seq >= s.seq:
                        gone.append(self._stored.pop(r.key))
            c.removed_seq = rep.next
            if gone:
                self._notify_keys_deleted([g.key for g in gone], [g.size for g in gone])
            if rep.truncated:
                self._resync()
            if len(rep.keys) < 5000:
                return

    def _resync(self) -> None:
        """Re-check every key we account for; report the ones that are gone."""
        with self._lock:
            mine = list(self._stored.items())
        for i in range(0, len(mine), 4096):
            part = mine[i : i + 4096]
            rep = self._stub.Exists(pb.ExistsRequest(keys=[k for k, _ in part]), timeout=5.0)
            gone = []
            with self._lock:
                for (k, s), ex in zip(part, rep.exists):
                    if not ex and self._stored.get(k) is s:
                        gone.append(self._stored.pop(k))
            if gone:
                self._notify_keys_deleted([g.key for g in gone], [g.size for g in gone])
