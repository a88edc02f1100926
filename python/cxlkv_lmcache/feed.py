"""Keeps LMCache's byte accounting exact: follows the sidecar's log of removed
keys (evictions, deletes by anyone) and notices sidecar restarts."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import grpc

from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.link import Link
from cxlkv_lmcache.state import Ledger, Stored

log = logging.getLogger("cxlkv_lmcache")

PAGE = 5000  # removals asked for per call; a full page means more are waiting


class RemovalFeed:
    """Polls the removal log every `interval_s` (or sooner, see `poll_soon`)
    and takes what it lists out of `ledger`, reporting those keys through
    `on_deleted`. A new sidecar instance calls `on_restart` (the adapter drops
    what the old one handed out), then every stored key is checked again."""

    def __init__(self, link: Link, ledger: Ledger, on_restart: Callable[[], None],
                 on_deleted: Callable[[list[Stored]], None], interval_s: float, closed: threading.Event):
        self._link = link
        self._ledger = ledger
        self._on_restart = on_restart
        self._on_deleted = on_deleted
        self._interval = interval_s
        self._closed = closed
        self._wake = threading.Event()

    def poll_soon(self) -> None:
        """Poll now rather than at the next interval (and see `closed`)."""
        self._wake.set()

    def run(self) -> None:
        """The poller thread's body; returns once `closed` is set."""
        while True:
            self._wake.wait(self._interval)  # or sooner, when the health watch asks
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self.poll_once()
            except grpc.RpcError as e:
                self._link.rpc_failed(e)
            except Exception:
                log.exception("cxlkv poll failed")

    def poll_once(self) -> None:
        link = self._link
        c = link.conn
        if c.info is None:
            c = link.connect(time.monotonic() + 1.0)
        while True:
            mark = link.health_mark()
            rep = link.stub.Removed(pb.RemovedRequest(since=c.removed_seq, max=PAGE), timeout=2.0)
            if rep.instance_id != c.instance:
                log.warning("cxlkv sidecar restarted; dropping held locations and rechecking stored keys")
                self._on_restart()
                self.resync()
                link.connect(time.monotonic() + 1.0)  # the new instance, at once
                return
            link.mark_healthy(mark)
            gone = self._ledger.removed([(r.key, r.seq) for r in rep.keys])
            c.removed_seq = rep.next
            if gone:
                self._on_deleted(gone)
            if rep.truncated:
                self.resync()
            if len(rep.keys) < PAGE:
                return

    def resync(self) -> None:
        """Re-check every key we account for; report the ones that are gone."""
        mine = self._ledger.snapshot()
        for i in range(0, len(mine), 4096):
            part = mine[i : i + 4096]
            rep = self._link.stub.Exists(pb.ExistsRequest(keys=[k for k, _ in part]), timeout=5.0)
            gone = self._ledger.missing(list(zip(part, rep.exists)))
            if gone:
                self._on_deleted(gone)
