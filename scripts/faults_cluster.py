"""The fault scenarios of several sidecars on one pool (run through
`scripts/faults.py`): `cluster` (a static primary and two followers, clients
reading across nodes while they evict) and `failover` (the primary elected
through a real etcd, killed with -9, the next one stopped with SIGSTOP, all
under the same load)."""

from __future__ import annotations

import json
import pathlib
import signal
import socket
import subprocess
import time

from faultkit import (Sidecar, Stats, back_to_baseline, build, collect_soakers, free_port, log, plugin,
                      round_trip, start_soakers, status, verdict)

CLUSTER_TIMINGS = "[cluster]\nheartbeat_ms = 100\nlease_ms = 600\ndead_after_ms = 1000\nforward_timeout_ms = 500\n"


def s_cluster(tmp: pathlib.Path, args) -> bool:
    """Three nodes on one pool small enough to evict (a the primary, b and c
    followers that hold what their clients read): clients on every node store
    their own keys and read everyone's, so most hits are bytes another node
    wrote, many answered from a follower's holds while that node's stores
    evict (FIFO, so only a lock keeps a just-read entry; readers pause up to
    50 ms between lookup and load). Store failures (a node whose every entry some reader holds) are
    counted, not errors; wrong bytes, a hit that does not load, hangs and a
    primary left with locks or reservations fail it."""
    cfg = tmp / "cluster.toml"
    cfg.write_text(CLUSTER_TIMINGS)
    peer = f"127.0.0.1:{free_port()}"
    nodes = {}
    try:
        for name, role in (("a", ("--peer-addr", peer)), ("b", ("--primary-addr", peer)),
                           ("c", ("--primary-addr", peer))):
            # FIFO: a read does not save an entry from eviction, only its lock
            # (here mostly a follower's hold) does.
            nodes[name] = Sidecar(tmp, name, pool_size="16MiB",
                                  extra=("--config", str(cfg), "--node-name", name, "--primary", "a",
                                         "--eviction-policy", "fifo", *role))
            nodes[name].start()
        base = status(nodes["a"].socket)
        kids = start_soakers([nodes[n].socket for n in "abc"], args, readers_of=args.clients)
        # What the followers hold, sampled through the run (it must exercise
        # holds): the most each held at once.
        held_max = {"a": 0, "b": 0, "c": 0}
        end = time.monotonic() + args.seconds * 0.9
        while time.monotonic() < end:
            for n in status(nodes["a"].socket)["cluster_nodes"]:
                held_max[n["name"]] = max(held_max[n["name"]], n["held_keys"])
            time.sleep(0.25)
        stats, ops = collect_soakers(kids, args)
        st = status(nodes["a"].socket)
        evictions, held = st["evictions"], {n["name"]: n["held_keys"] for n in st["cluster_nodes"]}
        # A locked hit is never evicted before its unlock, through a
        # follower's hold as at the primary: every hit loads.
        if evictions == 0 or held_max["b"] + held_max["c"] == 0 or stats.c["misses"]:
            stats.add(errors=1)
        # The followers give their holds back once idle; then nothing is
        # locked or reserved, and every key deletes.
        ok, left = back_to_baseline(nodes["a"].socket, base, 15, pages=False)
        return verdict("cluster", stats, ok, left, f"clients={args.clients} seconds={args.seconds:.0f} ops={ops} "
                       f"evictions={evictions} held_keys_max={json.dumps(held_max)} held_keys_end={json.dumps(held)}")
    finally:
        for n in reversed(list(nodes.values())):
            n.kill()



ETCD = "/usr/bin/etcd"
# etcd's lease floor is 2 s; a node's own lease lapses after 2/3 of it.
ETCD_TIMINGS = ('[cluster]\nelection = "etcd"\netcd_endpoints = ["{endpoint}"]\nheartbeat_ms = 100\n'
                'lease_ms = 2000\ndead_after_ms = 3000\nforward_timeout_ms = 1000\n')


def start_etcd(tmp: pathlib.Path) -> tuple[subprocess.Popen, str]:
    """A one-member etcd on loopback ports; its client endpoint."""
    client, peer = free_port(), free_port()
    url = "http://127.0.0.1:{}".format
    p = subprocess.Popen([ETCD, "--name", "f", "--data-dir", str(tmp / "etcd"),
                          "--listen-client-urls", url(client), "--advertise-client-urls", url(client),
                          "--listen-peer-urls", url(peer), "--initial-advertise-peer-urls", url(peer),
                          "--initial-cluster", f"f={url(peer)}", "--log-level", "warn"],
                         stdout=subprocess.DEVNULL, stderr=open(tmp / "etcd.log", "wb"))
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", client), timeout=0.5).close()
            return p, f"127.0.0.1:{client}"
        except OSError:
            if p.poll() is not None or time.monotonic() > deadline:
                p.kill()
                raise RuntimeError(f"etcd did not come up: {(tmp / 'etcd.log').read_text()}")
            time.sleep(0.05)


