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

The stream is opened with wait_for_ready, for the same thread: while the
sidecar is away (restarted, or rebinding its socket for a new election term)
every other call fails at once, so without one waiting call nothing polls the
channel and its reconnect stalls until grpc-core's backup poller runs (every
5 s): misses for seconds after the sidecar serves again.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable

import grpc

if TYPE_CHECKING:  # a type only: serving_status (the test kit's readiness check) needs no LMCache
    from cxlkv_lmcache.link import Link

log = logging.getLogger("cxlkv_lmcache")

WATCH = "/grpc.health.v1.Health/Watch"
SERVING = 1


def serving_status(msg: bytes) -> int:
    """`HealthCheckResponse.status` (field 1, a one-byte varint); absent = 0."""
    return msg[1] if len(msg) >= 2 and msg[0] == 0x08 else 0


class HealthWatch:
    """Holds the Watch stream open while the adapter runs: `serving` follows
    the sidecar's status, each update asks for a poll (`poll_soon`), and a
    broken stream marks the link unhealthy."""

    def __init__(self, link: Link, poll_soon: Callable[[], None], closed: threading.Event):
        self.serving = True  # until the sidecar says otherwise
        self._link = link
        self._poll_soon = poll_soon
        self._closed = closed
        self._call = None
        self._lock = threading.Lock()
        self._rpc = link.channel.unary_stream(WATCH)

    def run(self) -> None:
        """The watcher thread's body; returns once `closed` is set."""
        backoff = 0.05
        while not self._closed.is_set():
            with self._lock:
                if self._closed.is_set():
                    return
                # Overall status (service ""): the request's only field is empty.
                # wait_for_ready: while the sidecar is away the call waits for
                # the channel instead of failing at once (see the module doc).
                call = self._call = self._rpc(b"", wait_for_ready=True)
            try:
                for msg in call:
                    status = serving_status(msg)
                    self.serving = status == SERVING
                    if not self.serving:
                        # Draining: an open stream would hold the sidecar's
                        # shutdown until its grace period ends.
                        log.warning("cxlkv sidecar is not serving (status %d)", status)
                        call.cancel()
                        break
                    # Catch up (a restart?) now, not at the next poll; a
                    # successful poll is also what marks the adapter healthy.
                    self._poll_soon()
                    backoff = 0.05
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                if e.code() != grpc.StatusCode.CANCELLED:  # the stream broke: the sidecar is gone
                    self._link.rpc_failed(e)
                    self._link.mark_unhealthy()
            self._closed.wait(backoff)
            backoff = min(1.0, backoff * 2)

    def close(self) -> None:
        """Cancel the open stream (after `closed` is set, so none opens again)."""
        with self._lock:
            if self._call is not None:
                self._call.cancel()
