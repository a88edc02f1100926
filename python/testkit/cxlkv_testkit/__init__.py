"""Test helpers shared by the plugin and system tests: a real `cxlkv serve`
on a temporary pool, and adapters built through LMCache's own plugin factory."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[3]
BIN = os.environ.get("CXLKV_BIN", str(ROOT / "target" / "debug" / "cxlkv"))
# LMCache's own test suite, from its sdist (scripts/setup-python.sh fetches it).
LMCACHE_TESTS = pathlib.Path(os.environ.get("LMCACHE_TESTS", ROOT / ".cache" / "lmcache-0.5.6" / "tests"))


def upstream(module: str):
    """A module of LMCache's own test suite (`tests.v1...`), imported from
    its sdist: the one place that tree goes on the import path (it is not a
    package one can install), after the installed `lmcache`, and with any
    other top-level `tests` module forgotten so the name is LMCache's."""
    import importlib

    import lmcache  # noqa: F401 - the installed package, before the sdist's source tree is on the path

    tree = str(LMCACHE_TESTS.parent)
    if not (LMCACHE_TESTS / "v1").is_dir():
        raise RuntimeError(f"LMCache upstream tests not found under {tree}; run scripts/setup-python.sh")
    if tree not in sys.path:
        sys.path.insert(0, tree)
    t = sys.modules.get("tests")
    if t is not None and not str(getattr(t, "__file__", "") or list(getattr(t, "__path__", [""]))[0]).startswith(tree):
        del sys.modules["tests"]
    return importlib.import_module(module)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sidecar:
    """One `cxlkv serve` process on a pool under `dir`."""

    def __init__(self, dir: pathlib.Path, name: str = "cxlkv", pool_size: str = "64MiB", extra: tuple = ()):
        self.dir = dir
        self.socket = str(dir / f"{name}.sock")
        self.pool = str(dir / "pool")
        self.log = dir / f"{name}.log"
        self.pool_size = pool_size
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None

    def args(self) -> list[str]:
        return [BIN, "serve", "--pool-path", self.pool, "--pool-size", self.pool_size, "--region-size", "2MiB",
                "--page-size", "4KiB", "--socket", self.socket, "--metrics-addr", "", *self.extra]

    def start(self) -> "Sidecar":
        log = open(self.log, "ab")
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 30
        while not ready(self.socket):  # readiness: every listener bound
            if self.proc.poll() is not None:
                raise RuntimeError(f"cxlkv exited: {self.log.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"cxlkv did not start: {self.log.read_text()}")
            time.sleep(0.02)
        return self

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)
        if sig == signal.SIGSTOP:  # delivery is asynchronous: wait until it has stopped
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                with open(f"/proc/{self.proc.pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "T":
                        return
                time.sleep(0.001)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=15)

    # `with Sidecar(...).start() as s:` kills it however the block ends.
    def __enter__(self) -> "Sidecar":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    @contextlib.contextmanager
    def sigcont_on_exit(self):
        """For a test that stops the sidecar (SIGSTOP): however it ends, the
        sidecar runs again before anything after the block needs it (an
        adapter's close, the fixture's kill)."""
        try:
            yield self
        finally:
            self.signal(signal.SIGCONT)


def ready(sock: str) -> bool:
    """The sidecar's gRPC health check says SERVING."""
    import grpc

    from cxlkv_lmcache.client import channel
    from cxlkv_lmcache.watch import SERVING, serving_status

    if not os.path.exists(sock):
        return False
    ch = channel(sock)
    try:
        msg = ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=1)
        return serving_status(msg) == SERVING
    except grpc.RpcError:
        return False
    finally:
        ch.close()


def plugin_spec(socket: str, **params) -> dict:
    return {
        "type": "plugin",
        "module_path": "cxlkv_lmcache.adapter",
        "class_name": "CxlKvL2Adapter",
        "adapter_params": {"socket": socket, **params},
    }


def plugin_json(socket: str, **params) -> str:
    return json.dumps(plugin_spec(socket, **params))


