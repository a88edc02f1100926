"""GPU-direct stores and loads through the plugin's own pieces: DMA between
GPU memory and the pool's pages, with the sidecar's protocol around it, and
the RPCs of one sub-batch hidden behind the copies of another.

The pool mapping is registered with CUDA (`cxlkv_lmcache.gpu.register`, as
the in-process backend does), so a tensor over an object's pool address is
pinned memory to CUDA: the GPU's DMA engine reads and writes it directly.

  store: Reserve → DMA of each object into its reserved pages → publish →
         Commit
  load:  LookupAndLock → DMA of each object out of the pool → still_there
         (an object freed during the DMA is a miss) → Unlock

Pipelined (`--sub-batch-bytes`), a batch goes in sub-batches: while
sub-batch N's DMA runs, the Reserve (or LookupAndLock) of sub-batch N+1 is
in flight (N+`--ahead`), carrying the Commit (or the Unlock) of the
sub-batches published since the last one was sent (`commit_first`,
`unlock_first`: one round trip per sub-batch, behind a copy), and the DMA of
sub-batch N+1 is queued behind N's before N is waited for, so the link never
idles while Python handles a reply. Each sub-batch's transfers are merged
into runs (objects on consecutive pool pages, consecutive on the device: one
DMA call). Whole (the same calls, one batch after another) is the reference.

Figures per object size, medians of rounds, each a ratio to a baseline
timed in the same round: DMA between the GPU and torch pinned memory
(`pin_d2h`, `pin_h2d`); the same DMA into and out of pool views without any
RPC (`pool_d2h`, `pool_h2d`); whole and pipelined stores and loads
(`gpudirect_store_vs_pin_d2h_*`, `gpudirect_pipelined_store_vs_pin_d2h_*`,
likewise loads). Every load is compared on the GPU with what was stored.
Then a CUDA kernel reads one object through its host pointer (a CUDA tensor
over the pool address, as LMCache's GPU connector kernels read L1 objects)
and must return the stored bytes.

Without CUDA (`--cpu`, the tests) the "device" is host memory and a copy is
a memmove: the protocol, the pipelining and the byte checks run the same,
the figures mean nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_copy  # noqa: E402  (next to this script in the repository and in the bundle)

from cxlkv_lmcache import client as cl  # noqa: E402
from cxlkv_lmcache import gpu as cxgpu  # noqa: E402
from cxlkv_lmcache._proto import cxlkv_pb2 as pb  # noqa: E402
from cxlkv_lmcache.state import server_deadline, time_left  # noqa: E402

DEADLINE_S = 60.0
NOT_FOUND = 5  # google.rpc.Code


# ------------------------------------------------------------------ devices

def runs(transfers) -> list[list[int]]:
    """(device offset, host address, bytes) transfers in order, with each one
    that continues the previous one on both sides merged into it: objects
    reserved (or stored) one after another mostly sit on consecutive pool
    pages, and one DMA of a run costs one call and one setup instead of one
    per object (at 2 MiB a call's fixed cost is several percent of its
    transfer, and issuing each from Python as long as the transfer itself)."""
    out: list[list[int]] = []
    for off, addr, n in transfers:
        if out and out[-1][0] + out[-1][2] == off and out[-1][1] + out[-1][2] == addr:
            out[-1][2] += n
        else:
            out.append([off, addr, n])
    return out


class CudaDevice:
    """Objects in GPU memory; copies are DMA on one stream, in order, to and
    from slices of one host tensor over the whole pool mapping (`attach`)."""

    def __init__(self, torch, nbytes: int):
        self.torch = torch
        self.mem = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.base, self.host = 0, None

    def attach(self, base: int, size: int) -> None:
        self.base = base
        self.host = self.torch.frombuffer((ctypes.c_uint8 * size).from_address(base), dtype=self.torch.uint8)

    def fill(self) -> None:
        self.mem.random_(0, 256)

    def _at(self, addr: int, n: int):
        o = addr - self.base
        return self.host[o:o + n]

    def to_host(self, transfers) -> None:
        """DMA of each (device offset, host address, bytes) run to the host."""
        with self.torch.cuda.stream(self.stream):
            for off, addr, n in transfers:
                self._at(addr, n).copy_(self.mem[off:off + n], non_blocking=True)

    def from_host(self, transfers) -> None:
        with self.torch.cuda.stream(self.stream):
            for off, addr, n in transfers:
                self.mem[off:off + n].copy_(self._at(addr, n), non_blocking=True)

    def mark(self):
        ev = self.torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait(self, ev) -> None:
        ev.synchronize()

    def same(self, other: "CudaDevice", off: int, n: int) -> bool:
        return bool(self.torch.equal(self.mem[off:off + n], other.mem[off:off + n]))


class HostDevice:
    """The CPU stand-in: "device" memory is host memory, copies are memmove
    (synchronous, so a mark is always reached)."""

    def __init__(self, nbytes: int):
        self.buf = bench_copy.Buffer(nbytes)

    def attach(self, base: int, size: int) -> None:
        pass

    def fill(self) -> None:
        self.buf.randomize()

    def to_host(self, transfers) -> None:
        for off, addr, n in transfers:
            ctypes.memmove(addr, self.buf.addr + off, n)

    def from_host(self, transfers) -> None:
        for off, addr, n in transfers:
            ctypes.memmove(self.buf.addr + off, addr, n)

    def mark(self):
        return None

    def wait(self, ev) -> None:
        pass

    def same(self, other: "HostDevice", off: int, n: int) -> bool:
        return ctypes.string_at(self.buf.addr + off, n) == ctypes.string_at(other.buf.addr + off, n)


# ------------------------------------------------------------------ protocol

def _check(statuses, what: str) -> None:
    bad = [s for s in statuses if s.code != cl.OK]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} of {len(statuses)} failed, first {bad[0]}")


class Direct:
    """GPU-direct stores of `size`-byte objects at offsets i * size of
    device memory `src`, and loads into the same offsets of `dst`, over
    bench_copy's connection and pool mapping."""

    def __init__(self, path: bench_copy.Path, src, dst, size: int, ahead: int = 1):
        self.stub, self.pool, self.src, self.dst, self.size = path.stub, path.pool, src, dst, size
        self.ahead = max(1, ahead)  # sub-batches whose Reserve (LookupAndLock) is in flight beyond the copying one
        self.dmas = self.objects = 0  # DMA calls issued (runs merged), objects they moved
        # Seconds spent, per sub-batch, blocked on its reply, issuing its
        # DMA, and waiting for the DMA: where a pipelined batch's time goes.
        self.phases = {"reply": 0.0, "issue": 0.0, "dma": 0.0, "parts": 0}

    def _reserve(self, keys: list[bytes], commit_first: list[int]):
        """The Reserve in flight; `.result()` waits for it and checks it."""
        deadline = time.monotonic() + DEADLINE_S
        items = [pb.ReserveItem(key=k, size=self.size) for k in keys]
        fut = self.stub.Reserve.future(pb.ReserveRequest(items=items, commit_first=commit_first,
                                                         deadline_unix_ms=server_deadline(deadline)),
                                       timeout=time_left(deadline))

        def result() -> pb.ReserveReply:
            rep = fut.result()
            _check(rep.commit_statuses, "commit")
            _check([r.status for r in rep.reservations], "reserve")
            return rep
        return result

    def _lookup(self, keys: list[bytes], unlock_first: list[bytes]):
        deadline = time.monotonic() + DEADLINE_S
        fut = self.stub.LookupAndLock.future(pb.LookupRequest(keys=keys, unlock_first=unlock_first,
                                                              lock_ttl_ms=int(DEADLINE_S * 1000),
                                                              deadline_unix_ms=server_deadline(deadline)),
                                             timeout=time_left(deadline))

        def result() -> pb.LookupReply:
            rep = fut.result()
            # A key gone meanwhile (evicted, deleted) holds no lock to release.
            _check([s for s in rep.unlock_statuses if s.code != NOT_FOUND], "unlock")
            return rep
        return result

    def _timed(self, phase: str, t: float) -> float:
        now = time.perf_counter()
        self.phases[phase] += now - t
        return now

    def _pipelined(self, parts: list[list[int]], dev, send, issue, retire) -> None:
        """The pipeline stores and loads share. The calls of the first
        `ahead` sub-batches are sent at once (`send(k)` returns a call in
        flight, carrying what was retired since the last send); as each
        reply comes in, its sub-batch's DMA is issued (`issue(part, reply)`
        returns the DMA's event and what `retire` needs), the call of the
        sub-batch `ahead` further on is sent, and the sub-batch before it is
        retired once its DMA is done: two DMAs are queued at a time, so the
        link never waits for Python between them."""
        inflight = [send(k) for k in range(min(self.ahead, len(parts)))]
        queued: list = []  # (DMA done event, what `retire` takes) per sub-batch

        def retire_first() -> None:
            ev, what = queued.pop(0)
            t = time.perf_counter()
            dev.wait(ev)
            self._timed("dma", t)
            retire(what)

        for j, part in enumerate(parts):
            t = time.perf_counter()
            rep = inflight.pop(0)()
            t = self._timed("reply", t)
            queued.append(issue(part, rep))
            if j + self.ahead < len(parts):  # in flight while the DMAs run
                inflight.append(send(j + self.ahead))
            self._timed("issue", t)
            self.phases["parts"] += 1
            if len(queued) > 1:
                retire_first()
        while queued:
            retire_first()

    def store(self, keys: list[bytes], first: int, sub: int) -> None:
        """Objects first.. of the device under `keys`, in sub-batches of
        `sub` (the whole batch when sub >= len(keys)); raises unless every
        one was committed. Each Reserve carries the commits of the
        sub-batches published since the last one was sent."""
        parts = [list(range(i, min(i + sub, len(keys)))) for i in range(0, len(keys), sub)]
        done: list[int] = []  # reservation ids copied and published, not yet committed

        def send(k: int):
            ride = done[:]
            done.clear()
            return self._reserve([keys[i] for i in parts[k]], ride)

        def issue(part: list[int], rep: pb.ReserveReply):
            dma = runs([((first + i) * self.size, self.pool.addr(r.location), self.size)
                        for i, r in zip(part, rep.reservations)])
            self.dmas, self.objects = self.dmas + len(dma), self.objects + len(part)
            self.src.to_host(dma)
            return self.src.mark(), [r.reservation_id for r in rep.reservations]

        def retire(ids: list[int]) -> None:
            self.pool.publish()
            done.extend(ids)

        self._pipelined(parts, self.src, send, issue, retire)
        _check(self.stub.Commit(pb.CommitRequest(reservation_ids=done), timeout=DEADLINE_S).statuses, "commit")

    def load(self, keys: list[bytes], first: int, sub: int) -> list[int]:
        """Load `keys` into objects first.. of the device; the indices
        loaded (still there after their DMA), all locks released. Each
        LookupAndLock carries the unlocks of the sub-batches checked since
        the last one was sent."""
        parts = [list(range(i, min(i + sub, len(keys)))) for i in range(0, len(keys), sub)]
        loaded: list[int] = []
        locked: list[bytes] = []  # keys whose DMA is done and checked, lock not yet released

        def send(k: int):
            ride = locked[:]
            locked.clear()
            return self._lookup([keys[i] for i in parts[k]], ride)

        def issue(part: list[int], rep: pb.LookupReply):
            todo = [(i, r.location) for i, r in zip(part, rep.results)
                    if r.found and r.location.length == self.size and self.pool.still_there(r.location)]
            dma = runs([((first + i) * self.size, self.pool.addr(loc), self.size) for i, loc in todo])
            self.dmas, self.objects = self.dmas + len(dma), self.objects + len(todo)
            self.dst.from_host(dma)
            return self.dst.mark(), (todo, [keys[i] for i, r in zip(part, rep.results) if r.found])

        def retire(what) -> None:
            todo, held = what
            loaded.extend(i for i, loc in todo if self.pool.still_there(loc))
            locked.extend(held)

        self._pipelined(parts, self.dst, send, issue, retire)
        if locked:
            self.stub.Unlock(pb.UnlockRequest(keys=locked), timeout=DEADLINE_S)
        return loaded


