"""Test helpers shared by the plugin and system tests, the benchmarks and
the fault scripts: a real `cxlkv serve` on a temporary pool, and adapters
built through LMCache's own plugin factory. One module per job; every name
is importable from the package as well:

- procs: the checkout's ROOT and its scripts as modules, free loopback ports, wait_for
- sidecar: the one `cxlkv serve` launcher (Sidecar), its readiness and stats
- etcd, cluster: an etcd, and elected nodes campaigning through it
- adapters: the plugin as LMCache's multiprocess server loads it, LMCache's own tests
- lmcache_server: `lmcache server` with the plugin as L2, and a worker driving it
- engine: LMCache's in-process engine with the cxlkv backend and connector
- l2, mooncake, containerfile, engine_cli: imported by name (not re-exported)
"""

from __future__ import annotations

from .adapters import LMCACHE_TESTS, adapter, make_adapter, plugin_json, plugin_spec, storage_manager, upstream
from .cluster import ELECTION_LEASE_S, ELECTION_TIMINGS, elected_node, node_role, roles, settled_roles
from .engine import (BACKEND_SPEC, CONNECTOR_SPEC, ENGINE_CHUNK_TOKENS, ENGINE_HEAD_SIZE, ENGINE_HEADS, ENGINE_LAYERS,
                     chunk_bytes, clear_l1, engine_chunk, engine_config, engine_extra, engine_key, engine_metadata,
                     engine_put, engine_storage_manager, engine_store_tokens, engine_with_kv_events, kill_holder,
                     run_engine, same_chunk)
from .etcd import ETCD, Etcd
from .lmcache_server import (BLOCK_TOKENS, HEAD_SIZE, KV_BLOCKS, KV_HEADS, KV_LAYERS, LMCACHE_CHUNK_BYTES,
                             LMCACHE_CHUNK_TOKENS, KVWorker, LMCacheServer, expected, same_bytes)
from .procs import ROOT, free_port, script, wait_for
from .sidecar import BIN, Sidecar, ready, sidecar_stats, stopped

__all__ = [
    "BACKEND_SPEC", "BIN", "BLOCK_TOKENS", "CONNECTOR_SPEC", "ELECTION_LEASE_S", "ELECTION_TIMINGS",
    "ENGINE_CHUNK_TOKENS", "ENGINE_HEADS", "ENGINE_HEAD_SIZE", "ENGINE_LAYERS", "ETCD", "Etcd", "HEAD_SIZE",
    "KVWorker", "KV_BLOCKS", "KV_HEADS", "KV_LAYERS", "LMCACHE_CHUNK_BYTES", "LMCACHE_CHUNK_TOKENS",
    "LMCACHE_TESTS", "LMCacheServer", "ROOT", "Sidecar", "adapter", "chunk_bytes", "clear_l1", "elected_node",
    "engine_chunk", "engine_config", "engine_extra", "engine_key", "engine_metadata", "engine_put",
    "engine_storage_manager", "engine_store_tokens", "engine_with_kv_events", "expected", "free_port",
    "kill_holder", "make_adapter", "node_role", "plugin_json", "plugin_spec", "ready", "roles", "run_engine",
    "same_bytes", "same_chunk", "script", "settled_roles", "sidecar_stats", "stopped", "storage_manager", "upstream",
    "wait_for",
]