def make_adapter(socket: str, **params):
    """Build the adapter the way `--l2-adapter '<json>'` does."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig

    spec = plugin_spec(socket, **params)
    spec.pop("type")
    return create_l2_adapter(PluginL2AdapterConfig.from_dict(spec))


@contextlib.contextmanager
def adapter(socket: str, **params):
    """`make_adapter`, closed however the block ends (its threads and the
    sidecar's locks must not outlive a test)."""
    a = make_adapter(socket, **params)
    try:
        yield a
    finally:
        a.close()


def wait_for(pred, timeout: float = 5.0, every: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return pred()


def storage_manager(socket: str, **params):
    """LMCache's StorageManager (the L1/L2 core of `lmcache server`) with an
    8 MiB L1 that skips itself on store, and this plugin as its L2."""
    from lmcache.v1.distributed.config import (
        EvictionConfig,
        L1ManagerConfig,
        L1MemoryManagerConfig,
        L2AdaptersConfig,
        StorageManagerConfig,
    )
    from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig
    from lmcache.v1.distributed.storage_manager import StorageManager

    spec = plugin_spec(socket, **params)
    spec.pop("type")
    cfg = StorageManagerConfig(
        l1_manager_config=L1ManagerConfig(
            memory_config=L1MemoryManagerConfig(size_in_bytes=8 << 20, use_lazy=False, init_size_in_bytes=8 << 20,
                                                align_bytes=0x1000),
            write_ttl_seconds=60,
            read_ttl_seconds=60,
        ),
        eviction_config=EvictionConfig(eviction_policy="noop"),
        l2_adapter_config=L2AdaptersConfig([PluginL2AdapterConfig.from_dict(spec)]),
        store_policy="skip_l1",
    )
    return StorageManager(cfg)


# Small geometry for the KV caches a test worker registers: chunks of 64
# tokens in blocks of 16; 2 layers of (K/V, blocks, 16, 2 heads, 64) bf16,
# so one LMCache chunk is 64 KiB (16 of the kit's 4 KiB pages).
LMCACHE_CHUNK_TOKENS, BLOCK_TOKENS, KV_BLOCKS, KV_LAYERS, KV_HEADS, HEAD_SIZE = 64, 16, 64, 2, 2, 64
LMCACHE_CHUNK_BYTES = KV_LAYERS * 2 * LMCACHE_CHUNK_TOKENS * KV_HEADS * HEAD_SIZE * 2


def _http(url: str, body: dict | None = None):
    """GET (or POST `body` as JSON) and decode the answer; None when the
    server does not answer or answers with an error."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())
    except Exception:
        return None


class LMCacheServer:
    """One `lmcache server` process (LMCache's multiprocess server) with the
    plugin as its only L2 adapter, on the sidecar socket given. Engine-driven
    transfer over pickled messages: the mode that needs no accelerator and
    no shared-memory segment of LMCache's own."""

    def __init__(self, dir: pathlib.Path, socket: str, name: str = "lmcache", **params):
        self.exe = str(pathlib.Path(sys.executable).parent / "lmcache")
        self.port, self.http_port = free_port(), free_port()
        self.rpc_url = f"tcp://127.0.0.1:{self.port}"
        self.base = f"http://127.0.0.1:{self.http_port}"
        self.log = dir / f"{name}.log"
        self.args = [self.exe, "server", "--host", "127.0.0.1", "--port", str(self.port), "--http-host", "127.0.0.1",
                     "--http-port", str(self.http_port), "--chunk-size", str(LMCACHE_CHUNK_TOKENS),
                     "--l1-size-gb", "0.0625", "--eviction-policy", "LRU", "--disable-observability",
                     "--supported-transfer-mode", "engine_driven",
                     "--l2-adapter", plugin_json(socket, poll_interval_ms=100, **params)]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "LMCacheServer":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        # Importing torch and LMCache takes a few seconds on a loaded VM.
        if not wait_for(lambda: self.proc.poll() is not None or (self.get("/healthcheck") or {}).get("status") ==
                        "healthy", timeout=90) or self.proc.poll() is not None:
            self.stop()  # `with LMCacheServer(...).start()` never reaches __exit__ when start() raises
            raise RuntimeError(f"lmcache server did not start: {self.tail()}")
        return self

    def errors(self) -> list[str]:
        """Lines of its log where LMCache reports an error: a failed store or
        load in the plugin is logged there and not always seen by a client."""
        return [line for line in self.log.read_text(errors="replace").splitlines()
                if "ERROR" in line or "Traceback" in line]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def get(self, path: str):
        return _http(self.base + path)

    def post(self, path: str, body: dict):
        return _http(self.base + path, body)

    def status(self) -> dict:
        return self.get("/status") or {}

    def l2_status(self) -> dict:
        """The plugin's report_status(), as the server shows it."""
        return (self.status().get("storage_manager", {}).get("l2_adapters") or [{}])[0]

    def l2_healthy(self) -> bool | None:
        return self.l2_status().get("is_healthy")

    def l1_objects(self) -> int:
        return self.status()["storage_manager"]["l1_manager"]["total_object_count"]

    def l2_entries(self) -> list[dict]:
        """Objects the L2 adapter lists (LMCache asks the plugin)."""
        return (self.get("/cache/objects?tier=l2") or {}).get("entries", [])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "LMCacheServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class KVWorker:
    """An inference worker as `lmcache server` sees one: paged KV caches on
    the CPU, registered through LMCache's own engine-driven transfer context,
    and the server's LOOKUP / STORE / RETRIEVE requests sent through LMCache's
    own request client (the path `lmcache bench server --mode cpu` takes)."""

    MODEL = "cxlkv-test-model"

    def __init__(self, rpc_url: str, instance_id: int = 1000):
        import torch
        import zmq
        from lmcache.utils import EngineType
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo
        from lmcache.v1.multiprocess.transfer_context import EngineDrivenTransferContext
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.zmq = zmq.Context()
        self.zmq.setsockopt(zmq.LINGER, 0)
        self.client = RequestClientFactory.create(rpc_url, context=self.zmq)
        self.ctx = None
        try:
            assert self.client.get_chunk_size().result(timeout=10) == LMCACHE_CHUNK_TOKENS
            shape = (2, KV_BLOCKS, BLOCK_TOKENS, KV_HEADS, HEAD_SIZE)
            self.kv = {f"layer.{i}": torch.zeros(shape, dtype=torch.bfloat16) for i in range(KV_LAYERS)}
            self.ctx = EngineDrivenTransferContext(instance_id, self.client)
            group = EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(KV_LAYERS)),
                                    tokens_per_block=BLOCK_TOKENS)
            self.ctx.register(self.kv, self.MODEL, 1, self.blocks_per_chunk, 10.0, layout_hints={"kv_layout": "NHD"},
                              engine_group_infos=[group], engine_type=EngineType.VLLM)
        except BaseException:
            self.close()
            raise
        self._session = 0

    blocks_per_chunk = LMCACHE_CHUNK_TOKENS // BLOCK_TOKENS

    @staticmethod
    def tokens(seq: int, chunks: int) -> tuple[int, ...]:
        """A token sequence of whole chunks, distinct per `seq` from its first token."""
        return tuple(seq * 100_000 + i for i in range(chunks * LMCACHE_CHUNK_TOKENS))

    def _key(self, tokens, request_id: str, worker_id: int | None):
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        return IPCCacheServerKey(model_name=self.MODEL, world_size=1, num_kv_readers=1, worker_id=worker_id,
                                 token_ids=tuple(tokens), start=0, end=len(tokens), request_id=request_id)

    def _request_id(self) -> str:
        self._session += 1
        return f"req-{id(self)}-{self._session}"

    def _blocks(self, first_block: int, tokens) -> list[int]:
        return list(range(first_block, first_block + len(tokens) // BLOCK_TOKENS))

    def fill(self, first_block: int, tokens, seed: int) -> None:
        """Writes known bytes (see `expected`) into the blocks holding `tokens`."""
        for layer, want in zip(self.kv.values(), expected(seed, len(tokens))):
            layer[:, first_block:first_block + want.shape[1]].copy_(want)

    def read(self, first_block: int, tokens) -> list:
        n = len(tokens) // BLOCK_TOKENS
        return [layer[:, first_block:first_block + n].clone() for layer in self.kv.values()]

    def store(self, tokens, first_block: int) -> bool:
        rid = self._request_id()
        try:
            fut = self.ctx.submit_store(rid, self._key(tokens, rid, 0), self.kv, [self._blocks(first_block, tokens)],
                                        None, self.blocks_per_chunk)
            return bool(fut.result(timeout=10))
        finally:
            self.client.end_session(rid).result(timeout=10)

    def lookup_and_retrieve(self, tokens, first_block: int) -> int:
        """LOOKUP (the server finds the prefix in L1 or L2 and prefetches it
        into L1), then RETRIEVE the hit chunks into the blocks from
        `first_block`. Returns the number of hit chunks."""
        rid = self._request_id()
        try:
            self.client.lookup(self._key(tokens, rid, None), 1).result(timeout=10)
            hits = None

            def done() -> bool:
                nonlocal hits
                hits = self.client.query_prefetch_status(rid).result(timeout=10)
                return hits is not None

            assert wait_for(done, timeout=20, every=0.05), "the server never finished the lookup"
            if hits:
                got = tokens[:hits * LMCACHE_CHUNK_TOKENS]
                fut = self.ctx.submit_retrieve(rid, self._key(got, rid, 0), self.kv, [self._blocks(first_block, got)],
                                               None, self.blocks_per_chunk)
                assert fut.result(timeout=10), "RETRIEVE of looked-up chunks failed"
            return hits
        finally:
            self.client.end_session(rid).result(timeout=10)

    def close(self) -> None:
        try:
            if self.ctx is not None:
                try:
                    fut = self.ctx.unregister()
                    if fut is not None:
                        fut.result(timeout=10)
                finally:
                    self.ctx.close()
                    self.ctx = None
        finally:
            # The context's sockets close first, or term() waits for them.
            self.client.close()
            self.zmq.term()

    def __enter__(self) -> "KVWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def expected(seed: int, n_tokens: int) -> list:
    """Per layer, the (K/V, blocks, block tokens, heads, head size) bytes a
    worker fills for `seed`: random, so a chunk from the wrong place or a
    half-copied one cannot match."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (2, n_tokens // BLOCK_TOKENS, BLOCK_TOKENS, KV_HEADS, HEAD_SIZE)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(KV_LAYERS)]


def same_bytes(got: list, want: list) -> bool:
    import torch

    return len(got) == len(want) and all(
        a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))
        for a, b in zip(got, want))


# ------------------------------------------------------------ elected nodes

ETCD = "/usr/bin/etcd"

# As tests/failover.rs: etcd's lease at its floor of 2 s (the local lease
# lapses after 2/3 of it), so a lost primary is replaced within seconds.
ELECTION_LEASE_S = 2.0
ELECTION_TIMINGS = "heartbeat_ms = 100\nlease_ms = 2000\ndead_after_ms = 3000\nforward_timeout_ms = 1000\n"


class Etcd:
    """A one-member etcd (Debian's etcd-server) on free loopback ports, its
    data and log under `dir`; `endpoint` is what a node's config names."""

    def __init__(self, dir: pathlib.Path):
        if not os.path.exists(ETCD):
            raise RuntimeError(f"{ETCD} is missing: install Debian's etcd-server (see the README's setup)")
        self.dir = dir
        self.port, self.peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = dir / "etcd.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Etcd":
        url = lambda p: f"http://127.0.0.1:{p}"  # noqa: E731
        args = [ETCD, "--name", "t", "--data-dir", str(self.dir / "etcd"),
                "--listen-client-urls", url(self.port), "--advertise-client-urls", url(self.port),
                "--listen-peer-urls", url(self.peer_port), "--initial-advertise-peer-urls", url(self.peer_port),
                "--initial-cluster", f"t={url(self.peer_port)}", "--log-level", "warn"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)

        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        if not wait_for(lambda: self.proc.poll() is not None or up(), timeout=20) or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError(f"etcd did not come up: {self.log.read_text(errors='replace')[-2000:]}")
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Etcd":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def elected_node(dir: pathlib.Path, name: str, etcd_endpoint: str, pool_size: str = "16MiB") -> Sidecar:
    """A sidecar (not started) that campaigns for primary through etcd with
    the short timings above; every node on `dir`'s pool shares the election."""
    cfg = dir / f"{name}.toml"
    cfg.write_text(f'[cluster]\nelection = "etcd"\netcd_endpoints = ["{etcd_endpoint}"]\n{ELECTION_TIMINGS}')
    return Sidecar(dir, name, pool_size=pool_size,
                   extra=("--config", str(cfg), "--node-name", name, "--peer-addr", f"127.0.0.1:{free_port()}"))


def node_role(sock: str) -> tuple[str, int] | None:
    """(cluster role, epoch) from the node's Stats through a fresh channel
    (a node binds its socket anew every term), or None if it does not answer."""
    import grpc

    from cxlkv_lmcache import client as cl
    from cxlkv_lmcache._proto import cxlkv_pb2 as pb

    if not os.path.exists(sock):
        return None
    ch = cl.channel(sock)
    try:
        st = cl.stub(ch).Stats(pb.StatsRequest(), timeout=1)
        return st.cluster_role, st.epoch
    except grpc.RpcError:
        return None
    finally:
        ch.close()


def roles(nodes: dict) -> dict[str, tuple[str, int] | None]:
    """`node_role` of each of `nodes` (name → Sidecar)."""
    return {n: node_role(s.socket) for n, s in nodes.items()}


def settled_roles(nodes: dict, timeout: float = 20) -> dict[str, tuple[str, int] | None]:
    """Wait until `nodes` (name → Sidecar) show one primary and followers
    only besides; returns the roles seen (a node keeps its last answer)."""
    seen: dict = {}
    want = sorted(["primary"] + ["follower"] * (len(nodes) - 1))

    def settled() -> bool:
        seen.update(roles(nodes))
        return sorted(r[0] for r in seen.values() if r) == want

    assert wait_for(settled, timeout=timeout, every=0.05), f"no primary and {len(nodes) - 1} followers: {seen}"
    return seen


def stopped(pid: int) -> bool:
    """Every thread of `pid` has stopped: kill() only queues SIGSTOP, and until
    each thread takes it the others keep serving (tests/common's sigstop)."""
    tasks = pathlib.Path(f"/proc/{pid}/task")
    states = []
    for t in tasks.iterdir():
        try:
            states.append((t / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, IndexError):
            continue  # a thread that just exited
    return bool(states) and all(s in ("T", "t") for s in states)


# ------------------------------------------------ LMCache's in-process engine

BACKEND_SPEC = {"storage_plugin.cxlkv.module_path": "cxlkv_lmcache.backend",
                "storage_plugin.cxlkv.class_name": "CxlKvBackend"}
CONNECTOR_SPEC = {"remote_storage_plugin.cxlkv.module_path": "cxlkv_lmcache.connector",
                  "remote_storage_plugin.cxlkv.class_name": "CxlKvConnector"}
# A small engine: chunks of 64 tokens, 2 layers of 2 heads of 64 in bf16, so a
# full chunk is 64 KiB (16 of the kit's 4 KiB pages).
ENGINE_CHUNK_TOKENS, ENGINE_LAYERS, ENGINE_HEADS, ENGINE_HEAD_SIZE = 64, 2, 2, 64


def engine_metadata(worker_id: int = 0, world_size: int = 1, chunk: int = ENGINE_CHUNK_TOKENS,
                    layers: int = ENGINE_LAYERS, heads: int = ENGINE_HEADS, head_size: int = ENGINE_HEAD_SIZE):
    import torch
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(model_name="cxlkv-test-model", world_size=world_size, local_world_size=world_size,
                           worker_id=worker_id, local_worker_id=worker_id, kv_dtype=torch.bfloat16,
                           kv_shape=(layers, 2, chunk, heads, head_size), chunk_size=chunk)


def engine_extra(socket: str, backend: bool = True, connector: bool = False, **params) -> dict:
    """LMCache extra_config with the cxlkv backend and/or connector on `socket`."""
    extra = {**(BACKEND_SPEC if backend else {}), **(CONNECTOR_SPEC if connector else {}), "cxlkv.socket": socket}
    extra.update({f"cxlkv.{k}": v for k, v in params.items()})
    return extra


def engine_config(extra: dict, backend: bool = True, connector: bool = False, cpu_gb: float = 0.05,
                  chunk: int = ENGINE_CHUNK_TOKENS, **fields):
    from lmcache.v1.config import LMCacheEngineConfig

    cfg = LMCacheEngineConfig.from_defaults(chunk_size=chunk, local_cpu=True, max_local_cpu_size=cpu_gb,
                                            lmcache_instance_id=f"cxlkv-test-{os.getpid()}", **fields)
    cfg.extra_config = extra
    if backend:
        cfg.storage_plugins = ["cxlkv"]
    if connector:
        cfg.remote_storage_plugins = ["cxlkv"]
    return cfg


def engine_storage_manager(socket: str, backend: bool = True, connector: bool = False, metadata=None,
                           cpu_gb: float = 0.05, **params):
    """LMCache's in-process StorageManager (its own class, on CPU): its
    LocalCPUBackend as L1 and the cxlkv backend (and/or, behind LMCache's
    RemoteBackend, the cxlkv connector), loaded by module path from
    extra_config as vLLM's LMCacheConnectorV1 loads them."""
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    cfg = engine_config(engine_extra(socket, backend, connector, **params), backend, connector, cpu_gb=cpu_gb)
    return StorageManager(cfg, metadata or engine_metadata(), EventManager())


def engine_key(seed: int, salt: str = "", worker_id: int = 0):
    import torch
    from lmcache.utils import CacheEngineKey

    configs = {"lmcache.tag.cache_salt": salt} if salt else None
    return CacheEngineKey("cxlkv-test-model", 1, worker_id, 0x5EED0000 + seed, torch.bfloat16, configs)


def engine_chunk(sm, seed: int, tokens: int | None = None):
    """An L1 object (LMCache's own allocator) holding seed's known bytes."""
    import torch

    meta = sm.metadata
    shapes = list(meta.get_shapes())
    if tokens is not None:
        shapes = [torch.Size([*s[:2], tokens, *s[3:]]) for s in shapes]
    obj = sm.allocate(shapes, list(meta.get_dtypes()))
    assert obj is not None, "L1 full"
    obj.tensor.copy_(chunk_bytes(seed, obj.tensor.shape))
    return obj


def chunk_bytes(seed: int, shape):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g).to(torch.bfloat16)


def same_chunk(obj, seed: int) -> bool:
    import torch

    t = obj.tensor
    want = chunk_bytes(seed, t.shape)
    return torch.equal(t.contiguous().view(torch.int16), want.view(torch.int16))


def engine_put(sm, seeds: list[int], salt: str = "", timeout: float = 10.0) -> None:
    """Store one chunk per seed through the StorageManager and wait until
    the cxlkv backend committed them (L1 keeps its copies)."""
    keys = [engine_key(s, salt) for s in seeds]
    objs = [engine_chunk(sm, s) for s in seeds]
    sm.batched_put(keys, objs)
    be = sm.storage_backends["cxlkv"]
    assert wait_for(lambda: not any(be.exists_in_put_tasks(k) for k in keys), timeout=timeout)


def clear_l1(sm) -> None:
    sm.storage_backends["LocalCPUBackend"].clear()


def sidecar_stats(socket: str):
    from cxlkv_lmcache import client as cl
    from cxlkv_lmcache._proto import cxlkv_pb2 as pb

    ch = cl.channel(socket)
    try:
        return cl.stub(ch).Stats(pb.StatsRequest(), timeout=5)
    finally:
        ch.close()


def run_engine(script: str, sock: str, action: str, seeds: list[int], wait: bool = True):
    """Run `script` (an engine process: `python -c script sock action seeds`)
    on the sidecar at `sock`. With `wait`, the lines it printed that start
    with STORED or HITS; else the running process (stdout piped)."""
    cmd = [sys.executable, "-c", script, sock, action, ",".join(map(str, seeds))]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if line.split()[:1] in (["STORED"], ["HITS"])]


def kill_holder(script: str, sock: str, action: str, seeds: list[int], holding: str) -> None:
    """Run engine `script` with `action` on `seeds` until it prints `holding`
    (it then holds a lock on each chunk), then kill it (-9): its connection
    closes with it, so the sidecar releases its locks."""
    p = run_engine(script, sock, action, seeds, wait=False)
    try:
        assert p.stdout.readline().strip() == holding
        assert sidecar_stats(sock).locked_keys == len(seeds)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
        assert wait_for(lambda: sidecar_stats(sock).locked_keys == 0, timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def engine_with_kv_events(socket: str, chunk: int = ENGINE_CHUNK_TOKENS, instance: str | None = None):
    """A real LMCacheEngine on CPU (LMCache's MockGPUConnector in place of
    the GPU), its kv events on (`enable_kv_events`), the cxlkv backend as its
    storage plugin: `engine.store(tokens)` hashes the tokens into chunk keys,
    records a CacheStoreEvent with each chunk's tokens and hands the chunks
    to the backend, as under vLLM."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector

    meta = engine_metadata(chunk=chunk)
    cfg = engine_config(engine_extra(socket), chunk=chunk, enable_kv_events=True)
    name = instance or f"cxlkv-events-{os.getpid()}-{id(cfg):x}"
    engine = LMCacheEngineBuilder.get_or_create(name, cfg, meta, MockGPUConnector(meta.kv_shape),
                                                lambda t, r: None, lambda o, r: o)
    engine.post_init()
    return engine


def engine_store_tokens(engine, tokens: list[int], timeout: float = 10.0) -> list:
    """Store `tokens` through the engine (every full chunk), wait until the
    cxlkv backend committed them, and return the chunk keys in order."""
    import torch

    t = torch.tensor(tokens, dtype=torch.long)
    keys = [k for _, _, k in engine.token_database.process_tokens(t)]
    engine.store(t, kvcaches=None, slot_mapping=torch.arange(len(tokens)))
    be = engine.storage_manager.storage_backends["cxlkv"]
    assert wait_for(lambda: not any(be.exists_in_put_tasks(k) for k in keys), timeout=timeout)
    assert wait_for(lambda: all(be.contains(k) for k in keys), timeout=timeout), "not stored in cxlkv"
    return keys