# ------------------------------------------------------------ a kernel's read

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


KDLCPU, KDLCUDA = 1, 2
_KEEP: list = []  # the DLPack structs outlive the tensors made over them (a few per run)


def view(torch, addr: int, n: int, cuda: bool):
    """A uint8 tensor of `n` bytes at host address `addr` (no copy): with
    `cuda`, a CUDA tensor, which kernels read through the host pointer
    (the pool mapping is registered with CUDA; with unified addressing a
    registered host pointer is valid on the device)."""
    shape = (ctypes.c_int64 * 1)(n)
    m = _DLManagedTensor()
    m.dl_tensor = _DLTensor(data=addr, device=_DLDevice(KDLCUDA if cuda else KDLCPU, 0), ndim=1,
                            dtype=_DLDataType(1, 8, 1), shape=shape, strides=None, byte_offset=0)
    _KEEP.append((m, shape))
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    return torch.utils.dlpack.from_dlpack(new(ctypes.addressof(m), b"dltensor", None))


def kernel_reads_the_stored_bytes(torch, path: bench_copy.Path, key: bytes, want, cuda: bool) -> bool:
    """Lock `key`, run a kernel (a comparison) over its pool view against
    `want` (a tensor of the stored bytes on the same device), unlock."""
    loc = path.lock([key])[0]
    try:
        if loc is None:
            return False
        got = view(torch, path.pool.addr(loc), loc.length, cuda)
        same = bool(torch.equal(got, want))
        return same and path.pool.still_there(loc)
    finally:
        path.unlock([key])


