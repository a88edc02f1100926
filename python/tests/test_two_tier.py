"""Two tiers: each rack's cxlkv pool first, a distributed store shared by the
racks behind it, configured with LMCache's own settings only (README, "When
one pool is not enough").

Real processes: two sidecars on two pool files (rack A and rack B), a
Mooncake Store (`mooncake_master` with its embedded HTTP metadata server and
a standalone `mooncake_client` holding the store's memory, TCP transport) or
a `redis-server`, and one LMCache engine per rack:

- in-process engine (vLLM's LMCacheConnectorV1): LMCache's StorageManager
  with `remote_storage_plugins: ["cxlkv", "mooncakestore"]`: the cxlkv
  connector, then LMCache's Mooncake Store connector, asked in that order;
- multiprocess server (`lmcache server`): `--l2-adapter` cxlkv, then LMCache's
  RESP adapter on Redis (this LMCache wheel has no Mooncake L2 adapter: its
  `mooncake_store` adapter needs the `lmcache.lmcache_mooncake` extension,
  built only with BUILD_MOONCAKE=1).

A chunk stored on A is a pool hit on A and a second-tier hit on B with the
same bytes; what A's pool evicted is still found behind it; with the second
tier killed, A's pool hits are unchanged, stores keep reaching the pool, and
every call returns (bounded: a hang fails the test, no speed is asserted).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import signal
import subprocess
import threading
import time

import pytest

from cxlkv_testkit import (ROOT, LMCACHE_CHUNK_TOKENS, KVWorker, LMCacheServer, Sidecar, clear_l1,
                           engine_chunk, engine_config, engine_key, engine_metadata, expected, free_port,
                           same_bytes, same_chunk, sidecar_stats, wait_for)
from cxlkv_testkit import mooncake

POOL, TIER2 = "RemoteBackend-cxlkv", "RemoteBackend-mooncakestore"
# A call that has not returned by then is hung: the test fails, it does not wait on.
HANG = 60.0


def port_open(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


class Mooncake:
    """A Mooncake Store on loopback: `mooncake_master` (with the HTTP
    metadata server the TCP transport looks peers up in) and a standalone
    `mooncake_client` that holds the store's memory."""

    def __init__(self, dir: pathlib.Path, store_bytes: int = 256 << 20):
        self.dir = dir
        rpc, http, metrics, self.store_port = free_port(), free_port(), free_port(), free_port()
        self.master_addr = f"127.0.0.1:{rpc}"
        self.metadata = f"http://127.0.0.1:{http}/metadata"
        self.master_args = mooncake.master_args(rpc, http, metrics)
        self.store_args = mooncake.store_args(self.store_port, self.master_addr, self.metadata, store_bytes)
        self.procs: list[subprocess.Popen] = []
        self._ports = (rpc, http)

    def _spawn(self, args: list[str], log: str, ready) -> None:
        with open(self.dir / log, "ab") as f:
            p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT)
        self.procs.append(p)
        assert wait_for(lambda: p.poll() is not None or ready(), timeout=30) and p.poll() is None, \
            (self.dir / log).read_text(errors="replace")[-2000:]

    def start(self) -> "Mooncake":
        self._spawn(self.master_args, "mooncake-master.log", lambda: all(port_open(p) for p in self._ports))
        # Its service port opens once its segment is mounted at the master.
        self._spawn(self.store_args, "mooncake-store.log", lambda: port_open(self.store_port))
        return self

    def kill(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)

    def extra_config(self) -> dict:
        """LMCache's Mooncake Store connector settings, as its documentation
        gives them for TCP (zero-copy mode, synchronous lookups). The engine
        gives no memory of its own (global_segment_size 0): the objects live
        in the store process, which outlives any engine. Mooncake 0.3.13's
        dict-based setup reads the master as `master_server_addr`, which
        LMCache forwards from its `mooncake_`-prefixed form."""
        return {"use_exists_sync": True, "save_chunk_meta": False, "local_hostname": "127.0.0.1",
                "metadata_server": self.metadata, "protocol": "tcp", "device_name": "",
                "master_server_address": self.master_addr, "mooncake_master_server_addr": self.master_addr,
                "global_segment_size": 0, "local_buffer_size": 0, "transfer_timeout": 5}


