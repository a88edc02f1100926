//! The tests' loopback ports for listeners lie outside the host's ephemeral
//! range: a port picked from that range could be taken by any outgoing
//! connection (another test's follower dialling its primary) before the
//! sidecar bound it, and the sidecar failed with "Address already in use".
mod common;

use std::collections::HashSet;

#[test]
fn a_listening_port_is_never_one_an_outgoing_connection_may_take() {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap();
    let bounds: Vec<u16> = range.split_whitespace().map(|w| w.parse().unwrap()).collect();
    let ephemeral = bounds[0]..=bounds[1];
    let picks: Vec<u16> = (0..200).map(|_| common::free_port()).collect();
    for p in &picks {
        assert!(!ephemeral.contains(p), "port {p} is in the ephemeral range {ephemeral:?}");
    }
    assert_eq!(picks.iter().collect::<HashSet<_>>().len(), picks.len(), "a port was picked twice");
}
