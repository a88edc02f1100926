"""Fixtures for the plugin tests (helpers live in cxlkv_testkit)."""

import pytest

from cxlkv_testkit import Etcd, Sidecar, elected_node, free_port

# Short timings, as tests/cluster.rs uses: a follower that lost the primary
# shows it within a second instead of the defaults' seconds.
CLUSTER_TIMINGS = "[cluster]\nheartbeat_ms = 100\nlease_ms = 600\ndead_after_ms = 1000\nforward_timeout_ms = 500\n"


@pytest.fixture
def sidecar(tmp_path):
    s = Sidecar(tmp_path).start()
    yield s
    s.kill()


@pytest.fixture
def cluster(tmp_path):
    """Nodes a (primary), b, c on one 16 MiB pool file; every process is
    killed at the end, whatever failed."""
    cfg = tmp_path / "cluster.toml"
    cfg.write_text(CLUSTER_TIMINGS)
    peer = f"127.0.0.1:{free_port()}"
    nodes: dict[str, Sidecar] = {}

    def start(name: str, *role: str) -> None:
        s = Sidecar(tmp_path, name, pool_size="16MiB",
                    extra=("--config", str(cfg), "--node-name", name, "--primary", "a", *role))
        nodes[name] = s  # before start(): a node that fails to come up is still killed
        s.start()

    try:
        # The primary first: it formats the pool the followers then open, and
        # a follower is ready only once it has joined.
        start("a", "--peer-addr", peer)
        start("b", "--primary-addr", peer)
        start("c", "--primary-addr", peer)
        yield nodes
    finally:
        for s in nodes.values():
            s.kill()


@pytest.fixture
def elected_cluster(tmp_path):
    """A real etcd and nodes a, b, c on one 32 MiB pool, each campaigning for
    primary through it (no node is named primary); every process is killed at
    the end (a stopped one is resumed first), whatever failed."""
    nodes: dict[str, Sidecar] = {}
    etcd = Etcd(tmp_path)
    try:
        etcd.start()
        # One at a time: the first formats the pool the others then open.
        for name in "abc":
            nodes[name] = elected_node(tmp_path, name, etcd.endpoint, pool_size="32MiB")
            nodes[name].start()
        yield nodes
    finally:
        for s in nodes.values():
            s.kill()
        etcd.kill()