def bounded(fn, *args, limit: float = HANG):
    """fn(*args), failing the test if it has not returned within `limit`
    seconds (a hang detector: nothing here asserts a speed)."""
    out: list = []
    err: list = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {limit} s: hung"
    if err:
        raise err[0]
    return out[0]


TWO_TIER = ROOT / "deploy" / "lmcache" / "inproc" / "lmcache-two-tier.yaml"


def chain_engine(sock: str, mc: Mooncake):
    """LMCache's in-process StorageManager from the README's two-tier
    configuration as written (deploy/lmcache/inproc/lmcache-two-tier.yaml,
    loaded by LMCache's own loader as vLLM loads LMCACHE_CONFIG_FILE), only
    its endpoints pointed at this test's processes: remote_storage_plugins
    cxlkv (the pool, asked first), then mooncakestore."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    cfg = LMCacheEngineConfig.from_file(str(TWO_TIER))
    assert cfg.remote_storage_plugins == ["cxlkv", "mooncakestore"]
    ours = {**mc.extra_config(), "cxlkv.socket": sock}
    for k in ("cxlkv.socket", "local_hostname", "metadata_server", "master_server_address",
              "mooncake_master_server_addr"):
        assert k in cfg.extra_config, k
        cfg.extra_config[k] = ours[k]
    assert {k: cfg.extra_config[k] for k in ours} == {**ours, "transfer_timeout": 1}
    assert cfg.extra_config["fallback_policy"] == "local_cpu"
    cfg.chunk_size, cfg.max_local_cpu_size = engine_config({}).chunk_size, 0.05  # the kit's small engine
    sm = StorageManager(cfg, engine_metadata(), EventManager())
    assert list(sm.storage_backends) == ["LocalCPUBackend", POOL, TIER2], list(sm.storage_backends)
    return sm


def health_monitor(sm):
    """LMCache's HealthMonitor over `sm`, as LMCacheManager creates it for
    its engine (it reads only `manager.lmcache_engine.storage_manager`); its
    checks are run by the test, not by its thread."""
    import types

    from lmcache.v1.health_monitor.base import HealthMonitor

    manager = types.SimpleNamespace(lmcache_engine=types.SimpleNamespace(storage_manager=sm))
    monitor = HealthMonitor(manager, ping_interval=3600)
    assert sorted(c.get_bypass_backend_name() for c in monitor.get_health_checks()) == [POOL, TIER2]
    return monitor


def put(sm, seeds: list[int]) -> None:
    """Store through the StorageManager (it writes to every tier) and wait
    until both tiers have each chunk."""
    keys = [engine_key(s) for s in seeds]
    sm.batched_put(keys, [engine_chunk(sm, s) for s in seeds])
    for tier in (POOL, TIER2):
        be = sm.storage_backends[tier]
        assert wait_for(lambda: be.batched_contains(keys) == len(keys), timeout=20), f"{tier} never had {seeds}"


def lookup(sm, seeds: list[int]) -> tuple[int, dict]:
    """The engine's lookup with nothing in L1: how many chunks hit, and in which tier."""
    clear_l1(sm)
    l1 = sm.storage_backends["LocalCPUBackend"]
    left = [k for k in (engine_key(s) for s in seeds) if l1.contains(k)]
    held = [(o.get_ref_count(), o.is_pinned) for o in (l1.hot_cache.get(k) for k in left) if o is not None]
    assert not left, f"L1 kept {len(left)} chunks it was asked to clear: (references, pinned) {held}"
    n, where = bounded(sm.batched_contains, [engine_key(s) for s in seeds])
    return n, {tier: len(keys) for tier, keys in where.items()}


