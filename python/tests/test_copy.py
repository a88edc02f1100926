"""The copy routine that moves bytes between LMCache buffers and the pool."""

import ctypes
import os
import platform

import pytest

from cxlkv_lmcache import client as cl

MIN = getattr(__import__("cxlkv_lmcache._copy", fromlist=["STREAM_MIN"]), "STREAM_MIN", 512 << 10)
# store()'s streaming threshold (software coherence).
SMIN = getattr(__import__("cxlkv_lmcache._copy", fromlist=["STORE_STREAM_MIN"]), "STORE_STREAM_MIN", 256)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="streaming stores are x86-64 only")
def test_the_streaming_copy_is_built():
    # A silent fallback to ctypes.memmove would lose ~1/3 of store/load speed.
    assert cl.COPY.startswith("streaming"), cl.COPY


@pytest.mark.parametrize("n", [0, 1, 127, 128, 4095, MIN - 1, MIN, MIN + 1, MIN + 129, (3 << 20) + 13])
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (1, 0), (0, 3), (64, 17), (127, 127), (96, 1)])
def test_copy_is_exact_at_every_size_and_alignment(n, dst_off, src_off):
    guard = 256
    src = ctypes.create_string_buffer(os.urandom(n + src_off + guard), n + src_off + guard)
    dst = ctypes.create_string_buffer(b"\xa5" * (n + dst_off + 2 * guard), n + dst_off + 2 * guard)
    cl.copy(ctypes.addressof(dst) + guard + dst_off, ctypes.addressof(src) + src_off, n)
    out = dst.raw
    assert out[guard + dst_off:guard + dst_off + n] == src.raw[src_off:src_off + n]
    assert out[:guard + dst_off] == b"\xa5" * (guard + dst_off), "wrote before the destination"
    assert out[guard + dst_off + n:] == b"\xa5" * (len(out) - guard - dst_off - n), "wrote past the destination"


def test_bad_arguments_are_refused():
    buf = ctypes.create_string_buffer(16)
    with pytest.raises(ValueError):
        cl.copy(ctypes.addressof(buf), ctypes.addressof(buf), -1)
    with pytest.raises(ValueError):
        cl.copy(0, ctypes.addressof(buf), 8)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="cache-line flushes are x86-64 only")
def test_the_flush_routine_is_the_best_the_cpu_has():
    flags = open("/proc/cpuinfo").read().split()
    want = "clwb" if "clwb" in flags else "clflushopt" if "clflushopt" in flags else "clflush"
    assert cl.FLUSH == want


@pytest.mark.skipif(cl.FLUSH is None, reason="built without cache-line flushes")
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 129, SMIN - 1, SMIN, SMIN + 1, SMIN + 127, 4095, 65536 + 3,
                               MIN - 1, MIN, MIN + 129, (3 << 20) + 13])
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (1, 0), (63, 17), (96, 1), (127, 0)])
def test_store_and_invalidate_keep_bytes_exact(n, dst_off, src_off):
    """store() (copy, then write back the lines plain stores wrote) copies the
    same bytes as copy(), writes nowhere else; invalidate() changes nothing."""
    from cxlkv_lmcache import _copy

    guard = 256
    src = ctypes.create_string_buffer(os.urandom(n + src_off + guard), n + src_off + guard)
    dst = ctypes.create_string_buffer(b"\xa5" * (n + dst_off + 2 * guard), n + dst_off + 2 * guard)
    at = ctypes.addressof(dst) + guard + dst_off
    _copy.store(at, ctypes.addressof(src) + src_off, n)
    _copy.fence()
    _copy.invalidate(at, n)
    out = dst.raw
    assert out[guard + dst_off:guard + dst_off + n] == src.raw[src_off:src_off + n]
    assert out[:guard + dst_off] == b"\xa5" * (guard + dst_off), "wrote before the destination"
    assert out[guard + dst_off + n:] == b"\xa5" * (len(out) - guard - dst_off - n), "wrote past the destination"
    with pytest.raises(ValueError):
        _copy.invalidate(0, 8)
    with pytest.raises(ValueError):
        _copy.store(at, 0, 8)


@pytest.mark.skipif(cl.FLUSH is None, reason="built without cache-line flushes")
@pytest.mark.parametrize("n", [0, 1, 64, 129, SMIN - 1, SMIN, SMIN + 1, 4096 + 13, 65536, 100_003, MIN + 129])
@pytest.mark.parametrize("align", [0, 1, 63, 64, 127])
def test_store_streams_and_writes_back_every_plain_line(n, align):
    """The steps store() takes (the same routine, recording): the stores and
    streams cover every byte once; streams are whole aligned blocks (they
    bypass the cache); every line a plain store touched is written back (the
    write-backs must cover it); from STORE_STREAM_MIN on, at any size, the
    whole blocks are streamed; store() leaves the fence to the batch's
    fence(); copy() (hardware coherence) fences its own streams instead."""
    from cxlkv_lmcache import _copy

    dst = 0x10000 + align
    steps = _copy.plan(dst, n, True)
    written = sorted((at, k, step) for step, at, k in steps if step in ("store", "stream"))
    pos = 0
    for at, k, step in written:
        assert at == pos, steps
        pos += k
        if step == "stream":
            assert (dst + at) % 128 == 0 and k % 128 == 0, steps
    assert pos == n, steps
    covered = set()
    for step, at, k in steps:
        if step == "write_back":
            covered.update(range((dst + at) // 64, (dst + at + k + 63) // 64))
    for at, k, step in written:
        if step == "store":
            assert set(range((dst + at) // 64, (dst + at + k + 63) // 64)) <= covered, f"a plain line not written back: {steps}"
    streamed = sum(k for at, k, step in written if step == "stream")
    assert streamed == (0 if n < SMIN else (n - (-dst % 128 if -dst % 128 < n else n)) // 128 * 128), steps
    assert "fence" not in [s for s, _, _ in steps]
    hw = _copy.plan(dst, n, False)
    assert ("fence" in [s for s, _, _ in hw]) == any(s == "stream" for s, _, _ in hw)
    assert not any(s == "write_back" for s, _, _ in hw), "the hardware-coherence copy writes nothing back"
