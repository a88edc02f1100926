"""scripts/bench_copy.py: the LMCache-free copy-path benchmark an offline GPU
host runs. Its quick mode runs here so it cannot rot, with LMCache made
unimportable (the GPU host has none), and its load path is checked to refuse
objects that were gone before or went during the copy, as the adapter does."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from cxlkv_lmcache import copies
from cxlkv_testkit import BIN

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_copy.py"


@pytest.fixture(scope="module")
def bench_copy():
    spec = importlib.util.spec_from_file_location("bench_copy", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
