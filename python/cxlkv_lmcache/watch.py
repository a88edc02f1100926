"""Follows the sidecar's serving status over one open `grpc.health.v1` Watch
stream.

Two reasons to keep it open:
- the adapter learns at once that the sidecar is draining (SIGTERM) or gone,
  instead of at the next poll, and a fresh stream triggers a poll, so a
  restarted sidecar is noticed at once too;
- grpc-python runs asynchronous calls through a channel thread that exits
  whenever no call is open, so on an idle channel every lookup or unlock
  future started a new thread before it was sent (~50 us on the reference VM;
  docs/BENCHMARKS.md). The open stream keeps that thread alive.
"""

from __future__ import annotations

import logging
import threading

import grpc

log = logging.getLogger("cxlkv_lmcache")

WATCH = "/grpc.health.v1.Health/Watch"
SERVING = 1


def serving_status(msg: bytes) -> int:
    """`HealthCheckResponse.status` (field 1, a one-byte varint); absent = 0."""
    return msg[1] if len(msg) >= 2 and msg[0] == 0x08 else 0


class HealthWatch:
    def _init_watch(self) -> None:
        self._serving = True  # until the sidecar says otherwise
        self._watch_call = None
        self._watch_lock = threading.Lock()
        self._poll_now = threading.Event()
        self._watch_rpc = self._channel.unary_stream(WATCH)

    def _watcher(self) -> None:
        backoff = 0.05
        while not self._closed.is_set():
            with self._watch_lock:
                if self._closed.is_set():
                    return
                # Overall status (service ""): the request's only field is empty.
                call = self._watch_call = self._watch_rpc(b"")
            try:
                for msg in call:
                    status = serving_status(msg)
                    self._serving = status == SERVING
                    if not self._serving:
                        # Draining: an open stream would hold the sidecar's
                        # shutdown until its grace period ends.
                        log.warning("cxlkv sidecar is not serving (status %d)", status)
                        call.cancel()
                        break
                    # Catch up (a restart?) now, not at the next poll; a
                    # successful poll is also what marks the adapter healthy.
                    self._poll_now.set()
                    backoff = 0.05
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                if e.code() != grpc.StatusCode.CANCELLED:  # the stream broke: the sidecar is gone
                    self._rpc_failed(e)
                    self._conn.healthy = False
            self._closed.wait(backoff)
            backoff = min(1.0, backoff * 2)

    def _close_watch(self) -> None:
        with self._watch_lock:
            if self._watch_call is not None:
                self._watch_call.cancel()
