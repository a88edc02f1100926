"""Unlocks of the keys a lookup locked, once LMCache releases them.

An unlock is sent at once and asynchronously (LMCache's `submit_unlock`
must not wait on the sidecar); one that fails goes to a retry queue that one
thread works through until the unlock's give-up time, after which the
sidecar's lock TTL releases the keys. The queue lives in the link's `Conn`
(it survives reconnects; a sidecar restart clears it: the new instance holds
no locks)."""

from __future__ import annotations

import collections
import logging
import threading
import time

import grpc

from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.link import Link
from cxlkv_lmcache.state import rpc_error

log = logging.getLogger("cxlkv_lmcache")


def _drop_head(q: collections.deque, item) -> None:
    """Pop `item` off `q` unless a sidecar restart cleared it meanwhile:
    popping then would raise and end the retry thread."""
    try:
        if q[0] is item:
            q.popleft()
    except IndexError:
        pass


class Unlocks:
    def __init__(self, link: Link, retry_s: float, closed: threading.Event):
        self._link = link
        self._retry_s = retry_s
        self._closed = closed
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._in_flight = 0
        self._wake = threading.Event()

    def pending(self) -> int:
        """Unlocks not yet acknowledged: queued for a retry or on the wire."""
        return len(self._link.conn.unlock_q) + self._in_flight

    def in_flight(self) -> int:
        """Unlocks sent and not answered yet."""
        return self._in_flight

    def settle(self, timeout: float) -> bool:
        """Wait until every unlock on the wire now was answered (at most
        `timeout` seconds); whether none is left on it. Queued retries are
        not waited for: the sidecar failed them once, and they land when the
        retry thread gets them through."""
        with self._settled:
            return self._settled.wait_for(lambda: self._in_flight == 0, timeout)

    def send(self, keys: list[bytes]) -> None:
        """Send an unlock now, asynchronously; failures go to the retry queue."""
        give_up = time.monotonic() + self._retry_s
        fut = None
        with self._lock:  # the check and the call as one step: `quiesce` waits for it
            if not self._closed.is_set():
                try:
                    fut = self._link.stub.Unlock.future(pb.UnlockRequest(keys=keys), timeout=2.0)
                    self._in_flight += 1
                except Exception:
                    fut = None
        if fut is None:
            self.retry(give_up, keys)
            return
        fut.add_done_callback(lambda f: self._done(f, keys, give_up))

    def quiesce(self) -> None:
        """Once `closed` is set, wait for a send that passed its check to
        have started its call: the channel may close only after that (an
        asynchronous call started on a closed channel with interceptors, as a
        durable session's is, crashes grpc-python instead of raising)."""
        with self._lock:
            pass

    def _done(self, fut, keys: list[bytes], give_up: float) -> None:
        err = fut.exception()
        if err is not None:
            if isinstance(err, grpc.RpcError):
                self._link.rpc_failed(err)
            self.retry(give_up, keys)
        with self._lock:
            self._in_flight -= 1
            self._settled.notify_all()

    def retry(self, give_up: float, keys: list[bytes]) -> None:
        self._link.conn.unlock_q.append((give_up, keys))
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def run(self) -> None:
        """The retry thread. Sleeps while there is nothing to retry: idle
        wake-ups of background threads cost the lookup path its tail latency
        (GIL, and two vCPUs on the reference VM)."""
        q = self._link.conn.unlock_q
        while not self._closed.is_set():
            self._wake.wait(0.1 if q else 1.0)
            self._wake.clear()
            if self._closed.is_set():
                break
            self.flush(q)
        deadline = time.monotonic() + 2
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.005)
        self.flush(q, final=True)

    def flush(self, q: collections.deque, final: bool = False) -> None:
        while True:
            try:
                head = q[0]
            except IndexError:  # empty, or emptied by a sidecar restart since the last look
                return
            give_up, ks = head
            try:
                self._link.stub.Unlock(pb.UnlockRequest(keys=ks), timeout=1.0)
                _drop_head(q, head)
            except grpc.RpcError as e:
                self._link.rpc_failed(e)
                if final or time.monotonic() > give_up:
                    _drop_head(q, head)
                    log.warning("cxlkv gave up unlocking %d keys (%s); their lock TTL will release them",
                                len(ks), rpc_error(e))
                else:
                    time.sleep(0.1)
                return
