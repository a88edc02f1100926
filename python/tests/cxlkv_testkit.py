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
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("CXLKV_BIN", str(ROOT / "target" / "debug" / "cxlkv"))


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
