"""Run every cxlkv benchmark in one go and report ratios to baselines measured
in the same run (this VM's absolute speed drifts). Called by scripts/bench.sh.

Writes docs/BENCHMARKS.md (full mode) and prints a markdown table plus one
`BENCH <name> <value>` line per figure.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from cxlkv_testkit import Sidecar, free_port, mooncake

ROOT = pathlib.Path(__file__).resolve().parents[1]
REL = ROOT / "target" / "release"
PY = sys.executable
SIZES = [256 << 10, 2 << 20, 32 << 20]


def label(size: int) -> str:
    return f"{size >> 20}MiB" if size >= 1 << 20 else f"{size >> 10}KiB"


def parse(out: str) -> dict[str, float]:
    res = {}
    for line in out.splitlines():
        if line.startswith("BENCH "):
            _, k, v = line.split()
            res[k] = float(v)
    return res


def run(cmd: list[str], timeout: float = 1800) -> dict[str, float]:
    print("+", " ".join(c if len(c) < 80 else c[:77] + "..." for c in cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return parse(out.stdout)


class Proc:
    def __init__(self, cmd: list[str], log: pathlib.Path, ready=None):
        self.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
        deadline = time.monotonic() + 60
        while ready and not ready():
            if self.p.poll() is not None or time.monotonic() > deadline:
                self.p.kill()  # never left behind: nobody holds it to stop it
                raise SystemExit(f"{cmd[0]} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.p.kill()


def can_connect(path=None, port=None):
    def check():
        try:
            if path:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(path))
            else:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False
    return check


def sidecar(tmp: pathlib.Path, name: str, size: str, region: str = "256MiB", page: str | None = None,
            config: str | None = None, extra=()) -> Sidecar:
    """A release sidecar (the test kit's launcher) on a fresh /dev/shm pool, started."""
    return Sidecar(tmp, name, size, extra, region_size=region, page_size=page, config=config, format=True,
                   pool=f"/dev/shm/cxlkv-bench-{os.getpid()}-{name}", binary=str(REL / "cxlkv"),
                   start_timeout=60).start()


def end(p) -> None:
    """Stop a process of the run: a sidecar's pool file goes with it."""
    if isinstance(p, Sidecar):
        p.discard()
    else:
        p.stop()


@contextlib.contextmanager
def one_pool(tmp: pathlib.Path, procs: list, tag: str, names: str, size: str, primary_extra=(), config=None):
    """Sidecars on one pool file (64 MiB regions, 4 KiB pages): the first
    the primary, the rest followers forwarding registry calls to it over
    loopback; stopped followers first (none waits on a gone primary), the
    pool file removed."""
    pool, peer = f"/dev/shm/cxlkv-bench-{os.getpid()}-{tag}", f"127.0.0.1:{free_port()}"
    nodes = []
    try:
        # The primary first: it formats the pool and serves the peer port the
        # followers join through; a follower serves once it joined.
        for i, name in enumerate(names):
            role = ["--peer-addr", peer, *primary_extra] if i == 0 else ["--primary-addr", peer]
            node = Sidecar(tmp, f"{tag}-{name}", size, ["--primary", names[0], "--node-name", name, *role],
                           region_size="64MiB", page_size="4KiB", config=config, pool=pool, format=i == 0,
                           binary=str(REL / "cxlkv"), start_timeout=60)
            procs.append(node)
            nodes.append(node)
            node.start()
        yield nodes
    finally:
        for node in reversed(nodes):
            node.halt()
            procs.remove(node)
        if os.path.exists(pool):
            os.unlink(pool)


def follower_storm(tmp: pathlib.Path, procs: list, cfg: str, regions: int, args: list) -> dict[str, float]:
    """The storm through a follower (a primary and one follower on one pool
    file): what a Reserve that finds no room costs where the registry is a
    round trip away. The follower's regions hold the entries; the primary's
    one keeps a locked entry of its own (`--hold-socket`), so no region of
    the pool can be taken for the storm: the entries' `regions` and one more."""
    with one_pool(tmp, procs, "fstorm", "ab", f"{64 * (regions + 1)}MiB", config=cfg) as (a, b):
        return run([str(REL / "cxlkv-bench"), "storm", "--socket", b.socket, "--hold-socket", a.socket,
                    "--suffix", "_follower", *args])


def cluster(tmp: pathlib.Path, procs: list, q: bool) -> dict[str, float]:
    """Three sidecars on one pool file (node a the primary, b and c followers
    forwarding registry calls to it over loopback), then `cxlkv-bench
    cluster`: lookups through a follower vs at the primary, loads of
    cross-node vs same-node hits, key-lookups/s spread over the nodes vs on
    one."""
    tcp = f"127.0.0.1:{free_port()}"
    with one_pool(tmp, procs, "cluster", "abc", "512MiB", primary_extra=["--tcp", tcp]) as nodes:
        quick = ["--iters", "200", "--objects", "64", "--rounds", "4", "--seconds", "0.3"] if q else []
        return run([str(REL / "cxlkv-bench"), "cluster", "--primary", nodes[0].socket, "--primary-tcp", tcp,
                    "--followers", f"{nodes[1].socket},{nodes[2].socket}",
                    "--pids", ",".join(str(n.pid) for n in nodes), *quick])


def mooncake_store(tmp: pathlib.Path, name: str, store_bytes: int) -> tuple[list, str, str]:
    """A Mooncake Store on loopback, TCP transport: `mooncake_master` with its
    embedded HTTP metadata server (what the transfer engine's TCP mode looks
    peers up in), and with `store_bytes` a standalone `mooncake_client`
    holding that much of the store's memory (0: none; engines then bring
    their own). Returns the processes, the master's address and the metadata URL."""
    rpc, http, metrics = free_port(), free_port(), free_port()
    master = Proc(mooncake.master_args(rpc, http, metrics), tmp / f"{name}-master.log",
                  lambda: can_connect(port=rpc)() and can_connect(port=http)())
    procs = [master]
    addr, meta = f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
    if store_bytes:
        port = free_port()
        try:  # its service port opens once its segment is mounted at the master
            procs.append(Proc(mooncake.store_args(port, addr, meta, store_bytes), tmp / f"{name}-store.log",
                              can_connect(port=port)))
        except BaseException:
            master.stop()
            raise
    return procs, addr, meta


def traces() -> dict[str, pathlib.Path]:
    """Mooncake's FAST'25 traces where this machine has them: `$CXLKV_TRACES`
    (directories, `:`-separated), else `../shared/traces` beside the
    checkout and `target/traces`. The conversation trace is not kept in the
    repository: fetch FAST25-release/traces/conversation_trace.jsonl from
    Mooncake's repository into one of them."""
    dirs = os.environ.get("CXLKV_TRACES", f"{ROOT.parent / 'shared' / 'traces'}:{ROOT / 'target' / 'traces'}")
    names = {"conversation": ["conversation_trace.jsonl"],
             "synthetic": ["mooncake_synthetic_trace.jsonl", "synthetic_trace.jsonl"]}
    found = {}
    for trace, files in names.items():
        for d in dirs.split(":"):
            hit = [pathlib.Path(d) / f for f in files if (pathlib.Path(d) / f).is_file()]
            if hit:
                found[trace] = hit[0]
                break
        else:
            print(f"admission replay: no {trace} trace in {dirs}; its figures are left out", file=sys.stderr)
    return found


# The admission replay's cells: capacities (% of the trace's unique blocks).
REPLAY_CAPS = [1, 2, 5, 10, 20]


def replay_admission() -> dict[str, float]:
    """`cxlkv-trace replay` of LRU, `gd` (today's default without admission)
    and `gd+admission` (the default with admission): per cell the block-hit
    gain of admission over `gd` in points and the blocks it wrote as a share
    of LRU's."""
    d = {}
    for trace, path in traces().items():
        caps = ",".join(str(c / 100) for c in REPLAY_CAPS)
        cmd = [str(REL / "cxlkv-trace"), "replay", str(path), "--policy", "lru,gd,gd+admission", "--capacity", caps,
               "--json"]
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        cells = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800).stdout)
        by = {(c["policy"], round(c["capacity"] * 100)): c for c in cells}
        for cap in REPLAY_CAPS:
            lru, gd, adm = by[("lru", cap)], by[("gd", cap)], by[("gd+admission", cap)]
            d[f"admission_hit_gain_pp_{trace}_{cap}pct"] = (adm["block_hit"] - gd["block_hit"]) * 100
            d[f"admission_prefix_gain_pp_{trace}_{cap}pct"] = (adm["prefix_hit"] - gd["prefix_hit"]) * 100
            d[f"admission_written_vs_lru_{trace}_{cap}pct"] = adm["written_blocks"] / lru["written_blocks"]
            d[f"gd_written_vs_lru_{trace}_{cap}pct"] = gd["written_blocks"] / lru["written_blocks"]
    return d


