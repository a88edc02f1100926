"""Mooncake Store's command lines on loopback (the CPU build of the
`mooncake` package that scripts/setup-python.sh installs), for the benchmark
and the two-tier tests: `mooncake_master` with its embedded HTTP metadata
server (what the transfer engine's TCP mode looks peers up in), and a
standalone `mooncake_client` holding the store's memory."""

from __future__ import annotations

import importlib.util
import pathlib


def binary(name: str) -> str:
    """A binary of the installed `mooncake` package."""
    spec = importlib.util.find_spec("mooncake")
    assert spec and spec.submodule_search_locations, "the mooncake package is missing: run scripts/setup-python.sh"
    return str(pathlib.Path(list(spec.submodule_search_locations)[0]) / name)


def master_args(rpc: int, http: int, metrics: int) -> list[str]:
    """The master on 127.0.0.1: RPC on `rpc`, metadata at
    http://127.0.0.1:`http`/metadata, metrics on `metrics`."""
    return [binary("mooncake_master"), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}", "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"]


def store_args(port: int, master: str, metadata: str, store_bytes: int) -> list[str]:
    """A store process on 127.0.0.1:`port` holding `store_bytes` of the
    store's memory, mounted at `master` (TCP transport); its port opens once
    its segment is mounted."""
    return [binary("mooncake_client"), "--host=127.0.0.1", f"--port={port}", f"--master_server_address={master}",
            f"--metadata_server={metadata}", "--protocol=tcp", f"--global_segment_size={store_bytes}"]