def read(sm, seeds: list[int], tier: str) -> None:
    """Retrieve every chunk from `tier` and check its bytes."""
    objs = bounded(lambda: sm.batched_get([engine_key(s) for s in seeds], location=tier))
    try:
        assert all(o is not None for o in objs), f"{tier} lost a chunk it reported"
        assert all(same_chunk(o, s) for o, s in zip(objs, seeds)), f"a chunk came back from {tier} with other bytes"
    finally:
        for o in objs:
            if o is not None:
                o.ref_count_down()
        clear_l1(sm)


def close(sm) -> None:
    # LMCache's remote connectors can wait on their event loop in close.
    t = threading.Thread(target=sm.close, daemon=True)
    t.start()
    t.join(20)


@pytest.fixture
def racks(tmp_path):
    """Rack A and rack B: a sidecar each on its own pool file (8 MiB: what
    the eviction test fills), one Mooncake Store both reach."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    procs = {"a": Sidecar(tmp_path / "a", "a", pool_size="8MiB"), "b": Sidecar(tmp_path / "b", "b", pool_size="8MiB"),
             "mooncake": Mooncake(tmp_path)}
    try:
        for p in procs.values():
            p.start()
        yield procs
    finally:
        for p in procs.values():
            p.kill()


def test_in_process_a_pool_hit_on_a_a_second_tier_hit_on_b_and_the_second_tier_killed(racks):
    mc = racks["mooncake"]
    a = chain_engine(racks["a"].socket, mc)
    b = chain_engine(racks["b"].socket, mc)
    try:
        seeds = list(range(8))
        put(a, seeds)
        assert sidecar_stats(racks["a"].socket).keys == 8 and sidecar_stats(racks["b"].socket).keys == 0
        # Rack A: every chunk from its pool; the second tier is not asked.
        assert lookup(a, seeds) == (8, {POOL: 8})
        read(a, seeds, POOL)
        # Rack B's pool never saw them: each is found behind it, same bytes.
        assert lookup(b, seeds) == (8, {TIER2: 8})
        read(b, seeds, TIER2)
        # A prefix split across the tiers is one hit: B's pool holds the
        # first chunks (stored on B), the second tier the rest.
        put(b, [100, 101])
        assert lookup(b, [100, 101, *seeds]) == (10, {POOL: 2, TIER2: 8})

        # The second tier killed mid-run (master and store process, kill -9).
        mc.kill()
        for _ in range(3):
            assert lookup(a, seeds) == (8, {POOL: 8})
            read(a, seeds, POOL)
        # Stores keep reaching the pool; the dead tier's share is dropped.
        keys = [engine_key(s) for s in (200, 201)]
        bounded(a.batched_put, keys, [engine_chunk(a, s) for s in (200, 201)])
        assert wait_for(lambda: a.storage_backends[POOL].batched_contains(keys) == 2, timeout=20)
        # The dead tier's put of them ends later (Mooncake's client retries
        # its master until the configuration's transfer_timeout): until then
        # it holds a reference to their L1 objects, and LMCache's L1 clear
        # keeps an object that is referenced. (LMCache 0.5.6's remote backend
        # records only single puts in its put tasks, not batched ones: the
        # references are what says the put ended.)
        l1 = a.storage_backends["LocalCPUBackend"]
        assert wait_for(lambda: all(l1.hot_cache[k].get_ref_count() == 1 for k in keys), timeout=30), \
            "the dead tier's put never let go of its chunks"
        assert lookup(a, [200, 201]) == (2, {POOL: 2})
        read(a, [200, 201], POOL)
        # What only the dead tier held is no hit on B: no bytes come back,
        # nothing raises, every call returns. (LMCache 0.5.6's Mooncake
        # connector answers lookups with Mooncake's `is_exist` code as is:
        # -900, the master unreachable, reads as true, so the lookup still
        # counts these chunks and the retrieve then finds none of them; each
        # such call waits ~4 s on Mooncake's client retrying its master.
        # Rack A above never reaches it: its pool answers the whole prefix.)
        lost = seeds[:1]
        for _ in range(2):  # the configuration's get_blocking_failed_threshold
            clear_l1(b)
            n, where = bounded(b.batched_contains, [engine_key(s) for s in lost])
            assert n == 0 or list(where) == [TIER2], where
            got = bounded(lambda: b.batched_get([engine_key(s) for s in lost], location=TIER2))
            assert got == [None], "the dead tier returned a chunk"
        # LMCache's engine health monitor (its own class, as LMCacheManager
        # runs it; the manager stands in by the one attribute it reads) with
        # the configuration's fallback_policy local_cpu: one round of checks
        # takes the failed tier out of B's path, not B's pool. From then on
        # what only the dead tier held is a plain miss.
        monitor = health_monitor(b)
        assert bounded(monitor._run_all_checks)
        assert b._bypassed_backends == {TIER2}
        assert lookup(b, lost) == (0, {})
        # B's own pool still serves what it holds.
        assert lookup(b, [100, 101]) == (2, {POOL: 2})
    finally:
        close(b)
        close(a)


def test_what_the_pool_evicted_is_found_in_the_second_tier(racks):
    mc = racks["mooncake"]
    a = chain_engine(racks["a"].socket, mc)
    try:
        # 8 MiB of pool, 64 KiB chunks: 160 chunks (10 MiB) make it evict.
        seeds = list(range(1000, 1160))
        for i in range(0, len(seeds), 16):
            put(a, seeds[i:i + 16])
        stats = sidecar_stats(racks["a"].socket)
        assert stats.keys < len(seeds), f"the pool evicted nothing: {stats}"
        pool = a.storage_backends[POOL]
        gone = [s for s in seeds if pool.batched_contains([engine_key(s)]) == 0]
        assert gone, "no chunk left the pool"
        # Each evicted chunk is still a hit, from the second tier, same bytes.
        for s in gone[:16]:
            assert lookup(a, [s]) == (1, {TIER2: 1})
        read(a, gone[:16], TIER2)
    finally:
        close(a)


def test_with_the_zero_copy_backend_lmcache_asks_the_remote_tier_before_the_pool(racks):
    """Why the in-process chain uses the cxlkv connector: LMCache creates
    remote backends before storage plugins (CreateStorageBackends) and its
    lookup walks them in that order, so with the zero-copy backend
    (`storage_plugins: ["cxlkv"]`) the second tier is asked first and
    serves a chunk both hold."""
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    from cxlkv_testkit import BACKEND_SPEC

    mc = racks["mooncake"]
    cfg = engine_config({**BACKEND_SPEC, "cxlkv.socket": racks["a"].socket, **mc.extra_config()})
    cfg.remote_storage_plugins = ["mooncakestore"]
    sm = StorageManager(cfg, engine_metadata(), EventManager())
    try:
        assert list(sm.storage_backends) == ["LocalCPUBackend", TIER2, "cxlkv"]
        keys = [engine_key(s) for s in (1, 2)]
        sm.batched_put(keys, [engine_chunk(sm, s) for s in (1, 2)])
        assert wait_for(lambda: sm.storage_backends["cxlkv"].batched_contains(keys) == 2
                        and sm.storage_backends[TIER2].batched_contains(keys) == 2, timeout=20)
        assert lookup(sm, [1, 2]) == (2, {TIER2: 2}), "the pool answered first"
    finally:
        close(sm)


class Redis:
    """A `redis-server` on loopback (Debian's package; scripts/setup-python.sh installs it)."""

    def __init__(self, dir: pathlib.Path):
        self.port = free_port()
        self.log = dir / "redis.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Redis":
        exe = shutil.which("redis-server")
        assert exe, "redis-server is missing: scripts/setup-python.sh installs it"
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                          "--appendonly", "no"], stdout=f, stderr=subprocess.STDOUT)
        assert wait_for(lambda: port_open(self.port), timeout=20), self.log.read_text()
        return self

    def command(self, *args: str) -> str:
        import socket

        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(("*%d\r\n" % len(args) + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)).encode())
            return s.recv(65536).decode(errors="replace")

    def dbsize(self) -> int:
        return int(self.command("DBSIZE").strip().lstrip(":"))

    def reads(self) -> int:
        """Commands that read a value (GET, MGET) served so far."""
        info = self.command("INFO", "commandstats")
        return sum(int(line.split("calls=")[1].split(",")[0]) for line in info.splitlines()
                   if line.startswith(("cmdstat_get:", "cmdstat_mget:")))

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


