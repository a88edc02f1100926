"""LMCache's in-process engine (what vLLM's LMCacheConnectorV1 runs) on
CPU with the cxlkv backend and/or connector: its config, StorageManager,
keys and chunks of known bytes, and engine processes run beside a test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from .procs import wait_for
from .sidecar import sidecar_stats

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
