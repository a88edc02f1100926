"""The adapter's open health-watch stream: failures, drains and restarts of the
sidecar reach it without polling, and asynchronous calls do not pay for a new
grpc thread each."""

from __future__ import annotations

import os
import signal
import threading
import time

from cxlkv_testkit import make_adapter, wait_for
from cxlkv_testkit.l2 import bits, key, lookup, obj, store


def healthy(a) -> bool:
    return a.report_status()["is_healthy"]


def test_a_killed_and_restarted_sidecar_is_noticed_without_polling(sidecar):
    # No poll is due for a minute: only the watch stream can tell.
    a = make_adapter(sidecar.socket, poll_interval_ms=60_000)
    try:
        assert store(a, [key(1)], [obj(8192)]).is_successful()
        assert a.get_usage().total_bytes_used == 8192
        sidecar.kill()
        assert wait_for(lambda: not healthy(a), timeout=3)
        # Back on a new, empty pool (keys survive a plain restart).
        os.unlink(sidecar.pool)
        sidecar.start()
        assert wait_for(lambda: healthy(a), timeout=5)
        # The new stream triggered a poll, which found the restart: the key
        # died with the erased pool and leaves LMCache's accounting.
        assert wait_for(lambda: a.get_usage().total_bytes_used == 0, timeout=5)
    finally:
        a.close()


def test_a_poll_answered_as_the_stream_broke_does_not_mark_a_dead_sidecar_healthy(sidecar):
    # CI's race: a poll's answer was on its way when the sidecar was killed,
    # and arrived after the health watch had marked the adapter unhealthy.
    a = make_adapter(sidecar.socket, poll_interval_ms=60_000)
    try:
        assert wait_for(lambda: healthy(a), timeout=5)
        link = a._core.link
        removed = link.stub.Removed
        me, checked = threading.current_thread(), threading.Event()

        def answered_then_broke(*args, **kwargs):
            if threading.current_thread() is not me:
                checked.wait(5)  # the adapter's own poller (a live sidecar's answer) waits for the check
                return removed(*args, **kwargs)
            reply = removed(*args, **kwargs)  # the real call, answered
            link.mark_unhealthy()  # what the watch does when its stream breaks
            return reply

        link.stub.Removed = answered_then_broke
        a._core.feed.poll_once()
        assert not healthy(a)
        checked.set()
        link.stub.Removed = removed
        a._core.feed.poll_once()  # a poll that starts after the failure does count
        assert healthy(a)
    finally:
        a.close()


def test_a_draining_sidecar_is_noticed_and_its_drain_not_held_up(sidecar):
    a = make_adapter(sidecar.socket, poll_interval_ms=60_000)
    try:
        assert wait_for(lambda: healthy(a), timeout=5)
        t = time.monotonic()
        sidecar.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: not healthy(a), timeout=3)
        # The default drain grace is 10 s: an open stream would hold it that long.
        assert sidecar.proc.wait(timeout=8) == 0
        assert time.monotonic() - t < 5
    finally:
        a.close()


def test_asynchronous_calls_on_an_idle_channel_start_no_thread(sidecar, monkeypatch):
    a = make_adapter(sidecar.socket)
    try:
        assert store(a, [key(0)], [obj(4096)]).is_successful()
        assert wait_for(lambda: healthy(a), timeout=5)
        started = []
        start = threading.Thread.start

        def counting_start(self, *args, **kwargs):
            started.append(self.name)
            return start(self, *args, **kwargs)

        monkeypatch.setattr(threading.Thread, "start", counting_start)
        for _ in range(20):
            assert bits(lookup(a, [key(0)]), 1) == [True]  # an asynchronous LookupAndLock
            a.submit_unlock([key(0)])  # an asynchronous Unlock
            time.sleep(0.005)  # the channel goes idle between calls
        assert started == []
    finally:
        a.close()