CHUNKS = 4
SRC_BLOCK, DST_BLOCK = 0, 32


def chain_server(dir: pathlib.Path, sock: str, redis: Redis, name: str, bound_ms: int = 1000) -> LMCacheServer:
    """`lmcache server` with two L2 adapters, as README.md gives them: the
    cxlkv plugin first (index 0: LMCache's prefetch plan takes a chunk from
    the first adapter holding it), LMCache's RESP adapter on Redis second,
    inside cxlkv's BoundedL2Adapter (its lookups end by `bound_ms`; 0: the
    plain RESP adapter); LMCache's default store policy writes every chunk
    to both."""
    srv = LMCacheServer(dir, sock, name)
    resp = {"type": "resp", "host": "127.0.0.1", "port": redis.port}
    if bound_ms:
        resp = {"type": "plugin", "module_path": "cxlkv_lmcache.bounded", "class_name": "BoundedL2Adapter",
                "adapter_params": {"lookup_deadline_ms": bound_ms, "inner": resp}}
    srv.args += ["--l2-adapter", json.dumps(resp)]
    return srv


def hits(server: LMCacheServer, tokens: tuple, seed: int) -> int:
    """LOOKUP + RETRIEVE with the server's L1 emptied first; every hit's bytes checked.

    LMCache's clear (not forced) keeps every read-locked object (a store or
    a prefetch still holding it), and an object it kept stays in L1 once
    unlocked: one clear that met a lock left L1 non-empty for good (seen
    once in CI, the wait below then failing). So clear until L1 is empty;
    if it never is, the server's log says what held it."""

    def cleared() -> bool:
        assert server.post("/cache/clear", {"tier": "l1"}) is not None
        return server.l1_objects() == 0

    assert wait_for(cleared, timeout=30, every=0.1), \
        f"L1 must be empty, or a hit could come from it: {server.l1_objects()} objects left\n{server.tail()}"
    with KVWorker(server.rpc_url) as w:
        n = bounded(w.lookup_and_retrieve, tokens, DST_BLOCK)
        if n:
            assert same_bytes(w.read(DST_BLOCK, tokens[:n * LMCACHE_CHUNK_TOKENS]),
                              [t[:, :n * KVWorker.blocks_per_chunk] for t in expected(seed, len(tokens))]), \
                "a hit came back with other bytes"
    return n


