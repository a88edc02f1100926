"""A store batch's Commit riding on the next store's Reserve (handoff.py)."""

from __future__ import annotations

import itertools
import threading

import torch

from cxlkv_testkit import make_adapter

from cxlkv_testkit.l2 import bits, key, load, lookup, obj, store, wait_fd


def test_a_commit_rides_on_a_running_stores_reserve(sidecar):
    """Two store tasks in flight: the first to finish hands its Commit to the
    other's Reserve; both succeed only once committed, and the bytes are the
    ones written."""
    a = make_adapter(sidecar.socket, workers=2, commit_ride_ms=10_000)
    reader = make_adapter(sidecar.socket)
    h = a._handoff
    both_running, offered = threading.Event(), threading.Event()
    reserving, offer, take = h.reserving, h.offer, h.take
    n_reserving, n_take = itertools.count(1), itertools.count()

    def reserving_():
        reserving()
        if next(n_reserving) == 2:
            both_running.set()

    def offer_(ids, crcs):  # offer only once the other task will reserve
        assert both_running.wait(10)
        ride = offer(ids, crcs)
        if ride is not None:
            offered.set()
        return ride

    def take_(with_crc):  # the second Reserve waits for the first batch's offer
        if next(n_take) == 1:
            assert offered.wait(10)
        return take(with_crc)

    h.reserving, h.offer, h.take = reserving_, offer_, take_
    try:
        keys = [[key(i * 10 + j) for j in range(3)] for i in range(2)]
        objs = [[obj(4096 + 100 * j, seed=i * 10 + j) for j in range(3)] for i in range(2)]
        tids = [a.submit_store_task(k, o) for k, o in zip(keys, objs)]
        results = {}
        while len(results) < 2:
            wait_fd(a.get_store_event_fd(), 0.5)
            results |= a.pop_completed_store_tasks()
        assert all(results[t].is_successful() for t in tids)
        assert h.carried == 3, "the first batch's three ids were committed by the second Reserve"
        flat_k, flat_o = [k for ks in keys for k in ks], [o for os_ in objs for o in os_]
        assert bits(lookup(reader, flat_k), 6) == [True] * 6
        outs = [obj(o.get_size(), seed=99) for o in flat_o]
        assert bits(load(reader, flat_k, outs), 6) == [True] * 6
        for want, got in zip(flat_o, outs):
            assert torch.equal(got.tensor, want.tensor)
    finally:
        a.close()
        reader.close()


def test_a_lone_store_commits_at_once(sidecar):
    a = make_adapter(sidecar.socket, commit_ride_ms=10_000)
    try:
        r = store(a, [key(1)], [obj(5000)], timeout=5)  # far below the 10 s ride: nothing waited for
        assert r.is_successful() and a._handoff.carried == 0
    finally:
        a.close()


def test_pipelined_stores_never_expose_a_key_before_its_bytes(sidecar):
    """Many store tasks in flight (commits riding on each other's Reserves)
    while another process-like adapter polls lookups and loads: every key it
    finds holds exactly the bytes written, and all keys end up stored."""
    a = make_adapter(sidecar.socket, workers=4)
    reader = make_adapter(sidecar.socket)
    n_tasks, per = 24, 4
    keys = [key(1000 + i) for i in range(n_tasks * per)]
    objs = [obj((64 << 10) + 7 * i, seed=i) for i in range(len(keys))]
    stop, bad, seen = threading.Event(), [], set()

    def poll():
        while not stop.is_set():
            hits = bits(lookup(reader, keys), len(keys))
            found = [i for i, h in enumerate(hits) if h]
            if not found:
                continue
            outs = [obj(objs[i].get_size(), seed=7) for i in found]
            got = bits(load(reader, [keys[i] for i in found], outs), len(found))
            reader.submit_unlock([keys[i] for i in found])
            for i, ok, out in zip(found, got, outs):
                if ok:
                    seen.add(i)
                    if not torch.equal(out.tensor, objs[i].tensor):
                        bad.append(i)

    t = threading.Thread(target=poll)
    t.start()
    try:
        tids = [a.submit_store_task(keys[i * per:(i + 1) * per], objs[i * per:(i + 1) * per]) for i in range(n_tasks)]
        results = {}
        while len(results) < n_tasks:
            wait_fd(a.get_store_event_fd(), 0.5)
            results |= a.pop_completed_store_tasks()
        assert all(results[x].is_successful() for x in tids)
    finally:
        stop.set()
        t.join()
        a.close()
    try:
        assert not bad, f"keys {bad} were visible with other bytes"
        assert bits(lookup(reader, keys), len(keys)) == [True] * len(keys)
        reader.submit_unlock(keys)
    finally:
        reader.close()
