//! Several hosts on one pool. One sidecar, the primary (named in the
//! config: static election), holds the registry of the whole pool and is
//! the only writer of pool-wide metadata (node table, region table). Every
//! other sidecar is a follower: it allocates pages in its own regions and
//! forwards registry calls to the primary over the peer service
//! (`proto/peer.proto`), coalesced; it learns of pages freed elsewhere
//! through free notices that ride on its heartbeats, and stops writing when
//! its lease runs out. Nothing here runs on a single node.
//!
//! A node's role is built in two steps around its handler (`node.rs` builds
//! every node): `Lead::prepare` / `Follow::join` make what the handler needs
//! (the registry boundary, how regions are claimed, what the primary said
//! at join), then `Lead::serve` / `Follow::follow` start the peer service or
//! the heartbeat with the handler and give the node its `Role`.
mod batcher;
mod claimer;
pub mod clock;
pub mod config;
pub mod epoch;
pub mod follower;
pub mod forward;
pub mod holds;
mod lead;
pub mod notices;
pub mod peer_service;
pub mod primary;
pub mod reclaim;
mod records;
mod relay;

use std::sync::Arc;

use crate::handler::Handler;
pub use follower::Follow;
use forward::Forwarded;
pub use lead::Lead;
use primary::Primary;

pub use epoch::Client;

/// What this sidecar is in its pool.
pub enum Role {
    Single,
    /// The primary, and its node name.
    Primary(Arc<Primary>, String),
    Follower(Arc<Forwarded>),
}

impl Role {
    /// The cluster's nodes, for `cxlkv status` (a follower asks the primary).
    pub async fn nodes(&self, handler: &Handler) -> Vec<crate::proto::ClusterNode> {
        match self {
            Role::Single => vec![],
            Role::Primary(p, name) => p.cluster_nodes(handler.regions(), name),
            Role::Follower(f) => f.cluster_nodes().await.unwrap_or_default(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Role::Single => "single",
            Role::Primary(..) => "primary",
            Role::Follower(_) => "follower",
        }
    }
}
