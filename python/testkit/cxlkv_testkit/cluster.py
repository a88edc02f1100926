"""Elected nodes: sidecars that campaign for primary through etcd, and
the roles they report."""

from __future__ import annotations

import os
import pathlib

from .procs import free_port, wait_for
from .sidecar import Sidecar

# As tests/failover.rs: etcd's lease at its floor of 2 s (the local lease
# lapses after 2/3 of it), so a lost primary is replaced within seconds.
ELECTION_LEASE_S = 2.0
ELECTION_TIMINGS = "heartbeat_ms = 100\nlease_ms = 2000\ndead_after_ms = 3000\nforward_timeout_ms = 1000\n"


def elected_node(dir: pathlib.Path, name: str, etcd_endpoint: str, pool_size: str = "16MiB") -> Sidecar:
    """A sidecar (not started) that campaigns for primary through etcd with
    the short timings above; every node on `dir`'s pool shares the election."""
    cfg = dir / f"{name}.toml"
    cfg.write_text(f'[cluster]\nelection = "etcd"\netcd_endpoints = ["{etcd_endpoint}"]\n{ELECTION_TIMINGS}')
    # The config in `extra`: a test builds its own launcher from these flags.
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