def machine() -> str:
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return f"{os.cpu_count()} cores ({cpu}), {mem:.1f} GiB RAM, Linux {platform.release()}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run; does not write docs/")
    args = ap.parse_args()
    q = args.quick
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="cxlkv-bench-"))
    r: dict[str, float] = {}
    procs = []
    try:
        # 1. Physical limit.
        r |= run([str(REL / "cxlkv-bench"), "memcpy", "--bytes", str((16 if q else 512) << 20),
                  "--reps", "3" if q else "9"])

        # 2. Data path through LMCache's adapter interface, and 3. peers.
        batch, rounds = (4, 2) if q else (32, 9)
        pool_gib = max(1, (max(SIZES) * batch * 2 + (1 << 30) - 1) >> 30) + 1
        sc = sidecar(tmp, "data", f"{pool_gib}GiB")
        procs.append(sc)
        sizes = ",".join(map(str, SIZES))
        plugin = {"type": "plugin", "module_path": "cxlkv_lmcache.adapter", "class_name": "CxlKvL2Adapter",
                  "adapter_params": {"socket": sc.socket, "deadline_ms": 60000}}
        r |= run([PY, str(ROOT / "scripts" / "bench_l2.py"), "--name", "cxlkv", "--adapter-json", json.dumps(plugin),
                  "--sizes", sizes, "--batch", str(batch), "--rounds", str(rounds),
                  "--lookup-iters", "100" if q else "3000"])
        # 2b. The same sidecar under LMCache's in-process engine (vLLM's
        # LMCacheConnectorV1): its StorageManager with the cxlkv storage plugin.
        inproc = ["--sizes", sizes, "--batch", str(batch), "--big-batch", "2" if q else "8",
                  "--rounds", "1" if q else "7"]
        # And a get with many views in L1 against none (under the view budget).
        r |= run([PY, str(ROOT / "scripts" / "bench_inproc.py"), "--kind", "cxlkv", "--target", sc.socket, *inproc,
                  "--views-kept", "64" if q else "1024"])
        sc.discard()
        procs.remove(sc)

        redis_port = free_port()
        redis = Proc([shutil.which("redis-server") or "redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                      "--save", "", "--appendonly", "no", "--protected-mode", "no"],
                     tmp / "redis.log", can_connect(port=redis_port))
        procs.append(redis)
        resp = {"type": "resp", "host": "127.0.0.1", "port": redis_port}
        r |= run([PY, str(ROOT / "scripts" / "bench_l2.py"), "--name", "redis", "--adapter-json", json.dumps(resp),
                  "--sizes", sizes, "--batch", str(batch), "--rounds", str(max(1, rounds // 3))])
        # The in-process workload with LMCache's Redis remote connector instead.
        r |= run([PY, str(ROOT / "scripts" / "bench_inproc.py"), "--kind", "redis", "--target",
                  f"127.0.0.1:{redis_port}", "--sizes", sizes, "--batch", str(batch), "--big-batch", "2" if q else "8",
                  "--rounds", "1" if q else "3"])
        redis.stop()
        procs.remove(redis)

        # The in-process workload with LMCache's Mooncake Store connector
        # (TCP): the objects in a standalone store process (as they would be
        # on other hosts), then, as a reference, in a segment each engine
        # contributes (LMCache's documented per-worker setup: objects stay in
        # the engine's process). A fresh store each: the keys repeat.
        for variant, store_bytes, segment in (("store", (1 if q else 2) << 30, 0), ("local", 0, (1 if q else 2) << 30)):
            mc, addr, meta = mooncake_store(tmp, f"mooncake-{variant}", store_bytes)
            procs.extend(mc)
            r |= run([PY, str(ROOT / "scripts" / "bench_inproc.py"), "--kind", "mooncake", "--target", addr,
                      "--metadata", meta, "--segment", str(segment), "--sizes", sizes, "--batch", str(batch),
                      "--big-batch", "2" if q else "8", "--rounds", "1" if q else "3"])
            for p in reversed(mc):
                p.stop()
                procs.remove(p)

        dax_file = f"/dev/shm/cxlkv-bench-{os.getpid()}-dax"
        dax = {"type": "dax", "device_path": dax_file, "max_dax_size_gb": "{SIZE_GB}", "slot_bytes": "{SLOT}"}
        dax_json = json.dumps(dax).replace('"{SIZE_GB}"', "{SIZE_GB}").replace('"{SLOT}"', "{SLOT}")
        r |= run([PY, str(ROOT / "scripts" / "bench_l2.py"), "--name", "dax", "--adapter-json", dax_json,
                  "--sizes", sizes, "--batch", str(batch), "--rounds", str(rounds)])
        if os.path.exists(dax_file):
            os.unlink(dax_file)

        # 4. Control path from Rust over UDS and TCP, after the host's own
        # wake-up round trip (the baseline its latencies are read against).
        r |= run([str(REL / "cxlkv-bench"), "wakeup", "--rounds", "2000" if q else "20000"])
        tcp = f"127.0.0.1:{free_port()}"
        sc = sidecar(tmp, "ctl", "512MiB", extra=("--tcp", tcp))
        procs.append(sc)
        r |= run([str(REL / "cxlkv-bench"), "control", "--socket", sc.socket, "--tcp", tcp,
                  "--iters", "300" if q else "20000", "--seconds", "0.3" if q else "3"])
        sc.discard()
        procs.remove(sc)

        # 5. Scale: each size in a fresh process so RSS deltas are clean.
        for n in ([10_000, 100_000] if q else [10_000, 1_000_000, 10_000_000]):
            r |= run([str(REL / "cxlkv-bench"), "scale", "--entries", str(n), "--seconds", "0.5" if q else "3"])

        # 6. Eviction cost: stores into a full pool vs an empty one.
        sc = sidecar(tmp, "evict", "128MiB" if q else "512MiB", region="64MiB")
        procs.append(sc)
        r |= run([str(REL / "cxlkv-bench"), "evict", "--socket", sc.socket])
        sc.discard()
        procs.remove(sc)

        # 6b. Admission: a stream of one-hit chunks into a full pool, with
        # admission as configured (the default) and with admission off.
        admission_off = '[registry]\nadmission = "off"\n'
        on = sidecar(tmp, "adm-on", "64MiB" if q else "256MiB", region="32MiB")
        procs.append(on)
        off = sidecar(tmp, "adm-off", "64MiB" if q else "256MiB", region="32MiB", config=admission_off)
        procs.append(off)
        r |= run([str(REL / "cxlkv-bench"), "admission", "--on", on.socket, "--off", off.socket,
                  "--warmup", "800", "--calls", "200" if q else "2000"])
        for sc in (on, off):
            sc.discard()
            procs.remove(sc)

        # 6c. Admission replayed on Mooncake's traces (full runs, where the
        # traces are: see `traces()`).
        if not q:
            r |= replay_admission()

        # 7. Warm restart: rebuild the registry from the pool's object records.
        for n in ([10_000] if q else [100_000, 1_000_000]):
            r |= run([str(REL / "cxlkv-bench"), "rebuild", "--pool", f"/dev/shm/cxlkv-bench-{os.getpid()}-rebuild",
                      "--objects", str(n)])

        # 8. A storm of reserves that cannot be placed, over many locked entries:
        # how much it slows an unrelated client (4 KiB pages: one entry each).
        # Admission off: it would decline most of the storm's new keys before
        # placing them (a full pool that is read), which is cheaper; the
        # figure is about reserves that get through.
        # A control sidecar beside it, which the storm never calls, is probed
        # in turn: what the storm's CPU alone does to a probe on this host.
        # The locks are another client's (engines holding their hits), all of
        # them: its pin limit is the whole pool here. Every region keeps
        # some, so no reserve can be placed, and none may evict anything
        # (`storm_evictions`: once the node's whole cache, for nothing).
        # The pool as many regions as the entries fill (256 MiB for the full
        # run's 60,000): the storm stops at a reserve that is placed.
        locked, free = (5000, 1000) if q else (50000, 10000)
        storm_args = ["--locked", str(locked), "--free", str(free), "--probes", "200" if q else "2000"]
        storm_cfg = admission_off + "max_client_pinned_bytes = 268435456\n"
        regions = -(-(locked + free) // 16384)  # of 64 MiB, 4 KiB pages
        pool = f"{64 * regions}MiB"
        sc = sidecar(tmp, "storm", pool, region="64MiB", page="4KiB", config=storm_cfg)
        procs.append(sc)
        ctl = sidecar(tmp, "storm-control", pool, region="64MiB", page="4KiB", config=storm_cfg)
        procs.append(ctl)
        r |= run([str(REL / "cxlkv-bench"), "storm", "--socket", sc.socket, "--control-socket", ctl.socket,
                  *storm_args])
        for p in (sc, ctl):
            p.discard()
            procs.remove(p)
        r |= follower_storm(tmp, procs, storm_cfg, regions, storm_args)
        # The same storm Reserve given to a handler in the bench's process
        # (same pool, entries and locks): the sidecar's own work on it,
        # without transport, the probes' CPU or the bulk lane's priority.
        r |= run([str(REL / "cxlkv-bench"), "storm-handler", "--pool",
                  f"/dev/shm/cxlkv-bench-{os.getpid()}-storm-handler",
                  "--locked", "5000" if q else "50000", "--free", "1000" if q else "10000",
                  "--rounds", "20" if q else "300"])

        # 9. Software coherence: stores with every record and payload line
        # flushed, against the same stores with nothing flushed, interleaved
        # (two nodes in one process on one pool file).
        r |= run([str(REL / "cxlkv-bench"), "flush", "--pool", f"/dev/shm/cxlkv-bench-{os.getpid()}-flush",
                  "--sizes", "4096,65536,262144,2097152", "--rounds", "3" if q else "45"])

        # 10. Cluster: a primary and two followers on one pool file.
        r |= cluster(tmp, procs, q)
    finally:
        for p in procs:
            end(p)
        shutil.rmtree(tmp, ignore_errors=True)

    derived = derive(r, q)
    r |= derived
    table = render(r, q)
    print(table)
    for k in sorted(r):
        print(f"BENCH {k} {r[k]:.4f}")
    if not q:
        (ROOT / "docs" / "BENCHMARKS.md").write_text(document(table, r))
        notes = (ROOT / "docs" / "benchmark-findings.md").read_text().split("## Targets not met", 1)[-1]
        bare = [n for n in re.findall(r"^\| `(\w+)` \|[^\n]*\*\*no\*\* \|$", table, re.M) if f"`{n}`" not in notes]
        if bare:  # python/tests/test_benchmarks_doc.py fails on these until they have one
            print(f"unmet, without a note under 'Targets not met' in docs/benchmark-findings.md: {', '.join(bare)}")


def derive(r: dict[str, float], q: bool) -> dict[str, float]:
    d = {}
    for s in SIZES:
        lab = label(s)
        mc = d[f"memcpy_py_gbps_{lab}"] = r[f"cxlkv_memcpy_gbps_{lab}"]  # timed in the cxlkv rounds
        d[f"store_ratio_memcpy_{lab}"] = r[f"cxlkv_store_gbps_{lab}"] / mc
        d[f"load_ratio_memcpy_{lab}"] = r[f"cxlkv_load_gbps_{lab}"] / mc
        # The plugin copies with streaming stores; against that routine alone
        # the ratio is the cost of everything else (RPCs, threads, bookkeeping).
        sc = r[f"cxlkv_stream_copy_gbps_{lab}"]
        d[f"store_ratio_stream_{lab}"] = r[f"cxlkv_store_gbps_{lab}"] / sc
        d[f"load_ratio_stream_{lab}"] = r[f"cxlkv_load_gbps_{lab}"] / sc
        # Best any data path could do against Redis: the copy alone, in the
        # Redis run's own rounds.
        t_r = 1 / r[f"redis_store_gbps_{lab}"] + 1 / r[f"redis_load_gbps_{lab}"]
        d[f"ceiling_vs_redis_{lab}"] = t_r / (2 / r[f"redis_stream_copy_gbps_{lab}"])
        for peer in ("redis", "dax"):
            # Same bytes in and out: ratio of store+load times, peer / cxlkv.
            t_c = 1 / r[f"cxlkv_store_gbps_{lab}"] + 1 / r[f"cxlkv_load_gbps_{lab}"]
            t_p = 1 / r[f"{peer}_store_gbps_{lab}"] + 1 / r[f"{peer}_load_gbps_{lab}"]
            d[f"ratio_vs_{peer}_{lab}"] = t_p / t_c
        # In-process engine: store + tier hit of the same chunks, Redis / cxlkv.
        t_c = 1 / r[f"inproc_store_gbps_{lab}"] + 1 / r[f"inproc_hit_gbps_{lab}"]
        t_p = 1 / r[f"inproc_redis_store_gbps_{lab}"] + 1 / r[f"inproc_redis_hit_gbps_{lab}"]
        d[f"inproc_ratio_vs_redis_{lab}"] = t_p / t_c
        # Mooncake Store: store and tier hit each, and together, Mooncake / cxlkv.
        for peer in ("mooncake", "mooncake_local"):
            d[f"inproc_store_ratio_vs_{peer}_{lab}"] = r[f"inproc_store_gbps_{lab}"] / r[f"inproc_{peer}_store_gbps_{lab}"]
            d[f"inproc_load_ratio_vs_{peer}_{lab}"] = r[f"inproc_hit_gbps_{lab}"] / r[f"inproc_{peer}_hit_gbps_{lab}"]
            t_p = 1 / r[f"inproc_{peer}_store_gbps_{lab}"] + 1 / r[f"inproc_{peer}_hit_gbps_{lab}"]
            d[f"inproc_ratio_vs_{peer}_{lab}"] = t_p / t_c
            # Each side against memcpy of the same bytes in its own rounds.
            d[f"inproc_{peer}_hit_ratio_memcpy_{lab}"] = (r[f"inproc_{peer}_hit_gbps_{lab}"]
                                                         / r[f"inproc_{peer}_memcpy_gbps_{lab}"])
        d[f"inproc_hit_ratio_memcpy_{lab}"] = r[f"inproc_hit_gbps_{lab}"] / r[f"inproc_memcpy_gbps_{lab}"]
    small, big = ("10k", "100k") if q else ("10k", "10M")
    d["lookup_rate_ratio_large_vs_10k"] = r[f"registry_lookups_per_s_{big}"] / r[f"registry_lookups_per_s_{small}"]
    # The same ratio for a bare HashMap<u64, u64>: what memory alone allows.
    d["hashmap_floor_ratio_large_vs_10k"] = r[f"hashmap_lookups_per_s_{big}"] / r[f"hashmap_lookups_per_s_{small}"]
    return d


TARGETS = [
    ("inproc_store_ratio_memcpy_2MiB", ">=", 0.8), ("inproc_hit_vs_l1_2MiB", ">=", 0.9),
    ("inproc_get_ratio_views_kept", "<=", 1.5), ("inproc_get_ms_views_kept", "ref", 0),
    ("inproc_get_ms_none_kept", "ref", 0), ("inproc_views_kept", "ref", 0),
    ("inproc_ratio_vs_redis_2MiB", "ref", 0), ("inproc_gpu_load_vs_pinned_2MiB", ">=", 0.9),
    ("inproc_store_ratio_memcpy_256KiB", "ref", 0), ("inproc_hit_vs_l1_256KiB", "ref", 0),
    ("inproc_store_ratio_memcpy_32MiB", "ref", 0), ("inproc_hit_vs_l1_32MiB", "ref", 0),
    ("inproc_ratio_vs_redis_256KiB", "ref", 0), ("inproc_ratio_vs_redis_32MiB", "ref", 0),
    ("inproc_store_ratio_vs_mooncake_2MiB", ">=", 5), ("inproc_load_ratio_vs_mooncake_2MiB", ">=", 5),
    ("inproc_ratio_vs_mooncake_2MiB", ">=", 5),
    ("inproc_store_ratio_vs_mooncake_32MiB", ">=", 5), ("inproc_load_ratio_vs_mooncake_32MiB", ">=", 5),
    ("inproc_ratio_vs_mooncake_32MiB", ">=", 5), ("inproc_ratio_vs_mooncake_256KiB", "ref", 0),
    ("inproc_ratio_vs_mooncake_local_2MiB", "ref", 0), ("inproc_ratio_vs_mooncake_local_32MiB", "ref", 0),
    ("store_ratio_memcpy_256KiB", ">=", 0.7), ("cxlkv_store_ratio_bound_256KiB", "ref", 0),
    ("store_ratio_memcpy_2MiB", ">=", 0.8), ("load_ratio_memcpy_2MiB", ">=", 0.8),
    ("store_ratio_memcpy_32MiB", ">=", 0.8), ("load_ratio_memcpy_32MiB", ">=", 0.8),
    ("store_ratio_stream_2MiB", "ref", 0), ("load_ratio_stream_2MiB", "ref", 0),
    ("ratio_vs_redis_2MiB", ">=", 10), ("ceiling_vs_redis_2MiB", "ref", 0), ("ratio_vs_dax_2MiB", ">=", 1.0),
    ("lookup32_p99_us_rust_uds", "<=", 100), ("lookup32_p99_us_python", "<=", 400),
    ("wakeup_rtt_us_p50", "ref", 0), ("wakeup_rtt_us_p99", "ref", 0),
    ("key_lookups_per_s", ">=", 1e6), ("registry_bytes_per_entry_10M", "<=", 150),
    ("lookup_rate_ratio_large_vs_10k", ">=", 0.67), ("hashmap_floor_ratio_large_vs_10k", "ref", 0),
    ("full_vs_empty_store_ratio", ">=", 0.8),
    ("storm_probe_p99_ratio", "<=", 1.5), ("storm_reserve_ms", "<=", 0.5), ("storm_evictions", "<=", 0),
    ("storm_probe_p99_ratio_control", "ref", 0), ("storm_probe_p99_vs_control", "ref", 0),
    ("storm_handler_ms", "ref", 0), ("storm_reserve_ms_follower", "ref", 0), ("storm_evictions_follower", "<=", 0),
    ("rebuild_s_per_million_1M", "<=", 1.0), ("rebuild_s_100k", "ref", 0),
    ("store_flush_ratio_2MiB", ">=", 0.95), ("store_record_flush_ratio_2MiB", "ref", 0),
    ("store_flush_ratio_64KiB", "ref", 0), ("store_record_flush_ratio_64KiB", "ref", 0),
    ("store_flush_ratio_4KiB", "ref", 0), ("store_flush_ratio_cold_4KiB", ">=", 0.95),
    ("store_flush_ratio_cold_64KiB", ">=", 0.95),
    ("cluster_follower_lookup_p50_ratio", "<=", 1.5), ("cluster_load_cross_vs_same_256KiB", ">=", 0.95),
    ("cluster_lookup32_p50_us_follower", "ref", 0), ("cluster_lookup32_p50_us_primary", "ref", 0),
    ("cluster_lookup32_p50_us_primary_tcp", "ref", 0), ("cluster_follower_first_lookup_p50_ratio", "ref", 0),
    ("cluster_load_e2e_cross_vs_same_256KiB", "ref", 0), ("cluster_spread_lookup_rate_ratio", ">=", 2.0),
    ("cluster_spread_busiest_cpu_ratio", "ref", 0), ("cluster_spread_primary_cpu_share", "ref", 0),
    ("admission_one_hit_copied_ratio", "<=", 0.2), ("admission_one_hit_call_ratio", "<=", 1.1),
    ("admission_one_hit_call_p50_ratio", "ref", 0), ("admission_one_hit_refused_share", "ref", 0),
    ("registry_bytes_per_entry_evicting_10M", "ref", 0),
    *[(f"admission_written_vs_lru_{t}_{c}pct", "<=", lim) for t, lim in (("conversation", 0.3), ("synthetic", 0.6))
      for c in (1, 2)],
    *[(f"admission_hit_gain_pp_{t}_{c}pct", ">=", -0.5) for t in ("conversation", "synthetic") for c in REPLAY_CAPS],
    ("cluster_client_cpu_busy_3_nodes", "ref", 0), ("cluster_busiest_node_cpu_busy_3_nodes", "ref", 0),
    ("cluster_spread_shared_cpus", "ref", 0),
]


def fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def render(r: dict[str, float], q: bool) -> str:
    rows = ["| figure | value | target | met |", "|---|---|---|---|"]
    for name, op, tgt in TARGETS:
        if name not in r:
            continue
        v = r[name]
        if op == "ref":
            rows.append(f"| `{name}` | {fmt(v)} | (reference) | |")
            continue
        ok = v >= tgt if op == ">=" else v <= tgt
        rows.append(f"| `{name}` | {fmt(v)} | {op} {fmt(tgt)} | {'yes' if ok else '**no**'} |")
    rows += ["", "| size | memcpy / streaming copy GB/s | cxlkv store GB/s (×memcpy) | cxlkv load GB/s (×memcpy) | store p50/p99 ms |"
             " load p50/p99 ms | Redis store/load GB/s | dax store/load GB/s |", "|---|---|---|---|---|---|---|---|"]
    for s in SIZES:
        lab = label(s)
        g = lambda k: r.get(k, float("nan"))  # noqa: E731
        rows.append(
            f"| {lab} | {fmt(g(f'memcpy_py_gbps_{lab}'))} / {fmt(g(f'cxlkv_stream_copy_gbps_{lab}'))} "
            f"| {fmt(g(f'cxlkv_store_gbps_{lab}'))} "
            f"({g(f'store_ratio_memcpy_{lab}'):.2f}) | {fmt(g(f'cxlkv_load_gbps_{lab}'))} "
            f"({g(f'load_ratio_memcpy_{lab}'):.2f}) | {fmt(g(f'cxlkv_store_p50_ms_{lab}'))}/"
            f"{fmt(g(f'cxlkv_store_p99_ms_{lab}'))} | {fmt(g(f'cxlkv_load_p50_ms_{lab}'))}/"
            f"{fmt(g(f'cxlkv_load_p99_ms_{lab}'))} | {fmt(g(f'redis_store_gbps_{lab}'))}/"
            f"{fmt(g(f'redis_load_gbps_{lab}'))} | {fmt(g(f'dax_store_gbps_{lab}'))}/{fmt(g(f'dax_load_gbps_{lab}'))} |")
    rows += ["", "In-process engine (LMCache's StorageManager with its L1; cxlkv as storage plugin vs LMCache's Redis "
             "remote connector):", "",
             "| size | memcpy GB/s | cxlkv store GB/s (×memcpy) | L1 hit / cxlkv hit GB/s (×L1) "
             "| Redis store / hit GB/s | store+hit Redis ÷ cxlkv |", "|---|---|---|---|---|---|"]
    for s in SIZES:
        lab = label(s)
        g = lambda k: r.get(k, float("nan"))  # noqa: E731
        rows.append(
            f"| {lab} | {fmt(g(f'inproc_memcpy_gbps_{lab}'))} | {fmt(g(f'inproc_store_gbps_{lab}'))} "
            f"({g(f'inproc_store_ratio_memcpy_{lab}'):.2f}) | {fmt(g(f'inproc_l1_hit_gbps_{lab}'))} / "
            f"{fmt(g(f'inproc_hit_gbps_{lab}'))} ({g(f'inproc_hit_vs_l1_{lab}'):.2f}) "
            f"| {fmt(g(f'inproc_redis_store_gbps_{lab}'))} / {fmt(g(f'inproc_redis_hit_gbps_{lab}'))} "
            f"| {g(f'inproc_ratio_vs_redis_{lab}'):.1f} |")
    rows += ["", "In-process engine, cxlkv beside LMCache's Mooncake Store connector (TCP; ratios only: each "
             "side's GB/s ÷ memcpy of the same bytes in its own rounds, then cxlkv ÷ Mooncake):", "",
             "| size | cxlkv store / hit ×memcpy | Mooncake (store process) store / hit ×memcpy "
             "| cxlkv ÷ Mooncake store / load / both | Mooncake (engine's own segment) store / hit ×memcpy "
             "| cxlkv ÷ Mooncake-local store / load / both |", "|---|---|---|---|---|---|"]
    for s in SIZES:
        lab = label(s)
        g = lambda k: r.get(k, float("nan"))  # noqa: E731
        rows.append(
            f"| {lab} | {g(f'inproc_store_ratio_memcpy_{lab}'):.2f} / {g(f'inproc_hit_ratio_memcpy_{lab}'):.2f} "
            f"| {g(f'inproc_mooncake_store_ratio_memcpy_{lab}'):.3f} / "
            f"{g(f'inproc_mooncake_hit_ratio_memcpy_{lab}'):.3f} "
            f"| {g(f'inproc_store_ratio_vs_mooncake_{lab}'):.1f} / {g(f'inproc_load_ratio_vs_mooncake_{lab}'):.1f} / "
            f"{g(f'inproc_ratio_vs_mooncake_{lab}'):.1f} "
            f"| {g(f'inproc_mooncake_local_store_ratio_memcpy_{lab}'):.3f} / "
            f"{g(f'inproc_mooncake_local_hit_ratio_memcpy_{lab}'):.3f} "
            f"| {g(f'inproc_store_ratio_vs_mooncake_local_{lab}'):.1f} / "
            f"{g(f'inproc_load_ratio_vs_mooncake_local_{lab}'):.1f} / {g(f'inproc_ratio_vs_mooncake_local_{lab}'):.1f} |")
    return "\n".join(rows)


def document(table: str, r: dict[str, float]) -> str:
    lines = "\n".join(f"BENCH {k} {r[k]:.4f}" for k in sorted(r))
    notes = (ROOT / "docs" / "benchmark-findings.md")
    findings = notes.read_text() if notes.exists() else ""
    return f"""# cxlkv benchmarks

Generated by `scripts/bench.sh` on {datetime.date.today()} — {machine()}.
Every figure is a ratio to a baseline measured in the same run (this VM's absolute
speed drifts): data-path throughput against `memcpy` of the same 32 objects in the
same process, peers on the same workload through the same driver
(`scripts/bench_l2.py`: LMCache's L2 adapter interface, batches of 32 keys).

{table}

{findings}

## Raw figures

```
{lines}
```
"""


if __name__ == "__main__":
    main()
