"""The kit's loopback ports for listeners lie outside the host's ephemeral
range: a port picked from that range could be taken by any outgoing
connection before the listener bound it ("Address already in use")."""

import pathlib

from cxlkv_testkit.procs import free_port


def test_a_listening_port_is_never_one_an_outgoing_connection_may_take():
    low, high = map(int, pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    picks = [free_port() for _ in range(200)]
    assert not [p for p in picks if low <= p <= high]
    assert len(set(picks)) == len(picks), "a port was picked twice"
