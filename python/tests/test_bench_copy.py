"""scripts/bench_copy.py: the LMCache-free copy-path benchmark an offline GPU
host runs. Its quick mode runs here so it cannot rot, with LMCache made
unimportable (the GPU host has none); its load path is checked to refuse
objects that were gone before or went during the copy, as the adapter does;
and a stand-in torch with CUDA runs the GPU-host path (pinned buffers, DMA
figures, the `gpu_` names), which no GPU on the test VM can."""

from __future__ import annotations

import ctypes
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from cxlkv_lmcache import copies
from cxlkv_testkit import BIN, script

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_copy.py"


@pytest.fixture(scope="module")
def bench_copy():
    return script("bench_copy")


def test_quick_run_prints_every_figure_without_lmcache(tmp_path):
    # A package named lmcache that fails to import shadows the venv's: any
    # import of it on the benchmark's path ends the run.
    (tmp_path / "lmcache").mkdir()
    (tmp_path / "lmcache" / "__init__.py").write_text("raise ImportError('no LMCache on the GPU host')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--cxlkv", BIN, "--copy-threads", "2"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    figures = dict(re.findall(r"^BENCH (\S+) (\S+)$", out.stdout, re.M))
    for lab in ("2MiB", "32MiB"):
        for name in ("memmove_st_gbps", "memmove_mt_gbps", "store_gbps", "load_gbps", "store_ratio_mt_memmove",
                     "load_ratio_mt_memmove"):
            assert float(figures[f"copy_{name}_{lab}"]) > 0, name
    assert float(figures["copy_threads"]) == 2
    # The GPU-host names come only from a run with CUDA (none on the test VM).
    cuda = "torch pinned (CUDA)" in out.stdout
    assert any(k.startswith("gpu_store_ratio_dma_") for k in figures) == cuda
    # The pool file it made is gone after the run.
    pool = re.search(r"^# pool (\S+),", out.stdout, re.M).group(1)
    assert pool.startswith("/dev/shm/cxlkv-benchcopy-") and not os.path.exists(pool)


def test_load_misses_objects_gone_before_or_during_the_copy(bench_copy, tmp_path):
    size, n = 256 << 10, 4
    side = bench_copy.Sidecar(BIN, [str(tmp_path)], n * size, 2 << 20, None)
    path = bench_copy.Path(side.socket, 1)  # one copy thread: the hook below runs on this thread
    src, dst = bench_copy.Buffer(n * size), bench_copy.Buffer(n * size)
    try:
        src.randomize()
        objs = [(src.addr + i * size, size) for i in range(n)]
        into = [(dst.addr + i * size, size) for i in range(n)]
        keys = [f"k{i}".encode() for i in range(n)]

        path.store(keys, objs)
        locs = path.lock(keys)
        assert path.copy_out(locs, into) == list(range(n))
        assert ctypes.string_at(src.addr, n * size) == ctypes.string_at(dst.addr, n * size)
        path.unlock(keys)

        # Deleted (its pages freed) after the lookup, before the copy: a miss.
        path.delete(keys)
        assert path.copy_out(locs, into) == []
        with pytest.raises(RuntimeError, match="4 of 4 objects missed"):
            path.load(keys, into)

        # Deleted while its bytes are being copied: the check after the copy misses it.
        path.store(keys, objs)
        locs = path.lock(keys)

        def gone_mid_copy(event: str, _n: int) -> None:
            if event == "copy" and copies.HOOK is not None:
                copies.HOOK = None
                path.unlock(keys)
                path.delete(keys)

        copies.HOOK = gone_mid_copy
        try:
            assert path.copy_out(locs, into) == []
        finally:
            copies.HOOK = None
    finally:
        path.close()
        side.stop()
        src.close()
        dst.close()
    assert not os.path.exists(side.pool)


def test_a_batch_of_more_than_half_the_pool_is_stored_and_loaded(bench_copy, tmp_path):
    # The pool is a batch plus a region; a sidecar's default bound on one
    # client's pinned bytes is half the pool, which refused the GPU host's
    # default 1 GiB batch (reserve, then lock: the whole batch at once).
    size, n = 2 << 20, 2
    side = bench_copy.Sidecar(BIN, [str(tmp_path)], n * size, 2 << 20, None)
    path = bench_copy.Path(side.socket, 1)
    assert n * size > path.info.capacity_bytes // 2
    src, dst = bench_copy.Buffer(n * size), bench_copy.Buffer(n * size)
    try:
        src.randomize()
        keys = [f"k{i}".encode() for i in range(n)]
        path.store(keys, [(src.addr + i * size, size) for i in range(n)])
        path.load(keys, [(dst.addr + i * size, size) for i in range(n)])
        assert ctypes.string_at(src.addr, n * size) == ctypes.string_at(dst.addr, n * size)
    finally:
        path.close()
        side.stop()
        src.close()
        dst.close()


class _Tensor:
    """Just what bench_copy asks of a torch tensor, over host memory."""

    def __init__(self, n: int, base=None, addr: int = 0):
        self._base = base if base is not None else (ctypes.c_char * n)()
        self._addr = addr or ctypes.addressof(self._base)
        self._n = n

    def data_ptr(self) -> int:
        return self._addr

    def __getitem__(self, s: slice) -> "_Tensor":
        assert s.start is None and s.step is None and s.stop <= self._n
        return _Tensor(s.stop, self._base, self._addr)

    def copy_(self, other: "_Tensor", non_blocking: bool = False) -> "_Tensor":
        assert other._n == self._n
        ctypes.memmove(self._addr, other._addr, self._n)
        return self

    def random_(self, lo: int, hi: int) -> "_Tensor":
        ctypes.memmove(self._addr, os.urandom(self._n), self._n)
        return self


class _Torch:
    """A torch whose CUDA is there: the GPU-host path without a GPU."""

    uint8 = "uint8"
    cuda = type("cuda", (), {"is_available": staticmethod(lambda: True), "synchronize": staticmethod(lambda: None)})

    @staticmethod
    def empty(n: int, dtype=None, pin_memory: bool = False, device: str = "cpu") -> _Tensor:
        assert pin_memory or device == "cuda"
        return _Tensor(n)


def test_with_cuda_it_prints_the_gpu_host_figures(bench_copy, monkeypatch, capsys):
    monkeypatch.setattr(bench_copy, "_torch_cuda", lambda: _Torch)
    monkeypatch.setattr(sys, "argv", ["bench_copy.py", "--quick", "--cxlkv", BIN, "--sizes", "2097152,33554432"])
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        bench_copy.main()
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    out = capsys.readouterr().out
    figures = dict(re.findall(r"^BENCH (\S+) (\S+)$", out, re.M))
    assert "buffers torch pinned (CUDA)" in out
    for lab in ("2MiB", "32MiB"):
        for name in ("store_ratio_mt_memmove", "load_ratio_mt_memmove", "store_ratio_dma", "load_ratio_dma",
                     "d2h_gbps", "h2d_gbps"):
            assert float(figures[f"gpu_{name}_{lab}"]) > 0, name
        # The headline ratio is the host one, named for the GPU host.
        assert figures[f"gpu_store_ratio_mt_memmove_{lab}"] == figures[f"copy_store_ratio_mt_memmove_{lab}"]
