//! Who is the cluster's primary. cxlkv adds no consensus of its own: an
//! existing engine decides, behind one trait, and publishes each change on a
//! watch channel. Backends: `etcd` (etcd's lease and election API) and
//! `kubernetes` (a coordination.k8s.io/v1 Lease through the API server). A
//! `static` cluster (the primary named in the config; no failover) has
//! nothing to elect and no terms: the server starts its one role directly.
//!
//! The epoch (etcd: the create revision of the leader's election key;
//! kubernetes: the Lease's `leaseTransitions`) grows with every new leader; a primary writes it into the pool when it takes
//! over and checks it before every later write of pool-wide metadata, so a
//! deposed primary that wakes up is refused (`pool/epoch.rs`).
pub mod apiserver;
pub mod etcd;
pub mod kubernetes;

use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::cluster::config::ClusterConfig;
use crate::error::{Error, Result};
use crate::registry::directory::Fence;

pub use crate::cluster::config::ElectionKind;

/// The primary as the election sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leader {
    pub name: String,
    pub peer_addr: String,
}

/// What every node acts on: who leads, in which epoch, and whether it is us.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Leadership {
    pub leader: Option<Leader>,
    pub epoch: u64,
    pub i_lead: bool,
}

#[tonic::async_trait]
pub trait Election: Send + Sync + 'static {
    /// The backend's name, for `cxlkv status` and metrics.
    fn backend(&self) -> &'static str;
    /// Publish the leadership on `tx` until `shutdown`. While this node
    /// leads, `lease` is renewed with every confirmation from the engine
    /// and must run out before the engine's own lease can expire, so a
    /// primary that cannot renew stops acting as one first (`lease.held()`
    /// is checked on every registry call of an elected primary).
    async fn run(self: Box<Self>, tx: watch::Sender<Leadership>, lease: Arc<Fence>, shutdown: CancellationToken);
}

/// The configured backend of an elected cluster (`ClusterConfig::elected`).
pub fn from_config(c: &ClusterConfig) -> Result<Box<dyn Election>> {
    match c.election {
        ElectionKind::Static => {
            Err(Error::invalid("cluster.election = \"static\" elects nothing: the primary is cluster.primary"))
        }
        ElectionKind::Etcd => Ok(Box::new(etcd::Etcd::new(c)?)),
        ElectionKind::Kubernetes => {
            let timeout = kubernetes::request_timeout(c.lease_ms);
            let store = apiserver::ApiLeases::in_cluster(&c.election_name, &c.lease_namespace, timeout)?;
            tracing::info!(lease = %store.describe(), "election through the Kubernetes API server");
            let me = Leader { name: c.node_name.clone(), peer_addr: c.peer_addr.clone() };
            Ok(Box::new(kubernetes::Kubernetes::new(store, me, c.lease_ms)))
        }
    }
}

/// How long an elected primary's local lease lasts past each confirmation:
/// 2/3 of the engine's lease (`lease_ms` rounded up to whole seconds, at
/// least 2 s: etcd's floor, and the Lease's), so it lapses first.
pub fn lease_window_ms(c: &ClusterConfig) -> u64 {
    c.lease_ms.div_ceil(1000).max(2) * 1000 * 2 / 3
}

/// The value a candidate campaigns with: "name|peer_addr".
pub fn encode(name: &str, peer_addr: &str) -> String {
    format!("{name}|{peer_addr}")
}

pub fn decode(v: &str) -> Option<Leader> {
    let (name, addr) = v.split_once('|')?;
    Some(Leader { name: name.to_owned(), peer_addr: addr.to_owned() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_campaign_value_names_the_node_and_its_peer_address() {
        let v = encode("node-a", "10.0.0.1:50052");
        assert_eq!(decode(&v), Some(Leader { name: "node-a".into(), peer_addr: "10.0.0.1:50052".into() }));
        assert_eq!(decode("garbage"), None);
    }
}