def test_multiprocess_server_pool_first_redis_behind_it_and_redis_killed(tmp_path):
    # Redis, not Mooncake, behind the pool here: this LMCache wheel's
    # `mooncake_store` L2 adapter needs a native extension it does not ship.
    with pytest.raises(ImportError):
        import lmcache.lmcache_mooncake  # noqa: F401
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b, redis = Sidecar(tmp_path / "a", "a"), Sidecar(tmp_path / "b", "b"), Redis(tmp_path)
    try:
        for p in (a, b, redis):
            p.start()
        with chain_server(tmp_path, a.socket, redis, "server-a").start() as sa, \
                chain_server(tmp_path, b.socket, redis, "server-b").start() as sb:
            tokens = KVWorker.tokens(7, CHUNKS)
            with KVWorker(sa.rpc_url) as w:
                w.fill(SRC_BLOCK, tokens, 7)
                assert w.store(tokens, SRC_BLOCK)
            assert wait_for(lambda: sidecar_stats(a.socket).keys == CHUNKS and redis.dbsize() == CHUNKS,
                            timeout=20), (sidecar_stats(a.socket), redis.dbsize())
            assert sidecar_stats(b.socket).keys == 0

            # Rack A: every chunk from its pool; Redis serves no read.
            before = redis.reads()
            assert hits(sa, tokens, 7) == CHUNKS, sa.tail()
            assert redis.reads() == before
            # Rack B: its pool is empty, so every chunk comes from Redis.
            assert hits(sb, tokens, 7) == CHUNKS, sb.tail()
            assert redis.reads() > before

            # Redis killed mid-run: A's pool hits unchanged, a store reaches
            # A's pool, and what only Redis held is a miss on B.
            redis.kill()
            for _ in range(2):
                assert hits(sa, tokens, 7) == CHUNKS, sa.tail()
            more = KVWorker.tokens(8, CHUNKS)
            with KVWorker(sa.rpc_url) as w:
                w.fill(SRC_BLOCK, more, 8)
                assert bounded(w.store, more, SRC_BLOCK)
            assert wait_for(lambda: sidecar_stats(a.socket).keys == 2 * CHUNKS, timeout=20)
            assert hits(sa, more, 8) == CHUNKS, sa.tail()
            assert hits(sb, tokens, 7) == 0, sb.tail()
    finally:
        for p in (a, b, redis):
            p.kill()


