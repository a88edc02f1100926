"""Copy-path benchmark that needs no LMCache: the plugin's store and load path
against a real sidecar, next to the copies it competes with.

`scripts/bench.sh` drives the adapter through LMCache (6 GB of venv), which an
offline GPU host with only Python and torch does not have. This script drives
the pieces the adapter's mmap path is made of, in the adapter's order
(adapter.py `_store_mapped`, `_load`, `_copy_out`):

  store: Reserve → PoolMap.put_many over `copy_threads` threads (streaming
         stores from _copy.c; write-backs under software coherence) →
         publish (fence) → Commit (handoff.CommitRides, as the adapter sends it)
  load:  LookupAndLock → still_there → PoolMap.get_many → still_there again
         (a location whose object was evicted or reclaimed meanwhile is a
         miss, never bytes) → Unlock

Each figure is a whole batch of `--batch-bytes` at one object size (2 MiB and
32 MiB: LMCache chunks of a few layers vs of a whole model), timed from the
first RPC to the last reply. Buffers are torch pinned host memory when torch
with CUDA is present (LMCache's L1 is pinned memory), else page-aligned
anonymous mmaps. Baselines are timed in every round next to cxlkv, so both see
the same noise: memmove of the same objects on one thread and spread over the
same `copy_threads` (the Copier's own split), and with CUDA the GPU→host and
host→GPU DMA of the same bytes. Ratios are taken per round, then the median.

Every round stamps the source objects, poisons the load buffers and compares
what came back (every object's first and last 4 KiB, three whole objects), so
a fast figure of wrong bytes fails the run. Prints `BENCH <name> <value>`
lines (scripts/bench.py's format) and a table with each figure's spread.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import glob
import mmap
import os
import pathlib
import signal
import statistics
import struct
import sys
import tempfile
import time

from cxlkv_lmcache import client as cl
from cxlkv_lmcache import copies
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.handoff import CommitRides, Handoff
from cxlkv_lmcache.state import Task, server_deadline, time_left
# The test kit's sidecar launcher: installed in the repository's venv, packed
# beside this script in the GPU bundle (scripts/gpu-bundle.sh).
from cxlkv_testkit.sidecar import Sidecar as Launcher

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIZES = [2 << 20, 32 << 20]
CHECK = 4096  # bytes compared at each end of every object, every round
DEADLINE_S = 60.0  # per store or load batch; a 1 GiB batch takes well under a second on a GPU host


def label(size: int) -> str:
    return f"{size >> 20}MiB" if size >= 1 << 20 else f"{size >> 10}KiB"


def bench(name: str, value: float) -> None:
    print(f"BENCH {name} {value:.4f}", flush=True)


def find_cxlkv(given: str | None) -> str:
    if given:
        return given
    for kind in ("release", "debug"):
        p = ROOT / "target" / kind / "cxlkv"
        if p.exists():
            return str(p)
    raise SystemExit("no cxlkv binary: build it (cargo build --release --bin cxlkv) or pass --cxlkv PATH")


# ------------------------------------------------------------------ buffers

def _torch_cuda():
    """torch when it can reach a GPU, else None (then no DMA figures). No
    sign of an NVIDIA driver, no import: torch takes seconds to import."""
    if not glob.glob("/dev/nvidia*") and not os.path.exists("/proc/driver/nvidia"):
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


class Buffer:
    """`n` bytes of host memory at `addr`: torch pinned memory (what LMCache
    copies to and from) when CUDA is there, else an anonymous mmap (page-aligned
    like pinned memory, so copies see the same alignment)."""

    def __init__(self, n: int, torch=None):
        self.n = n
        self.tensor = None
        if torch is not None:
            self.tensor = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            self.addr = self.tensor.data_ptr()
        else:
            self._mm = mmap.mmap(-1, n, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._anchor = ctypes.c_char.from_buffer(self._mm)
            self.addr = ctypes.addressof(self._anchor)
        ctypes.memset(self.addr, 0, n)  # every page touched before any timing

    def randomize(self) -> None:
        if self.tensor is not None:
            self.tensor.random_(0, 256)
            return
        block = 1 << 20
        for off in range(0, self.n, block):
            k = min(block, self.n - off)
            ctypes.memmove(self.addr + off, os.urandom(k), k)

    def close(self) -> None:
        if self.tensor is None:
            del self._anchor
            self._mm.close()


# ------------------------------------------------------------------ sidecar

def _free(path: str) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class Sidecar(Launcher):
    """`cxlkv serve` (the test kit's launcher) on a pool file of its own,
    removed (with the socket's directory) when the sidecar is stopped,
    however this script ends."""

    def __init__(self, binary: str, pool_dirs: list[str], batch: int, region: int, coherence: str | None):
        regions = -(-batch // region) + 1  # a batch, plus a region of slack for page rounding
        # Containers often mount a /dev/shm of 64 MiB: then the next place
        # with room, named in the output (a disk-backed file adds writeback noise).
        room = [d for d in pool_dirs if _free(d) >= regions * region + (64 << 20)]
        if not room:
            raise SystemExit(f"no room for a {regions * region >> 20} MiB pool in {pool_dirs}: pass --pool-dir on "
                             "a larger tmpfs or a smaller --batch-bytes")
        # The benchmark is this pool's only client and holds a whole batch
        # reserved, then locked: the default bound on one client's pinned
        # bytes (half the pool, for a sidecar its clients share) would refuse
        # any batch larger than that.
        extra = ["--max-client-pinned-bytes", str(regions * region)]
        if coherence:
            extra += ["--coherence", coherence]
        super().__init__(pathlib.Path(tempfile.mkdtemp(prefix="cxlkv-benchcopy-")), "cxlkv",
                         f"{regions * region >> 20}MiB", extra, region_size=f"{region >> 20}MiB", page_size=None,
                         pool=os.path.join(room[0], f"cxlkv-benchcopy-{os.getpid()}"), format=True, binary=binary,
                         start_timeout=60)
        atexit.register(self.stop)
        try:
            self.start()
        except RuntimeError:
            tail = self.log.read_text(errors="replace")[-2000:]
            self.stop()
            raise SystemExit(f"cxlkv did not start:\n{tail}") from None

    def stop(self) -> None:
        self.discard()
        with contextlib.suppress(FileNotFoundError):
            self.log.unlink()
        with contextlib.suppress(OSError):
            self.dir.rmdir()


# --------------------------------------------------------------- data path

class Path:
    """The adapter's mmap data path, minus LMCache: one connection, its pool
    mapping and a Copier of `threads`."""

    def __init__(self, socket_path: str, threads: int):
        self.channel = cl.channel(socket_path)
        self.stub = cl.stub(self.channel)
        self.info = self.stub.PoolInfo(pb.PoolInfoRequest(), timeout=30, wait_for_ready=True)
        self.pool = cl.PoolMap(self.info)
        if self.info.require_checksum:  # its own sidecar never does; a crc per object would be another pass
            raise RuntimeError("the sidecar requires checksums: not measured by this benchmark")
        self.copier = copies.Copier(threads)
        # No other store runs beside the bench's, so every commit is explicit,
        # as for a lone store in the adapter (handoff.py).
        self.rides = CommitRides(self.stub, Handoff(), ride_ms=2)

    def store(self, keys: list[bytes], objs: list[tuple[int, int]]) -> None:
        """Store (addr, size) objects under keys; raises unless all committed."""
        task = Task("store", time.monotonic() + DEADLINE_S, len(keys))
        items = [pb.ReserveItem(key=k, size=n) for k, (_, n) in zip(keys, objs)]
        rep = self.rides.reserve(task, "", items, [])
        bad = [r.status for r in rep.reservations if r.status.code != cl.OK]
        if bad or len(rep.reservations) != len(keys):
            raise RuntimeError(f"reserve: {len(bad)} of {len(keys)} refused, first {bad[:1]}")
        # As the adapter: no copy may start so late that the reservation could
        # expire (and its pages go to another key) while it runs.
        margin = min(1.0, self.info.reservation_timeout_ms / 4000)
        late = self.pool.put_many(self.copier, [(r.location, a, n) for r, (a, n) in zip(rep.reservations, objs)],
                                  until=rep.expires_unix_ms / 1000 - margin)
        if late:
            raise RuntimeError(f"{len(late)} copies could not start before the reservation expired")
        self.pool.publish()  # every put reaches memory before the commit makes it visible
        statuses, _ = self.rides.commit(task, [r.reservation_id for r in rep.reservations], [])
        bad = [s for s in statuses if s.code != cl.OK]
        if bad:
            raise RuntimeError(f"commit: {len(bad)} of {len(keys)} failed, first {bad[0]}")

    def lock(self, keys: list[bytes]) -> list[pb.Location | None]:
        deadline = time.monotonic() + DEADLINE_S
        rep = self.stub.LookupAndLock(pb.LookupRequest(keys=keys, lock_ttl_ms=int(DEADLINE_S * 1000),
                                                       deadline_unix_ms=server_deadline(deadline)),
                                      timeout=time_left(deadline))
        return [r.location if r.found else None for r in rep.results]

    def copy_out(self, locs: list[pb.Location | None], objs: list[tuple[int, int]]) -> list[int]:
        """The adapter's `_copy_out` (without its optional crc check): the
        indices whose object was still there after the copy."""
        pool = self.pool
        todo = [i for i, (loc, (_, n)) in enumerate(zip(locs, objs))
                if loc is not None and loc.length == n and pool.still_there(loc)]
        pool.get_many(self.copier, [(objs[i][0], locs[i], locs[i].length) for i in todo])
        return [i for i in todo if pool.still_there(locs[i])]

    def unlock(self, keys: list[bytes]) -> None:
        self.stub.Unlock(pb.UnlockRequest(keys=keys), timeout=DEADLINE_S)

    def load(self, keys: list[bytes], objs: list[tuple[int, int]]) -> None:
        """Lock, copy out, unlock; raises unless every object was loaded."""
        locs = self.lock(keys)
        try:
            loaded = self.copy_out(locs, objs)
        finally:
            self.unlock(keys)
        if len(loaded) != len(keys):
            raise RuntimeError(f"load: {len(keys) - len(loaded)} of {len(keys)} objects missed")

    def delete(self, keys: list[bytes]) -> None:
        self.stub.Delete(pb.DeleteRequest(keys=keys), timeout=DEADLINE_S)

    def close(self) -> None:
        self.copier.close()
        self.channel.close()
        self.pool.close()


# ------------------------------------------------------------------ rounds

def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def stamp(objs: list[tuple[int, int]], rnd: int) -> None:
    """Make this round's sources differ from the last round's (a load that
    returned an older object's bytes would otherwise compare equal)."""
    for i, (a, _) in enumerate(objs):
        ctypes.memmove(a, struct.pack("<QQ", rnd, i), 16)


def poison(objs: list[tuple[int, int]], whole: list[int]) -> None:
    for i, (a, n) in enumerate(objs):
        if i in whole:
            ctypes.memset(a, 0xA5, n)
        else:
            ctypes.memset(a, 0xA5, min(CHECK, n))
            ctypes.memset(a + n - min(CHECK, n), 0xA5, min(CHECK, n))


_memcmp = ctypes.CDLL(None).memcmp  # in place: no copies of whole objects into bytes
_memcmp.argtypes, _memcmp.restype = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t), ctypes.c_int


def check(src: list[tuple[int, int]], dst: list[tuple[int, int]], whole: list[int]) -> None:
    for i, ((s, n), (d, _)) in enumerate(zip(src, dst)):
        k = n if i in whole else min(CHECK, n)
        if _memcmp(s, d, k) or _memcmp(s + n - k, d + n - k, k):
            raise SystemExit(f"object {i}: loaded bytes differ from the stored ones")


def run_size(path: Path, size: int, batch: int, rounds: int, bufs: dict, torch,
             gpu) -> dict[str, list[float]]:
    """Timings in seconds per round (round 0, the warm-up, not kept): the
    baselines and cxlkv over the same objects."""
    count = batch // size
    src = [(bufs["src"].addr + i * size, size) for i in range(count)]
    dst = [(bufs["dst"].addr + i * size, size) for i in range(count)]
    scratch = [(bufs["scratch"].addr + i * size, size) for i in range(count)]
    pairs = [(d, s, n) for (d, n), (s, _) in zip(scratch, src)]
    out: dict[str, list[float]] = {k: [] for k in ("memmove_st", "memmove_mt", "store", "load", "d2h", "h2d")}
    for rnd in range(rounds + 1):
        keys = [f"bench-copy/{size}/{rnd}/{i}".encode() for i in range(count)]
        whole = sorted({0, count - 1, (rnd * 7919) % count}) if rnd else list(range(count))
        stamp(src, rnd)
        poison(dst, whole)
        t = {
            "memmove_st": timed(lambda: [ctypes.memmove(d, s, n) for d, s, n in pairs]),
            "memmove_mt": timed(path.copier.run, pairs, ctypes.memmove),
            # Round 0 also claims (and prefaults) the regions the batch needs.
            "store": timed(path.store, keys, src),
            "load": timed(path.load, keys, dst),
        }
        check(src, dst, whole)
        path.delete(keys)  # the next round reuses the pages: no eviction inside a timing
        if torch is not None:  # the same bytes between the GPU and the pinned buffers
            t["d2h"] = timed(lambda: (bufs["scratch"].tensor[:count * size].copy_(gpu[:count * size],
                                                                                  non_blocking=True),
                                      torch.cuda.synchronize()))
            t["h2d"] = timed(lambda: (gpu[:count * size].copy_(bufs["src"].tensor[:count * size],
                                                              non_blocking=True), torch.cuda.synchronize()))
        if rnd:
            for k, v in t.items():
                out[k].append(v)
    return out


def spread(v: list[float]) -> str:
    return f"{statistics.median(v):.3g} ({min(v):.3g}–{max(v):.3g})"


def report(size: int, nbytes: int, t: dict[str, list[float]], gpu: bool, threads: int) -> list[str]:
    """BENCH lines for one size; returns its table row."""
    lab = label(size)
    gbps = {k: [nbytes / s / 1e9 for s in v] for k, v in t.items() if v}
    ratio = {
        "store_ratio_mt_memmove": [a / b for a, b in zip(gbps["store"], gbps["memmove_mt"])],
        "load_ratio_mt_memmove": [a / b for a, b in zip(gbps["load"], gbps["memmove_mt"])],
    }
    if gpu:  # offload is GPU→host then store; onboarding is load then host→GPU
        ratio["store_ratio_dma"] = [a / b for a, b in zip(gbps["store"], gbps["d2h"])]
        ratio["load_ratio_dma"] = [a / b for a, b in zip(gbps["load"], gbps["h2d"])]
    for k in ("memmove_st", "memmove_mt", "store", "load"):
        bench(f"copy_{k}_gbps_{lab}", statistics.median(gbps[k]))
    if gpu:
        bench(f"gpu_d2h_gbps_{lab}", statistics.median(gbps["d2h"]))
        bench(f"gpu_h2d_gbps_{lab}", statistics.median(gbps["h2d"]))
    for k, v in ratio.items():
        if "dma" not in k:
            bench(f"copy_{k}_{lab}", statistics.median(v))
        if gpu:  # the headline names: only from a run with CUDA and pinned buffers
            bench(f"gpu_{k}_{lab}", statistics.median(v))
    row = [lab, spread(gbps["memmove_st"]), f"{spread(gbps['memmove_mt'])} ({threads} thr)",
           f"{spread(gbps['store'])} ×{spread(ratio['store_ratio_mt_memmove'])}",
           f"{spread(gbps['load'])} ×{spread(ratio['load_ratio_mt_memmove'])}"]
    if gpu:
        row += [spread(ratio["store_ratio_dma"]), spread(ratio["load_ratio_dma"]), spread(gbps["d2h"]),
                spread(gbps["h2d"])]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cxlkv", help="the cxlkv binary (default target/release/cxlkv, else target/debug/cxlkv)")
    ap.add_argument("--batch-bytes", type=int, default=1 << 30, help="bytes per store/load batch (default 1 GiB)")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="object sizes in bytes")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per size (after one warm-up round)")
    ap.add_argument("--copy-threads", type=int, default=copies.default_threads(),
                    help="the adapter's copy_threads (default: its default on this host)")
    ap.add_argument("--coherence", choices=("hardware", "software"), help="the sidecar's [pool] coherence")
    ap.add_argument("--pool-dir", help="where the pool file goes (default /dev/shm, else the temp dir if "
                                       "/dev/shm is too small)")
    ap.add_argument("--no-gpu", action="store_true", help="host buffers and no DMA figures even with CUDA")
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run: 64 MiB batches, 2 rounds")
    args = ap.parse_args()
    if args.quick:
        args.batch_bytes, args.rounds = 64 << 20, 2
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.rounds < 1 or any(s <= 0 or s > args.batch_bytes for s in sizes):
        raise SystemExit("--rounds must be >= 1 and every size between 1 and --batch-bytes")
    # SIGTERM (a timeout around the run) ends through atexit: the sidecar and its pool file go too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    torch = None if args.no_gpu else _torch_cuda()
    gpu = torch.empty(args.batch_bytes, dtype=torch.uint8, device="cuda") if torch is not None else None
    bufs = {k: Buffer(args.batch_bytes, torch) for k in ("src", "dst", "scratch")}
    bufs["src"].randomize()
    # 32 MiB objects must fit a region; 256 MiB (the sidecar's default) once batches are that large.
    region = 256 << 20 if args.batch_bytes >= 256 << 20 else max(64 << 20, max(sizes))
    dirs = [args.pool_dir] if args.pool_dir else ["/dev/shm", tempfile.gettempdir()]
    side = Sidecar(find_cxlkv(args.cxlkv), dirs, args.batch_bytes, region, args.coherence)
    path = Path(side.socket, args.copy_threads)
    print(f"# pool {side.pool}, coherence {path.pool.coherence}, copy routine {cl.COPY}, "
          f"copy_threads {args.copy_threads}, buffers {'torch pinned (CUDA)' if torch else 'mmap'}, "
          f"batch {args.batch_bytes >> 20} MiB, {args.rounds} rounds", flush=True)
    rows = []
    try:
        for size in sizes:
            t = run_size(path, size, args.batch_bytes, args.rounds, bufs, torch, gpu)
            rows.append(report(size, args.batch_bytes // size * size, t, torch is not None, args.copy_threads))
    finally:
        path.close()
        side.stop()
        for b in bufs.values():
            b.close()
    bench("copy_threads", args.copy_threads)
    head = ["size", "memmove 1 thread GB/s", "memmove GB/s", "store GB/s ×memmove", "load GB/s ×memmove"]
    if torch is not None:
        head += ["store ×GPU→host", "load ×host→GPU", "GPU→host GB/s", "host→GPU GB/s"]
    print("\nmedian (min–max) over rounds; ratios per round, then the median\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
