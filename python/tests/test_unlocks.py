"""Unlocks and the channel's close: an unlock whose send passed its check
before the client closed has started its call before the channel closes
(an asynchronous call started on a closed channel with interceptors, as a
durable session's is, crashes grpc-python), and one sent after is queued,
never started."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
import types

from cxlkv_lmcache.unlocks import Unlocks


class Wire:
    """A stub whose Unlock.future takes `slow` seconds to start its call and
    records whether the channel was closed when it did."""

    def __init__(self, slow: float):
        self.slow, self.closed, self.started = slow, False, []
        self.Unlock = types.SimpleNamespace(future=self.future)

    def future(self, req, timeout=None):
        time.sleep(self.slow)
        self.started.append(self.closed)
        fut = concurrent.futures.Future()
        fut.set_result(None)
        return fut


def link(wire: Wire):
    return types.SimpleNamespace(stub=wire, conn=types.SimpleNamespace(unlock_q=collections.deque()),
                                 rpc_failed=lambda e: None)


def test_the_channel_closes_only_after_a_send_under_way_started_its_call():
    wire, closed = Wire(slow=0.3), threading.Event()
    u = Unlocks(link(wire), retry_s=5, closed=closed)
    sender = threading.Thread(target=u.send, args=([b"k"],))
    sender.start()
    time.sleep(0.05)  # the send passed its check and is starting its call
    closed.set()
    u.quiesce()
    wire.closed = True  # what Link.close does next
    sender.join(timeout=5)
    assert wire.started == [False], "an unlock's call started on a closed channel"
    assert u.in_flight() == 0


def test_an_unlock_sent_after_close_is_queued_never_started():
    wire, closed = Wire(slow=0), threading.Event()
    lk = link(wire)
    u = Unlocks(lk, retry_s=5, closed=closed)
    closed.set()
    u.quiesce()
    wire.closed = True
    u.send([b"k"])
    assert wire.started == []
    assert [keys for _, keys in lk.conn.unlock_q] == [[b"k"]]