def second_tier_healthy(server: LMCacheServer) -> bool | None:
    """What LMCache's /status says of the second adapter (None: not said)."""
    st = server.get("/status") or {}
    adapters = st.get("storage_manager", st).get("l2_adapters", None)
    if isinstance(adapters, list) and len(adapters) > 1:
        return adapters[1].get("is_healthy")
    return None


def test_multiprocess_server_a_hung_second_tier_stalls_lookups_unless_its_lookups_are_bounded(tmp_path):
    """Redis stopped (SIGSTOP: hung, not dead). LMCache's prefetch waits for
    every adapter's lookup, with no timeout of its own: behind the plain RESP
    adapter, a lookup of chunks the pool holds in full does not finish while
    Redis is stopped. Behind cxlkv's BoundedL2Adapter, the same lookup ends
    by the bound, every chunk from the pool with its bytes, and the wrapper
    says the tier is unhealthy until it answers again."""
    (tmp_path / "a").mkdir()
    a, redis = Sidecar(tmp_path / "a", "a"), Redis(tmp_path)
    try:
        for p in (a, redis):
            p.start()
        tokens = KVWorker.tokens(9, CHUNKS)
        with chain_server(tmp_path, a.socket, redis, "plain", bound_ms=0).start() as plain, \
                chain_server(tmp_path, a.socket, redis, "bounded", bound_ms=500).start() as bounded_srv:
            with KVWorker(plain.rpc_url) as w:
                w.fill(SRC_BLOCK, tokens, 9)
                assert w.store(tokens, SRC_BLOCK)
            assert wait_for(lambda: sidecar_stats(a.socket).keys == CHUNKS, timeout=20)
            assert hits(bounded_srv, tokens, 9) == CHUNKS, bounded_srv.tail()
            redis.proc.send_signal(signal.SIGSTOP)
            try:
                # Bounded: the pool's chunks, within the bound (plus LMCache's
                # own 500 ms poll), every byte checked.
                t = time.monotonic()
                assert hits(bounded_srv, tokens, 9) == CHUNKS, bounded_srv.tail()
                assert time.monotonic() - t < HANG
                assert wait_for(lambda: second_tier_healthy(bounded_srv) is False, timeout=10), \
                    bounded_srv.get("/status")
                # Plain: LMCache waits on Redis's lookup.
                assert plain.post("/cache/clear", {"tier": "l1"}) is not None
                with KVWorker(plain.rpc_url) as w:
                    out: list = []
                    th = threading.Thread(target=lambda: out.append(w.lookup_and_retrieve(tokens, DST_BLOCK)),
                                          daemon=True)
                    th.start()
                    th.join(5.0)
                    stalled = th.is_alive()
                    redis.proc.send_signal(signal.SIGCONT)
                    th.join(HANG)
                assert stalled, "LMCache finished a lookup while an L2 adapter's lookup hung"
                assert out == [CHUNKS]
            finally:
                redis.proc.send_signal(signal.SIGCONT)
            assert wait_for(lambda: second_tier_healthy(bounded_srv) is True, timeout=20), bounded_srv.get("/status")
    finally:
        for p in (a, redis):
            p.kill()
