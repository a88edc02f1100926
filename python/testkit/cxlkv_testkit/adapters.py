"""The plugin as LMCache's multiprocess server loads it: the L2 adapter
spec, adapters and a StorageManager built through LMCache's own factory, and
LMCache's own test suite (from its sdist) for the conformance tests."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys

from .procs import ROOT

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
