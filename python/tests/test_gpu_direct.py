"""scripts/bench_gpu_direct.py: GPU-direct stores and loads with their RPCs
pipelined behind the copies. No GPU here: host memory stands for the
device (its copies are memmoves), so what runs is the protocol, the
pipelining (which call carries which commit or unlock) and the byte checks;
the figures wait for a GPU host."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import torch

from cxlkv_testkit import BIN, script

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_gpu_direct.py"


@pytest.fixture(scope="module")
def gd():
    return script("bench_gpu_direct")


class Counting:
    """A stub that counts the calls made through it and what rode on them."""

    def __init__(self, stub):
        self._stub, self.calls, self.rides = stub, [], []

    def _count(self, name, req):
        self.calls.append(name)
        self.rides.append(len(getattr(req, "commit_first", [])) + len(getattr(req, "unlock_first", [])))

    def __getattr__(self, name):
        outer = self

        class Method:
            def __call__(self, req, **kw):
                outer._count(name, req)
                return getattr(outer._stub, name)(req, **kw)

            def future(self, req, **kw):
                outer._count(name, req)
                return getattr(outer._stub, name).future(req, **kw)

        return Method()


@pytest.fixture
def setup(gd, tmp_path):
    size, n = 256 << 10, 16
    side = gd.bench_copy.Sidecar(BIN, [str(tmp_path)], n * size, 2 << 20, None)
    path = gd.bench_copy.Path(side.socket, 1)
    src, dst = gd.HostDevice(n * size), gd.HostDevice(n * size)
    src.fill()
    yield gd, path, src, dst, size, n
    path.close()
    side.stop()


def test_a_pipelined_batch_is_one_call_per_sub_batch_and_loads_the_stored_bytes(setup):
    gd, path, src, dst, size, n = setup
    path.stub = stub = Counting(path.stub)
    d = gd.Direct(path, src, dst, size)
    keys = [f"k{i}".encode() for i in range(n)]
    d.store(keys, 0, 4)  # four sub-batches
    # A Reserve per sub-batch. Two DMAs are queued at a time, so a sub-batch
    # is published once the next one's DMA is queued and its Reserve sent:
    # the 4th Reserve carries the 1st's commit; the 2nd to 4th commit together.
    assert stub.calls == ["Reserve"] * 4 + ["Commit"]
    assert stub.rides == [0, 0, 0, 4, 0]
    stub.calls.clear()
    stub.rides.clear()
    assert sorted(d.load(keys, 0, 4)) == list(range(n))
    assert stub.calls == ["LookupAndLock"] * 4 + ["Unlock"]
    assert stub.rides == [0, 0, 0, 4, 0]
    for i in range(n):
        assert dst.same(src, i * size, size), i
    # Every lock was released: the keys can be deleted.
    assert all(s.code == 0 for s in path.stub.Delete(gd.pb.DeleteRequest(keys=keys), timeout=10).statuses)


def test_two_ahead_sends_two_reserves_before_the_first_copy_and_rides_the_rest(setup):
    gd, path, src, dst, size, n = setup
    path.stub = stub = Counting(path.stub)
    d = gd.Direct(path, src, dst, size, ahead=2)
    keys = [f"a{i}".encode() for i in range(n)]
    d.store(keys, 0, 2)  # eight sub-batches, two Reserves in flight beyond the one copying
    # Reserves 5..8 each carry the commit of the sub-batch published just
    # before they were sent (sub-batches 1..4; the first four Reserves had
    # nothing published to carry); the last four commit together (a Commit
    # carries nothing itself).
    assert stub.calls == ["Reserve"] * 8 + ["Commit"]
    assert stub.rides == [0, 0, 0, 0, 2, 2, 2, 2, 0]
    stub.calls.clear()
    stub.rides.clear()
    assert sorted(d.load(keys, 0, 2)) == list(range(n))
    assert stub.calls == ["LookupAndLock"] * 8 + ["Unlock"]
    assert stub.rides == [0, 0, 0, 0, 2, 2, 2, 2, 0]
    for i in range(n):
        assert dst.same(src, i * size, size), i
    assert all(s.code == 0 for s in path.stub.Delete(gd.pb.DeleteRequest(keys=keys), timeout=10).statuses)


def test_whole_is_the_same_calls_without_riding(setup):
    gd, path, src, dst, size, n = setup
    path.stub = stub = Counting(path.stub)
    d = gd.Direct(path, src, dst, size)
    keys = [f"w{i}".encode() for i in range(n)]
    d.store(keys, 0, n)
    assert sorted(d.load(keys, 0, n)) == list(range(n))
    assert stub.calls == ["Reserve", "Commit", "LookupAndLock", "Unlock"]


def test_a_pipelined_load_misses_objects_freed_during_their_copy(setup):
    gd, path, src, dst, size, n = setup
    d = gd.Direct(path, src, dst, size)
    keys = [f"f{i}".encode() for i in range(n)]
    d.store(keys, 0, 4)

    class FreedMidCopy(gd.HostDevice):
        """The second sub-batch's objects are deleted once their copy began
        (as if evicted while the DMA ran): their bytes may be anything."""

        def from_host(self, transfers):
            super().from_host(transfers)
            if any(off == 4 * size for off, _, _ in transfers):
                path.stub.Unlock(gd.pb.UnlockRequest(keys=keys[4:8]), timeout=10)
                path.stub.Delete(gd.pb.DeleteRequest(keys=keys[4:8]), timeout=10)

    d.dst = FreedMidCopy(n * size)
    got = d.load(keys, 0, 4)
    assert sorted(got) == [i for i in range(n) if not 4 <= i < 8]


def test_transfers_that_continue_each_other_on_both_sides_become_one_dma(gd):
    mib = 1 << 20
    # Consecutive on the device and in the pool: one run.
    assert gd.runs([(0, 100 * mib, mib), (mib, 101 * mib, mib), (2 * mib, 102 * mib, mib)]) == [[0, 100 * mib, 3 * mib]]
    # A gap in the pool, or on the device, or the pool going backwards: separate runs.
    assert gd.runs([(0, 100 * mib, mib), (mib, 102 * mib, mib)]) == [[0, 100 * mib, mib], [mib, 102 * mib, mib]]
    assert gd.runs([(0, 100 * mib, mib), (2 * mib, 101 * mib, mib)]) == [[0, 100 * mib, mib], [2 * mib, 101 * mib, mib]]
    assert gd.runs([(0, 101 * mib, mib), (mib, 100 * mib, mib)]) == [[0, 101 * mib, mib], [mib, 100 * mib, mib]]
    assert gd.runs([]) == []


def test_a_batch_on_consecutive_pages_moves_in_fewer_dmas_and_scattered_pages_keep_their_bytes(setup):
    gd, path, src, dst, size, n = setup
    d = gd.Direct(path, src, dst, size)
    keys = [f"c{i}".encode() for i in range(n)]
    d.store(keys, 0, n)
    assert d.objects == n and d.dmas < n  # a fresh pool places a batch on consecutive pages
    # Every other object deleted and another batch stored into the holes:
    # its pages are not consecutive, and each object still loads its own bytes.
    path.delete(keys[::2])
    holes = [f"h{i}".encode() for i in range(n // 2)]
    d.store(holes, 0, n // 2)
    d.dmas = d.objects = 0
    assert sorted(d.load(holes + keys[1::2], 0, n)) == list(range(n))
    assert d.objects == n and d.dmas > 1
    for i, k in enumerate(holes):
        assert dst.same(src, i * size, size), k
    for j in range(n // 2):  # keys[1::2] stored from objects 1, 3, 5..., loaded into n//2 + j
        assert gd.ctypes.string_at(dst.buf.addr + (n // 2 + j) * size, size) == \
            gd.ctypes.string_at(src.buf.addr + (2 * j + 1) * size, size), j


def test_a_kernel_view_of_a_pool_object_reads_its_bytes(setup):
    gd, path, src, dst, size, n = setup
    gd.Direct(path, src, dst, size).store([b"kv"], 0, 1)
    want = torch.frombuffer(bytearray(gd.ctypes.string_at(src.buf.addr, size)), dtype=torch.uint8)
    assert gd.kernel_reads_the_stored_bytes(torch, path, b"kv", want, cuda=False)
    other = want.clone()
    other[size // 2] ^= 1
    assert not gd.kernel_reads_the_stored_bytes(torch, path, b"kv", other, cuda=False)
    # A key that is not there: no view, no bytes.
    assert not gd.kernel_reads_the_stored_bytes(torch, path, b"absent", want, cuda=False)


def test_the_cpu_run_checks_every_load_and_the_kernel_read(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--quick", "--cxlkv", BIN, "--pool-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    figures = dict(re.findall(r"^BENCH (\S+) (\S+)$", out.stdout, re.M))
    for lab in ("2MiB", "32MiB"):
        for name in ("store_whole", "store_pipelined", "load_whole", "load_pipelined"):
            assert float(figures[f"gpudirect_{name}_gbps_{lab}"]) > 0
    assert figures["gpudirect_kernel_reads_pool_view"] == "1.0000"


def test_without_cuda_and_without_cpu_it_says_so_and_skips(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--cxlkv", BIN], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "no CUDA here" in out.stdout, out.stdout + out.stderr