# ------------------------------------------------------------------ rounds

def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def run_size(path, src, dst, size: int, count: int, sub: int, rounds: int, torch, pinned,
             ahead: int = 1) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per round (round 0 warms up and is not kept), and the
    pipelined store's and load's ms per sub-batch in each phase."""
    d = Direct(path, src, dst, size, ahead)
    out: dict[str, list[float]] = {}
    phases: dict[str, list[float]] = {}
    sync = torch.cuda.synchronize if torch is not None else (lambda: None)
    for rnd in range(rounds + 1):
        t: dict[str, float] = {}
        for mode, s in (("whole", count), ("pipelined", sub)):
            keys = [f"gpu-direct/{size}/{rnd}/{mode}/{i}".encode() for i in range(count)]
            got: list[int] = []
            for what, op in (("store", lambda: d.store(keys, 0, s)), ("load", lambda: got.extend(d.load(keys, 0, s)))):
                d.phases = dict.fromkeys(d.phases, 0)
                t[f"{what}_{mode}"] = timed(op)
                if rnd and mode == "pipelined":
                    for k in ("reply", "issue", "dma"):
                        phases.setdefault(f"{what}_{k}", []).append(d.phases[k] * 1e3 / max(1, d.phases["parts"]))
            if sorted(got) != list(range(count)):
                raise SystemExit(f"{mode} load: {count - len(got)} of {count} objects missed")
            for i in range(count):
                if not dst.same(src, i * size, size):
                    raise SystemExit(f"{mode} load of object {i}: bytes differ from the stored ones")
            path.delete(keys)
        if pinned is not None:
            t.update(raw_dma(path, d, src, dst, pinned, size, count, rnd, sync))
        if rnd:
            for k, v in t.items():
                out.setdefault(k, []).append(v)
    bench_copy.bench(f"gpudirect_dma_calls_per_object_{bench_copy.label(size)}", d.dmas / max(1, d.objects))
    return out, phases


def raw_dma(path, d: Direct, src, dst, pinned, size: int, count: int, rnd: int, sync) -> dict[str, float]:
    """The same bytes between the GPU and pinned memory, and between the
    GPU and reserved pool pages with no RPC in the timing."""
    n, t = count * size, {}
    t["pin_d2h"] = timed(lambda: (pinned.tensor[:n].copy_(src.mem[:n], non_blocking=True), sync()))
    t["pin_h2d"] = timed(lambda: (dst.mem[:n].copy_(pinned.tensor[:n], non_blocking=True), sync()))
    rep = d._reserve([f"gpu-direct/{size}/{rnd}/raw/{i}".encode() for i in range(count)], [])()
    dma = runs([(i * size, path.pool.addr(r.location), size) for i, r in enumerate(rep.reservations)])
    t["pool_d2h"] = timed(lambda: (src.to_host(dma), sync()))
    t["pool_h2d"] = timed(lambda: (dst.from_host(dma), sync()))
    path.stub.Abort(pb.AbortRequest(reservation_ids=[r.reservation_id for r in rep.reservations]),
                    timeout=DEADLINE_S)
    return t


def report(size: int, t: dict[str, list[float]], nbytes: int, phases: dict[str, list[float]]) -> None:
    lab = bench_copy.label(size)
    # Where a pipelined sub-batch's time goes: blocked on its reply (the RPC
    # not hidden), issuing its DMA, waiting for the DMA (the link busy).
    for k, v in sorted(phases.items()):
        bench_copy.bench(f"gpudirect_pipelined_{k}_ms_per_sub_batch_{lab}", statistics.median(v))
    gbps = {k: [nbytes / s / 1e9 for s in v] for k, v in t.items()}
    for k, v in sorted(gbps.items()):
        bench_copy.bench(f"gpudirect_{k}_gbps_{lab}", statistics.median(v))
    if "pin_d2h" not in gbps:
        return
    for mode in ("whole", "pipelined"):
        tag = "" if mode == "whole" else "pipelined_"
        for what, base in (("store", "pin_d2h"), ("load", "pin_h2d")):
            r = [a / b for a, b in zip(gbps[f"{what}_{mode}"], gbps[base])]
            bench_copy.bench(f"gpudirect_{tag}{what}_vs_{base}_{lab}", statistics.median(r))
    for a, b in (("pool_d2h", "pin_d2h"), ("pool_h2d", "pin_h2d")):
        bench_copy.bench(f"gpudirect_{a}_vs_{b}_{lab}", statistics.median(
            [x / y for x, y in zip(gbps[a], gbps[b])]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cxlkv", help="the cxlkv binary (default target/release/cxlkv, else target/debug/cxlkv)")
    ap.add_argument("--batch-bytes", type=int, default=1 << 30, help="bytes per store/load batch (default 1 GiB)")
    ap.add_argument("--sizes", default="2097152,33554432", help="object sizes in bytes")
    ap.add_argument("--sub-batch-bytes", type=int, default=64 << 20,
                    help="bytes per pipelined sub-batch (default 64 MiB)")
    ap.add_argument("--ahead", type=int, default=1,
                    help="sub-batches whose Reserve (LookupAndLock) is in flight beyond the one copying (default 1)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per size (after one warm-up round)")
    ap.add_argument("--pool-dir", help="where the pool file goes (default /dev/shm)")
    ap.add_argument("--cpu", action="store_true", help="no GPU: host memory stands for it (checks, no figures)")
    ap.add_argument("--quick", action="store_true", help="seconds-long check: 64 MiB batches of 16 MiB "
                                                         "sub-batches, 2 rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch_bytes, args.sub_batch_bytes, args.rounds = 64 << 20, 16 << 20, 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch = None if args.cpu else bench_copy._torch_cuda()
    if torch is None and not args.cpu:
        print("# no CUDA here: GPU-direct figures skipped (--cpu runs the protocol with host memory)")
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    region = 256 << 20 if args.batch_bytes >= 256 << 20 else max(64 << 20, max(sizes))
    dirs = [args.pool_dir] if args.pool_dir else ["/dev/shm", tempfile.gettempdir()]
    side = bench_copy.Sidecar(bench_copy.find_cxlkv(args.cxlkv), dirs, args.batch_bytes, region, None)
    path = bench_copy.Path(side.socket, 1)
    registered = torch is not None and cxgpu.register(path.pool.base, path.pool.size)
    make = (lambda: CudaDevice(torch, args.batch_bytes)) if torch is not None else (
        lambda: HostDevice(args.batch_bytes))
    src, dst = make(), make()
    for dev in (src, dst):
        dev.attach(path.pool.base, path.pool.size)
    pinned = bench_copy.Buffer(args.batch_bytes, torch) if torch is not None else None
    print(f"# pool {side.pool} ({path.pool.size >> 20} MiB) registered with CUDA: {registered}; batch "
          f"{args.batch_bytes >> 20} MiB, sub-batches {args.sub_batch_bytes >> 20} MiB, {args.ahead} ahead, "
          f"{args.rounds} rounds",
          flush=True)
    try:
        src.fill()
        for size in sizes:
            count = args.batch_bytes // size
            sub = max(1, args.sub_batch_bytes // size)
            t, phases = run_size(path, src, dst, size, count, sub, args.rounds, torch, pinned, args.ahead)
            report(size, t, count * size, phases)
        # A kernel reads an object through its host pointer and finds the stored bytes.
        import torch as th  # the CPU stand-in compares with a CPU "kernel"

        key, size = b"gpu-direct/kernel", sizes[0]
        Direct(path, src, dst, size).store([key], 0, 1)
        want = src.mem[:size] if torch is not None else th.frombuffer(
            (ctypes.c_uint8 * size).from_address(src.buf.addr), dtype=th.uint8)
        ok = kernel_reads_the_stored_bytes(th, path, key, want, torch is not None)
        bench_copy.bench("gpudirect_kernel_reads_pool_view", float(ok))
        if not ok:
            raise SystemExit("a kernel reading the pool view through its host pointer did not find the stored bytes")
    finally:
        if registered:
            cxgpu.unregister(path.pool.base)
        path.close()
        side.stop()


if __name__ == "__main__":
    main()
