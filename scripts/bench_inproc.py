"""Time cxlkv under LMCache's in-process engine, through LMCache's own
StorageManager (its class, on CPU) with its LocalCPUBackend as L1, and the
same workload with LMCache's Redis remote connector instead, and with its
Mooncake Store connector (`mooncakestore://`, TCP transport, the store's
memory in a standalone `mooncake_client` process beside a `mooncake_master`
with its embedded HTTP metadata server). Called by scripts/bench.py; prints
`BENCH <name> <value>` lines.

Each round, for a batch of chunks of one size (the engine's KV layout chosen
so a full chunk has that size):

- store: `StorageManager.batched_put` of L1 chunks until the tier says each
  is stored (cxlkv: LMCache copies each chunk into pages reserved in the
  pool, then the backend commits; Redis and Mooncake: LMCache's
  RemoteBackend sends it through the connector),
  next to a memcpy of the same bytes in the same process (cxlkv: once
  committed, the store leases pages for the next one in the background;
  that is waited for, untimed, before the hits below are timed);
- L1 hit, as vLLM's engine takes one: a lookup that pins what it finds
  (`batched_contains(pin=True)`, at scheduling, not timed), then the timed
  retrieve: `batched_get` from LMCache's L1 and a read of every chunk into a
  destination buffer (what a GPU connector does with a hit, here into CPU
  memory);
- tier hit: L1 cleared, then the same pinned lookup and timed retrieve from
  cxlkv (the objects are views of the pool sharing the lookup's locks: the
  read is the only copy) or from Redis or Mooncake (RemoteBackend's get
  into an L1 buffer, then the read).

Every chunk read back is compared with what was stored. With CUDA present,
the read goes to the GPU instead and is compared with a read of the same
bytes from pinned host memory (`inproc_gpu_load_vs_pinned_*`).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import statistics
import threading
import time

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.pin_monitor import PinMonitor
from lmcache.v1.storage_backend.storage_manager import StorageManager

TOKENS = 256
# (layers, heads, head size) per chunk size: layers*2*256*heads*head*2 bytes in bf16.
GEOMETRY = {256 << 10: (1, 1, 256), 2 << 20: (2, 4, 256), 32 << 20: (8, 16, 256)}


def label(size: int) -> str:
    return f"{size >> 20}MiB" if size >= 1 << 20 else f"{size >> 10}KiB"


def bench(name: str, value: float) -> None:
    print(f"BENCH {name} {value:.4f}", flush=True)


def mooncake_extra(master: str, metadata: str, timeout_s: int = 60, segment: int = 0) -> dict:
    """LMCache's Mooncake Store connector settings (extra_config), as its
    documentation gives them for TCP: zero-copy mode (no chunk metadata in
    the store; LMCache's L1 is the transfer buffer), synchronous lookups.
    With `segment` 0 this engine contributes no memory to the store: every
    object goes to the standalone store process (`mooncake_client`), as it
    would to a store on other hosts; otherwise it contributes `segment`
    bytes and prefers them (`mooncake_prefer_local_alloc`, the LMCache
    documentation's per-worker setup): objects stay in this process, and a
    hit on this host is a local copy. Mooncake 0.3.13's dict-based setup reads the
    master as `master_server_addr`, which LMCache forwards from the
    `mooncake_`-prefixed key (the legacy `master_server_address` is kept for
    older builds' positional setup)."""
    return {"use_exists_sync": True, "save_chunk_meta": False, "local_hostname": "127.0.0.1",
            "metadata_server": metadata, "protocol": "tcp", "device_name": "",
            "master_server_address": master, "mooncake_master_server_addr": master,
            "global_segment_size": segment, "local_buffer_size": 0, "transfer_timeout": timeout_s,
            **({"mooncake_prefer_local_alloc": True} if segment else {})}


def engine(kind: str, size: int, batch: int, target: str, metadata: str = "", segment: int = 0):
    layers, heads, head = GEOMETRY[size]
    meta = LMCacheMetadata(model_name="bench/model", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(layers, 2, TOKENS, heads, head),
                           chunk_size=TOKENS)
    l1_gb = size * batch * 3 / (1 << 30) + 0.05
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=TOKENS, local_cpu=True, max_local_cpu_size=l1_gb,
                                            lmcache_instance_id=f"bench-{kind}-{size}")
    if kind == "cxlkv":
        cfg.storage_plugins = ["cxlkv"]
        cfg.extra_config = {"storage_plugin.cxlkv.module_path": "cxlkv_lmcache.backend",
                            "storage_plugin.cxlkv.class_name": "CxlKvBackend",
                            "cxlkv.socket": target, "cxlkv.deadline_ms": 60000}
        name = "cxlkv"
    elif kind == "mooncake":
        cfg.remote_url = f"mooncakestore://{target}/"
        cfg.remote_serde = "naive"
        cfg.extra_config = mooncake_extra(target, metadata, segment=segment)
        name = "RemoteBackend"
    else:
        cfg.remote_url = f"redis://{target}"
        cfg.remote_serde = "naive"
        name = "RemoteBackend"
    PinMonitor.GetOrCreate(cfg)  # as LMCacheEngine sets it up: a pinned lookup needs it
    sm = StorageManager(cfg, meta, EventManager())
    assert name in sm.storage_backends, f"{name} not loaded: {list(sm.storage_backends)}"
    return sm, name


def completions(backend) -> tuple[threading.Event, list]:
    """Count the tier's per-key put completions (its on_complete_callback,
    which the StorageManager does not ask for)."""
    done: list = []
    ev = threading.Event()
    want = [0]
    real = backend.batched_submit_put_task

    def submit(keys, objs, transfer_spec=None, on_complete_callback=None):
        def cb(k):
            done.append(k)
            if len(done) >= want[0]:
                ev.set()
            if on_complete_callback is not None:
                on_complete_callback(k)

        return real(keys, objs, transfer_spec=transfer_spec, on_complete_callback=cb)

    backend.batched_submit_put_task = submit
    return ev, [done, want]


def read_into(objs, dsts, size: int) -> None:
    for o, d in zip(objs, dsts):
        ctypes.memmove(d.data_ptr(), o.data_ptr, size)


def put_committed(sm, be, keys, objs) -> None:
    """cxlkv: `batched_put`, then wait until no put task is left (every
    chunk committed)."""
    sm.batched_put(keys, objs)
    while any(be.exists_in_put_tasks(k) for k in keys):
        time.sleep(0.0001)


def settled(be) -> None:
    """cxlkv: wait (untimed) for what a store leaves running after its
    commit, the pages it leases for the next store, so the hits timed next
    do not share the CPUs with it."""
    while not be._core.leases.idle():
        time.sleep(0.0001)


def close_soon(sm) -> None:
    """Close the StorageManager, waiting 5 s at most: LMCache 0.5.6's Redis
    connector can hang in close (its executor's shutdown waits on the event
    loop it runs on)."""
    closer = threading.Thread(target=sm.close, daemon=True)
    closer.start()
    closer.join(timeout=5)


def views_kept(target: str, kept: int, rounds: int) -> None:
    """What a get costs with `kept` views in LMCache's L1 (under the view
    budget) against none: a get looks at no other lease then (it sheds only
    past the budget: docs/ARCHITECTURE.md, "What an engine's views may
    pin"), so the ratio stays near 1. Gets of 32 chunks of 256 KiB."""
    size, batch = 256 << 10, 32
    sm, tier = engine("cxlkv", size, batch, target)
    be, lcb = sm.storage_backends[tier], sm.storage_backends["LocalCPUBackend"]
    shapes, dtypes = list(sm.metadata.get_shapes()), list(sm.metadata.get_dtypes())
    keys = [CacheEngineKey("bench/model", 1, 0, 7_000_000_000 + i, torch.bfloat16)
            for i in range(kept + 2 * batch * (rounds + 1))]
    held: list = []
    try:
        for i in range(0, len(keys), batch):
            part = keys[i:i + batch]
            objs = [sm.allocate(shapes, dtypes) for _ in part]
            put_committed(sm, be, part, objs)
            for o in objs:
                o.ref_count_down()
            lcb.clear()

        def get(part) -> float:
            t = time.perf_counter()
            got = sm.batched_get(part, location=tier)
            took = time.perf_counter() - t
            assert None not in got, "a stored chunk missed"
            for o in got:
                o.ref_count_down()
            return took

        def keep(n: int) -> None:
            """`n` views held, as an L1 large enough would hold them (this
            engine's L1 is sized for the batches above and lets older ones
            go); none: the held ones given back. L1 lets go of every view
            it has, the last get's too."""
            for o in held:
                o.ref_count_down()
            held.clear()
            lcb.clear()
            got = [o for i in range(0, n, 256) for o in sm.batched_get(keys[i:min(i + 256, n)], location=tier)]
            assert not be.views.over_budget(), "the views kept are past the view budget: lower --views-kept"
            held.extend(got)
            time.sleep(0.05)  # what giving back or taking views leaves running ends before the timed get

        # Interleaved, round by round (fresh keys for each get), so that a
        # slow stretch of the host falls on both sides of the ratio.
        fresh = iter(range(kept, len(keys), batch))
        none, with_kept = [], []
        for _ in range(rounds + 1):
            keep(0)
            none.append(get(keys[(i := next(fresh)):i + batch]))
            keep(kept)
            with_kept.append(get(keys[(i := next(fresh)):i + batch]))
        t0, t1 = statistics.median(none[1:]), statistics.median(with_kept[1:])
        bench("inproc_views_kept", kept)
        bench("inproc_get_ms_none_kept", t0 * 1e3)
        bench("inproc_get_ms_views_kept", t1 * 1e3)
        bench("inproc_get_ratio_views_kept", t1 / t0)
    finally:
        for o in held:
            o.ref_count_down()
        close_soon(sm)


def main() -> None:
    # As in a vLLM worker, which limits torch to one CPU thread unless told
    # otherwise (OMP_NUM_THREADS): LMCache's CPU copies run on that thread.
    # (On this 2-core VM torch's own thread pool made every copy_ several
    # times slower whenever another thread of the process was busy.)
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=["cxlkv", "redis", "mooncake"], required=True)
    ap.add_argument("--target", required=True,
                    help="cxlkv: the sidecar socket; redis: host:port; mooncake: the master's host:port")
    ap.add_argument("--metadata", default="", help="mooncake: the transfer engine's HTTP metadata URL")
    ap.add_argument("--segment", type=int, default=0,
                    help="mooncake: bytes this engine contributes (0: the objects go to a standalone store process)")
    ap.add_argument("--sizes", default="262144,2097152,33554432")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--big-batch", type=int, default=8, help="batch for chunks of 32 MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--views-kept", type=int, default=0,
                    help="cxlkv: also time a get with this many views in L1 against none (0: not)")
    args = ap.parse_args()
    n = {"cxlkv": "inproc", "redis": "inproc_redis", "mooncake": "inproc_mooncake"}[args.kind]
    if args.kind == "mooncake" and args.segment:
        n = "inproc_mooncake_local"
    gpu = torch.cuda.is_available()

    for size in [int(s) for s in args.sizes.split(",")]:
        lab = label(size)
        batch = args.batch if size < (16 << 20) else args.big_batch
        rounds = args.rounds if size < (16 << 20) else max(1, args.rounds // 2)
        sm, tier = engine(args.kind, size, batch, args.target, args.metadata, args.segment)
        be = sm.storage_backends[tier]
        lcb = sm.storage_backends["LocalCPUBackend"]
        shapes, dtypes = list(sm.metadata.get_shapes()), list(sm.metadata.get_dtypes())
        ev, (done, want) = completions(be) if args.kind != "cxlkv" else (None, ([], [0]))
        src = torch.empty(batch * size, dtype=torch.uint8).random_(0, 256)
        scratch = torch.empty(batch * size, dtype=torch.uint8)
        dst = [torch.empty(size, dtype=torch.uint8) for _ in range(batch)]
        if gpu:
            gdst = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(batch)]
            pinned = torch.empty(batch * size, dtype=torch.uint8).pin_memory()
        mc, st, l1, hit, gview, gpin = [], [], [], [], [], []
        try:
            for r in range(rounds + 1):  # round 0 warms up
                keys = [CacheEngineKey("bench/model", 1, 0, size * 1_000_003 + r * 1009 + i, torch.bfloat16)
                        for i in range(batch)]
                objs = [sm.allocate(shapes, dtypes) for _ in range(batch)]
                assert all(o is not None for o in objs), "L1 too small"
                for i, o in enumerate(objs):
                    ctypes.memmove(o.data_ptr, src.data_ptr() + i * size, size)
                t = time.perf_counter()
                if ev is not None:  # Redis, Mooncake: LMCache's RemoteBackend sends in the background
                    done.clear()
                    ev.clear()
                    want[0] = batch
                    sm.batched_put(keys, objs)
                    assert ev.wait(120), f"store of {batch} x {lab}: {len(done)} completed"
                else:  # cxlkv: stored (committed) once no put task is left
                    put_committed(sm, be, keys, objs)
                ts = time.perf_counter() - t
                if ev is None:
                    settled(be)

                # A hit as vLLM's engine takes one: a lookup that pins what it
                # finds (scheduling), then the retrieve (timed): get every chunk
                # and read it into a destination buffer; then the unpin.
                # From LMCache's own L1 first:
                hits, where = sm.batched_contains(keys, pin=True)
                assert hits == batch and list(where) == ["LocalCPUBackend"], where
                t = time.perf_counter()
                got = sm.batched_get(keys, location="LocalCPUBackend")
                read_into(got, dst, size)
                tl1 = time.perf_counter() - t
                for o in got:
                    o.ref_count_down()
                sm.batched_unpin(keys, ["LocalCPUBackend"])

                # The same hit from the tier, L1 cleared.
                lcb.clear()
                assert sm.batched_contains(keys[:1])[1].get("LocalCPUBackend") is None, "L1 not cleared"
                hits, where = sm.batched_contains(keys, pin=True)
                assert hits == batch and list(where) == [tier], (hits, where)
                t = time.perf_counter()
                got = sm.batched_get(keys, location=tier)
                read_into(got, dst, size)
                th = time.perf_counter() - t
                assert None not in got
                sm.batched_unpin(keys, [tier])
                if r <= 1:
                    for i, d in enumerate(dst):
                        assert torch.equal(d, src[i * size:(i + 1) * size]), f"chunk {i} came back wrong"
                if gpu:  # a GPU host: the hit straight to the GPU vs the same bytes from pinned memory
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for o, g in zip(got, gdst):
                        g.copy_(o.raw_data[:size], non_blocking=True)
                    torch.cuda.synchronize()
                    tg = time.perf_counter() - t
                    t = time.perf_counter()
                    for i, g in enumerate(gdst):
                        g.copy_(pinned[i * size:(i + 1) * size], non_blocking=True)
                    torch.cuda.synchronize()
                    tp = time.perf_counter() - t
                for o in got:
                    o.ref_count_down()
                lcb.clear()  # L1's references to the tier's objects go too (cxlkv: the locks)
                if args.kind == "cxlkv":  # (LMCache's Redis and Mooncake connectors have no remove)
                    be.batched_remove(keys)

                t = time.perf_counter()
                ctypes.memmove(scratch.data_ptr(), src.data_ptr(), batch * size)
                tm = time.perf_counter() - t
                if r > 0:
                    mc.append(tm)
                    st.append(ts)
                    l1.append(tl1)
                    hit.append(th)
                    if gpu:
                        gview.append(tg)
                        gpin.append(tp)
            b = batch * size
            bench(f"{n}_memcpy_gbps_{lab}", b / statistics.median(mc) / 1e9)
            bench(f"{n}_store_gbps_{lab}", b / statistics.median(st) / 1e9)
            bench(f"{n}_l1_hit_gbps_{lab}", b / statistics.median(l1) / 1e9)
            bench(f"{n}_hit_gbps_{lab}", b / statistics.median(hit) / 1e9)
            # Ratios per round (both sides saw the same noise), then the median.
            bench(f"{n}_store_ratio_memcpy_{lab}", statistics.median(m / s for m, s in zip(mc, st)))
            bench(f"{n}_hit_vs_l1_{lab}", statistics.median(a / h for a, h in zip(l1, hit)))
            if gpu:
                bench(f"{n}_gpu_load_vs_pinned_{lab}", statistics.median(p / g for p, g in zip(gpin, gview)))
        finally:
            close_soon(sm)
    if args.kind == "cxlkv" and args.views_kept:
        views_kept(args.target, args.views_kept, max(3, 2 * args.rounds))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # a StorageManager whose close hung keeps non-daemon threads