def role(sc: Sidecar) -> tuple[str, int] | None:
    """(role, epoch) as the node says, or None while it does not answer."""
    try:
        s = status(sc.socket)
    except Exception:  # noqa: BLE001 - stopped, restarting, or binding its socket anew
        return None
    return s["cluster_role"], s["epoch"]


def elected(nodes: dict[str, Sidecar], after: int, timeout: float, among=None) -> tuple[str, int]:
    """The node that leads an epoch later than `after` (within `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in among or nodes:
            r = role(nodes[name])
            if r and r[0] == "primary" and r[1] > after:
                return name, r[1]
        time.sleep(0.1)
    raise RuntimeError(f"no primary of an epoch after {after} within {timeout} s")


def s_failover(tmp: pathlib.Path, args) -> bool:
    """Three nodes elect their primary through a real etcd; clients on every
    node store their own keys and read everyone's (as in `cluster`) while the
    primary is killed with -9 (and started again), then the next primary is
    stopped with SIGSTOP until another leads (and resumed). Lookups that fail
    or hits that no longer load during a takeover are misses, not errors;
    wrong bytes, a task past its deadline, an exception out of the adapter,
    a node that serves no checked hit afterwards, or a primary left with
    locks or reservations fail it."""
    seconds = max(args.seconds, 24.0)  # two takeovers of ~2-3 s each, with load before, between and after
    etcd, endpoint = start_etcd(tmp)
    nodes: dict[str, Sidecar] = {}
    try:
        for name in "abc":
            cfg = tmp / f"{name}.toml"
            cfg.write_text(ETCD_TIMINGS.format(endpoint=endpoint))
            nodes[name] = Sidecar(tmp, name, pool_size="16MiB",
                                  extra=("--config", str(cfg), "--node-name", name,
                                         "--peer-addr", f"127.0.0.1:{free_port()}"))
            nodes[name].start()
        first, epoch = elected(nodes, 0, 20)
        kids = start_soakers([nodes[n].socket for n in "abc"], args, readers_of=args.clients)
        t0 = time.monotonic()
        time.sleep(seconds * 0.25)
        log(f"kill -9 of the primary {first} (epoch {epoch}) under load")
        nodes[first].kill()
        second, epoch2 = elected(nodes, epoch, 15, among=[n for n in nodes if n != first])
        log(f"{second} leads epoch {epoch2} {time.monotonic() - t0 - seconds * 0.25:.1f} s after the kill")
        nodes[first].start()  # back as a follower, on the same pool
        time.sleep(max(0.0, t0 + seconds * 0.55 - time.monotonic()))
        log(f"SIGSTOP of the primary {second} under load")
        nodes[second].signal(signal.SIGSTOP)
        try:
            third, epoch3 = elected(nodes, epoch2, 15, among=[n for n in nodes if n != second])
            log(f"{third} leads epoch {epoch3}")
        finally:
            nodes[second].signal(signal.SIGCONT)
        stats, ops = collect_soakers(kids, args)
        # Afterwards every node serves again, checked byte for byte. A new
        # primary evicts and deletes nothing until the holds its predecessor
        # granted have lapsed (about a second, UNAVAILABLE meanwhile), so a
        # node's round trips go on until one hits, within 10 s.
        after = Stats()
        for n, sc in nodes.items():
            got = after.c["hits"]
            a = build(plugin(sc.socket))
            until, r = time.monotonic() + 10, 0
            while r < 3 or (after.c["hits"] == got and time.monotonic() < until):
                round_trip(a, 800_000 + 1000 * ord(n) + r, 4, 4, after)
                r += 1
            a.close()
            if after.c["hits"] == got:
                log(f"no checked hit through {n} after the takeovers")
                stats.add(errors=1)
        stats.merge({k: v for k, v in after.c.items()})
        # Nothing locked or reserved at the last primary once holds are
        # idle; every key deletes (pages are not compared: the takeovers
        # keep pages of objects being written quarantined for a while).
        ok, left = back_to_baseline(nodes[third].socket, {}, 20, pages=False)
        return verdict("failover", stats, ok, left, f"clients={args.clients} seconds={seconds:.0f} ops={ops} "
                       f"primaries={first}>{second}>{third} epochs={epoch}>{epoch2}>{epoch3}")
    finally:
        for n in reversed(list(nodes.values())):
            n.kill()
        etcd.kill()
        etcd.wait()
