"""The `cluster-chaos` fault scenario (run through `scripts/faults.py`):
three sidecars on one small pool (a the static primary, b and c followers;
every node's stores need regions of the others, so phase-3 reclaims churn),
client processes on every node that store, read and delete through the gRPC
API and their own mapping of the pool, and a driver that picks faults at
random:

- SIGSTOP of a follower for longer than `dead_after_ms`, started just after
  one of its slow writers reserved (the node is declared dead while that
  writer keeps copying into its reservation), then SIGCONT;
- kill -9 of a follower (also while its slow writer copies) and a restart,
  before or after it is declared dead; in both, once the node is dead, the
  driver stores batches bigger than a region through the other follower
  until the node is back, so that one needs a region and the dead node's
  may be the one left (it must stay fenced while that node's writers may
  still write);
- kill -9 of the primary a few ms after a burst of deletes (store v1
  through b, delete through c, store v2 of half the keys through c) and a
  restart with the same arguments; then reads of those keys through every
  node for 2 s;
- SIGSTOP of the primary for less than `lease_ms`, and for more (up to past
  `dead_after_ms`).

Clients (`scripts/chaos_client.py`, processes that import only grpc and the
plugin's generated stubs) store, read and delete, each read checked
against a ledger all of them share.

Every call carries a deadline (`deadline_unix_ms` where the API has one, and
the gRPC timeout); one that returns later than its deadline plus a margin is
counted. At the end every node must be ready and store and read back a fresh
key, every node alive at the primary, and the primary without reservations
or locks once the clients have stopped (within 20 s). VERDICT PASS needs
0 wrong bytes, 0 resurrected deletes, 0 calls past their deadline, 0 stuck
nodes, 0 errors (a client's exception, a Reserve refused as a whole with
RESOURCE_EXHAUSTED, a client write after its reservation expired) and the
primary idle. `--seed` repeats a sequence of faults (not their timing); on
a FAIL (or with CXLKV_CHAOS_KEEP=1) the sidecars' logs, the timeline of
faults and the evidence of each wrong read (key, location, whose bytes each
block held) are kept in a /tmp/cxlkv-chaos-<seed>-* directory.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

import grpc

from chaos_client import (BIG_BATCH, CALL_S, DRIVER, FILL, FIRST_WORKER, FRESH, KEYS, LOCK_TTL_MS, Book, Client,
                          Ledger, now_ms, size_of, whose)
from cxlkv_lmcache._proto import cxlkv_pb2 as pb

# Timings: a node is declared dead 2 s after its last heartbeat; a
# reservation lasts 6 s, so a dead node's writers have ~4 s left to copy.
LEASE_MS, DEAD_MS, RESERVATION_MS = 1000, 2000, 6000
# Followers give holds back 200 ms after their last read: with clients on
# every node reading everyone's keys, longer holds leave no region idle
# enough to be taken back (phase 3 skips regions with locks).
HOLD_IDLE_MS = 200
CHAOS_CONFIG = (f"[cluster]\nheartbeat_ms = 100\nlease_ms = {LEASE_MS}\ndead_after_ms = {DEAD_MS}\n"
                f"forward_timeout_ms = 1000\nhold_idle_ms = {HOLD_IDLE_MS}\n"
                f"[registry]\nreservation_timeout_ms = {RESERVATION_MS}\nlock_ttl_ms = {LOCK_TTL_MS}\n")
CLIENT = str(pathlib.Path(__file__).with_name("chaos_client.py"))
POOL = "10MiB"  # five 2 MiB regions for three nodes whose clients want ~4x that


# ---- the scenario (driver) ---------------------------------------------------------------

def stopped_all(pid: int) -> bool:
    """Every thread of `pid` has stopped (SIGSTOP is taken thread by thread)."""
    states = []
    for t in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append((t / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, IndexError):
            continue
    return bool(states) and all(s in ("T", "t") for s in states)


def primary_log_figures(text: str, reports: list[dict]) -> dict:
    """From the primary's log: phase-3 reclaims, nodes declared dead, and
    the slow stores whose writer was still copying into its reservation
    when its node was declared dead (the window of issue 33's defect 1)."""
    import re
    from datetime import datetime

    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    names = dict(re.findall(r"node joined node=(\d+) name=(\w+)", text))
    dead = [(datetime.fromisoformat(t).timestamp() * 1000, names.get(n, n))
            for t, n in re.findall(r"^(\S+Z)\s+WARN .*node declared dead.* node=(\d+)", text, re.M)]
    after = 0
    for r in reports:
        for reserved, last in r.get("slow_trace", []):
            after += any(name == r.get("via") and reserved < t < last for t, name in dead)
    return {"reclaims": text.count("region taken back region="), "declared_dead": len(dead),
            "slow_writes_past_dead": after}


def idle_primary(c: Client, timeout: float, event) -> tuple[bool, dict]:
    """Poll the primary's Stats until nothing is reserved or locked (up to
    `timeout` s), then delete every key (ListKeys + Delete, retried while
    some key is locked, up to 10 s more); the figures left."""
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        try:
            st = c.stub.Stats(pb.StatsRequest(), timeout=CALL_S)
            now = (st.reserved, st.locked_keys, sum(n.held_keys for n in st.cluster_nodes))
            if not seen or seen[-1][1] != now:
                seen.append((round(time.monotonic() - deadline + timeout, 1), now))
            if st.reserved == 0 and st.locked_keys == 0:
                break
        except grpc.RpcError as e:
            seen.append((round(time.monotonic() - deadline + timeout, 1), e.code().name))
        if time.monotonic() > deadline:
            event(f"the primary still has reservations or locks after {timeout:.0f} s: "
                  f"(s, (reserved, locked, held)): {seen}")
            break
        time.sleep(0.2)
    if len(seen) > 1:
        event(f"the primary's (reserved, locked, held) while it became idle: {seen}")
    deadline = time.monotonic() + 10
    refused: Counter = Counter()
    refused_keys: set[bytes] = set()
    while time.monotonic() < deadline:
        try:
            keys = [k.key for k in c.stub.ListKeys(pb.ListKeysRequest(page_size=1000), timeout=CALL_S).keys]
            if not keys:
                break
            for k, st in zip(keys, c.stub.Delete(pb.DeleteRequest(keys=keys), timeout=CALL_S).statuses):
                if st.code not in (0, 5):
                    refused[st.message] += 1
                    refused_keys.add(k)
        except grpc.RpcError as e:
            refused[e.code().name] += 1
        time.sleep(0.1)
    if refused:
        event(f"deletes refused at the end: {dict(refused.most_common(5))}; keys {sorted(refused_keys)[:20]}")
    st = c.stub.Stats(pb.StatsRequest(), timeout=CALL_S)
    left = {"locked_keys": st.locked_keys, "reserved": st.reserved, "keys": st.keys}
    return not any(left.values()), left


class Chaos:
    """One run of the scenario: the cluster, the client processes, the
    faults, the end checks and the verdict."""

    KINDS = ("follower-stop", "follower-kill", "primary-kill-after-deletes", "primary-stop-short",
             "primary-stop-long")

    def __init__(self, tmp: pathlib.Path, args):
        from faultkit import Sidecar, free_port

        self.tmp = tmp
        self.seed = args.seed if args.seed is not None else random.randrange(1 << 31)
        self.rng = random.Random(self.seed)
        self.seconds = max(args.seconds, 45.0)
        cfg = tmp / "cluster.toml"
        cfg.write_text(CHAOS_CONFIG)
        peer = f"127.0.0.1:{free_port()}"
        self.nodes = {name: Sidecar(tmp, name, pool_size=POOL,
                                    extra=("--config", str(cfg), "--node-name", name, "--primary", "a", *role))
                      for name, role in (("a", ("--peer-addr", peer)), ("b", ("--primary-addr", peer)),
                                         ("c", ("--primary-addr", peer)))}
        self.ledger = Ledger(str(tmp / "ledger"), create=True)
        self.kids: list[subprocess.Popen] = []
        self.slow_of: dict[str, int] = {}
        self.timeline: list[str] = []
        self.faults: Counter = Counter()
        self.t0 = time.monotonic()
        # The driver's own clients: DRIVER keys through every node (one
        # book), FILL keys through the followers (another), FRESH at the end.
        self.clients: dict[str, Client] = {}
        self.books = {DRIVER: Book(), FILL: Book(), FRESH: Book()}
        self.stuck_why: list[str] = []

    # -- helpers ----------------------------------------------------------------------

    def event(self, msg: str) -> None:
        from faultkit import log

        self.timeline.append(f"{time.monotonic() - self.t0:7.2f}s {msg}")
        log(msg)

    def client(self, name: str, proc: int = DRIVER) -> Client:
        """The driver's client of node `name` for keys of `proc`."""
        k = f"{proc}@{name}"
        if k not in self.clients:
            self.clients[k] = Client(self.nodes[name].socket, name, proc, self.ledger,
                                     self.seed * 7 + proc * 131 + ord(name), book=self.books[proc])
        return self.clients[k]

    def alive_all(self, timeout: float) -> bool:
        """Every node alive at the primary (within `timeout` s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                st = self.client("a").stub.Stats(pb.StatsRequest(), timeout=CALL_S)
                if {n.name for n in st.cluster_nodes if n.alive} >= set(self.nodes):
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        return False

    def settle(self, what: str) -> None:
        t = time.monotonic()
        if self.alive_all(30):
            self.event(f"all nodes alive {time.monotonic() - t:.1f} s after {what}")
        else:
            self.event(f"NOT all nodes alive 30 s after {what}")

    def sigstop(self, name: str) -> None:
        self.nodes[name].signal(signal.SIGSTOP)
        deadline = time.monotonic() + 2
        while not stopped_all(self.nodes[name].proc.pid) and time.monotonic() < deadline:
            time.sleep(0.001)

    def restart(self, name: str) -> None:
        try:
            self.nodes[name].start()
        except RuntimeError as e:
            self.event(f"{name} did not come back: {str(e)[-300:]}")

    def wait_slow_reserving(self, name: str) -> None:
        """Until `name`'s slow writer has just reserved (up to 8 s)."""
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            since = self.ledger.reserving_since(self.slow_of[name])
            if since and now_ms() - since < 400:
                return
            time.sleep(0.02)

    # -- the run ------------------------------------------------------------------------

    def start(self) -> None:
        for n in self.nodes.values():
            n.start()
        if not self.alive_all(30):
            raise RuntimeError("b and c did not join")
        # Per node: two clients storing and reading, one slow writer.
        procs = list(range(FIRST_WORKER, FIRST_WORKER + 3 * len(self.nodes)))
        for k, name in enumerate(self.nodes):
            for j, slow in enumerate((False, False, True)):
                proc = FIRST_WORKER + 3 * k + j
                if slow:
                    self.slow_of[name] = proc
                spec = {"socket": self.nodes[name].socket, "via": name, "proc": proc, "slow": slow,
                        "ledger": str(self.tmp / "ledger"), "seed": self.seed * 31 + proc,
                        "procs": [DRIVER, FILL, *procs]}
                self.kids.append(subprocess.Popen([sys.executable, CLIENT, "--child", json.dumps(spec)],
                                                  stdout=subprocess.PIPE, text=True,
                                                  stderr=open(self.tmp / f"client{proc}.err", "w")))
        for p in self.kids:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a client did not start")
        self.event(f"{len(self.kids)} clients running (slow writers: {self.slow_of})")
        time.sleep(3)

    def fill_while_down(self, name: str, until: float) -> None:
        """From when the other follower, stopped or killed, is declared dead
        until `until`: big stores through follower `name` (FILL keys), so it
        needs a region and the dead node's may be the one left (which must
        stay fenced while that node's writers may still write). Then those
        keys are deleted again (retried up to 5 s)."""
        f = self.client(name, FILL)
        time.sleep(max(0.0, min(until, time.monotonic() + DEAD_MS / 1000 + 0.2) - time.monotonic()))
        n = 0
        while time.monotonic() < until:
            idxs, size = [], 0
            for i in f.own_keys(("absent",), KEYS):
                if size > BIG_BATCH:
                    break
                idxs.append(i)
                size += size_of(FILL, i)
            if not idxs:
                break
            f.store(idxs)
            n += 1
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (left := f.own_keys(("present", "maybe"), KEYS)):
            f.delete(left)
        if n:
            self.event(f"{n} big stores through {name} while the other follower was down")

    def delete_burst_then_kill_primary(self) -> None:
        """Store v1 of 8 keys through b, delete them through c, store v2 of
        half of them through c, kill -9 the primary at once; restart it and
        read those keys through every node for 2 s."""
        cb, cc = self.client("b"), self.client("c")
        deadline = time.monotonic() + 5  # last burst's v2 keys: deleted first
        while time.monotonic() < deadline and (left := cc.own_keys(("present", "maybe"), KEYS)):
            cc.delete(left)
        idxs = cb.own_keys(("absent",), 8)
        if idxs:
            cb.store(idxs)
        stored = [i for i in idxs if cb.state[i][0] == "present"]
        deadline = time.monotonic() + 5  # a primary that just started refuses deletes for a lease
        while stored and time.monotonic() < deadline:
            cc.delete(stored)
            stored = [i for i in stored if cc.state[i][0] != "absent"]
        gone = [i for i in idxs if cc.state[i][0] == "absent"]
        again = gone[: len(gone) // 2]
        if again:
            cc.store(again)
        self.nodes["a"].kill()
        self.event(f"kill -9 of the primary right after deleting {len(gone)} keys through c "
                   f"(v2 of {sum(cc.state[i][0] == 'present' for i in again)} stored again through c)")
        self.restart("a")
        self.event("primary restarted")
        end = time.monotonic() + 2
        while time.monotonic() < end and idxs:
            for name in self.nodes:
                self.client(name).read([(DRIVER, i) for i in idxs])
            time.sleep(0.1)

    def fault(self, kind: str) -> None:
        rng, nodes = self.rng, self.nodes
        if kind == "follower-stop":
            name = rng.choice("bc")
            hold = DEAD_MS / 1000 + rng.uniform(0.5, 2.5)
            self.wait_slow_reserving(name)
            self.sigstop(name)
            t = time.monotonic()
            self.event(f"SIGSTOP of follower {name} for {hold:.1f} s (its slow writer copying)")
            self.fill_while_down("c" if name == "b" else "b", t + hold)
            nodes[name].signal(signal.SIGCONT)
            self.event(f"SIGCONT of {name}")
            self.settle(f"{name}'s stop")
        elif kind == "follower-kill":
            name = rng.choice("bc")
            down = rng.uniform(0.0, DEAD_MS / 1000 + 1.5)
            self.wait_slow_reserving(name)
            nodes[name].kill()
            t = time.monotonic()
            self.event(f"kill -9 of follower {name} (its slow writer copying), down {down:.1f} s")
            self.fill_while_down("c" if name == "b" else "b", t + down)
            self.restart(name)
            self.event(f"{name} restarted")
            self.settle(f"{name}'s restart")
        elif kind == "primary-kill-after-deletes":
            self.delete_burst_then_kill_primary()
            self.settle("the primary's restart")
        else:
            short = kind == "primary-stop-short"
            hold = LEASE_MS / 1000 * (rng.uniform(0.3, 0.8) if short else rng.uniform(1.3, 2.6))
            self.sigstop("a")
            self.event(f"SIGSTOP of the primary for {hold:.2f} s (lease {LEASE_MS} ms, dead after {DEAD_MS} ms)")
            time.sleep(hold)
            nodes["a"].signal(signal.SIGCONT)
            self.event("SIGCONT of the primary")
            self.settle("the primary's stop")

    def chaos(self) -> None:
        """Faults for `seconds`: each kind once per round, in random order."""
        order: list[str] = []
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            if not order:
                order = list(self.KINDS)
                self.rng.shuffle(order)
            kind = order.pop()
            self.faults[kind] += 1
            self.fault(kind)
            time.sleep(self.rng.uniform(1.0, 3.0))

    def stop_clients(self) -> list[dict]:
        self.ledger.stop()
        self.event("clients told to stop")
        reports = []
        for p in self.kids:
            out, _ = p.communicate(timeout=60)
            if p.returncode != 0 or not out.strip():
                reports.append({"counters": {"errors": 1}, "max_call_s": 0, "codes": {},
                                "evidence": [{"what": f"client exited {p.returncode}"}]})
            else:
                reports.append(json.loads(out.strip().splitlines()[-1]))
        for c in self.clients.values():
            reports.append(c.report())
            c.c.clear()
            c.codes.clear()
            c.evidence.clear()
        return reports

    def stuck_nodes(self) -> int:
        """Nodes that cannot store a fresh key and read it back (within 30 s
        each), and one more if not every node is alive at the primary."""
        stuck = 0
        for k, name in enumerate(self.nodes):
            fresh = self.client(name, FRESH)
            deadline = time.monotonic() + 30
            good = False
            while time.monotonic() < deadline and not good and self.nodes[name].proc.poll() is None:
                fresh.state[k][0] = "absent"
                fresh.store([k])
                if fresh.state[k][0] == "present":
                    hits = fresh.c["hits"]
                    fresh.read([(FRESH, k)])
                    good = fresh.c["hits"] > hits
                if not good:
                    fresh.delete([k])
                    time.sleep(0.5)
            if not good:
                stuck += 1
                self.stuck_why.append(f"{name}: no fresh key stored and read back within 30 s "
                                      f"(call failures {dict(fresh.codes)})")
        if not self.alive_all(10):
            stuck += 1
            self.stuck_why.append("not every node alive at the primary")
        self.event(f"a fresh key stored and read back through every node: {stuck} stuck")
        return stuck

    def run(self) -> bool:
        from faultkit import Stats, log, verdict

        log(f"cluster-chaos: seed {self.seed}, {self.seconds:.0f} s of faults")
        try:
            self.start()
            self.chaos()
            reports = self.stop_clients()
            t_stop = time.monotonic()
            stuck = self.stuck_nodes()
            # The primary: no reservations or locks left once the clients
            # stopped (a killed node's clients' reservations end with their
            # timeout, locks with their TTL, holds once idle); every key deletes.
            base_ok, left = idle_primary(self.client("a"), RESERVATION_MS / 1000 + LOCK_TTL_MS / 1000 + 10,
                                         self.event)
            self.event(f"primary idle {time.monotonic() - t_stop:.1f} s after the clients stopped: {left}")
            reports += [c.report() for c in self.clients.values()]  # the end checks' own calls

            total: Counter = Counter()
            codes: Counter = Counter()
            evidence: list[dict] = []
            for r in reports:
                total.update(r["counters"])
                codes.update(r["codes"])
                evidence.extend(r["evidence"])
            stats = Stats()
            stats.add(tasks=total["calls"], hits=total["hits"], misses=total["moved"],
                      lookup_misses=total["lookup_misses"], wrong_bytes=total["wrong_bytes"],
                      hangs=total["past_deadline"],
                      errors=total["errors"] + total["whole_call_exhausted"] + total["writer_overran"],
                      store_failed=total["store_failed"], max_task_s=max(r["max_call_s"] for r in reports))
            fig = primary_log_figures(self.nodes["a"].log.read_text(errors="replace"), reports)
            t = total
            extra = (f"seed={self.seed} seconds={self.seconds:.0f} faults={json.dumps(dict(self.faults))} "
                     f"declared_dead={fig['declared_dead']} slow_writes_past_dead={fig['slow_writes_past_dead']} "
                     f"reclaims={fig['reclaims']} stored={t['stored']} slow_stored={t['slow_stored']} "
                     f"slow_unfinished={t['slow_unfinished']} commit_not_found={t['commit_expired']} "
                     f"inline_hits={t['inline_hits']} deletes_acked={t['deletes_acked']} "
                     f"delete_refused={t['delete_refused']} uncertain_commits={t['uncertain_commits']} "
                     f"store_exists={t['store_exists']} calls_failed={t['calls_failed']} "
                     f"whole_call_exhausted={t['whole_call_exhausted']} writer_overran={t['writer_overran']}")
            ok = verdict("cluster-chaos", stats, base_ok, left, extra,
                         zero={"resurrected": t["resurrected"], "stuck": stuck})
            log("call failures by method:code: " + json.dumps(dict(codes.most_common(20))))
            if not ok or os.environ.get("CXLKV_CHAOS_KEEP"):
                self.keep(ok, evidence)
            return ok
        finally:
            self.ledger.stop()
            for p in self.kids:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for c in self.clients.values():
                c.close()
            for n in reversed(list(self.nodes.values())):
                n.kill()

    def keep(self, ok: bool, evidence: list[dict]) -> None:
        """The sidecars' logs, the timeline and the evidence, kept (and the
        last two printed) where a FAIL can be looked into."""
        from faultkit import log

        keep = pathlib.Path(tempfile.mkdtemp(prefix=f"cxlkv-chaos-{self.seed}-"))
        for f in [*self.tmp.glob("*.log"), *self.tmp.glob("*.err")]:
            shutil.copy(f, keep)
        (keep / "timeline.txt").write_text("\n".join(self.timeline) + "\n")
        (keep / "evidence.json").write_text(json.dumps(evidence, indent=1))
        log(f"{'PASS' if ok else 'FAIL'}: timeline, evidence and sidecar logs kept in {keep}")
        for line in self.timeline:
            print("  " + line)
        for e in evidence[:30]:
            print("  " + json.dumps(e))
        for w in self.stuck_why:
            print("  stuck: " + w)


def s_cluster_chaos(tmp: pathlib.Path, args) -> bool:
    return Chaos(tmp, args).run()
