//! `[cluster]`: whether this sidecar is one of several on one pool, which
//! one is primary and how it is elected, and the cluster's timings, with
//! the checks that keep them consistent.
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Which election backend picks the primary; an unknown name is refused
/// with the list of known ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ElectionKind {
    /// The node named by `cluster.primary`; no failover.
    #[default]
    Static,
    Etcd,
    Kubernetes,
}

impl ElectionKind {
    /// The name in configs, `cxlkv status` and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            ElectionKind::Static => "static",
            ElectionKind::Etcd => "etcd",
            ElectionKind::Kubernetes => "kubernetes",
        }
    }
}

/// Several hosts on one pool (empty `node_name` = single node). One node,
/// `primary`, holds the registry of the whole pool; the others forward to it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// This node's name (Kubernetes: the node name from the downward API).
    pub node_name: String,
    /// Where this node's peer service listens (TCP host:port).
    pub peer_addr: String,
    /// Name of the primary node (static election).
    pub primary: String,
    /// The primary's peer address (host:port), for followers.
    pub primary_addr: String,
    /// `static` (the node named by `primary`), `etcd` or `kubernetes`.
    pub election: ElectionKind,
    /// etcd client URLs (election = "etcd").
    pub etcd_endpoints: Vec<String>,
    /// The etcd election every node campaigns on, or the name of the
    /// coordination.k8s.io Lease (election = "kubernetes").
    pub election_name: String,
    /// The Lease's namespace; empty: the service account's own (its
    /// namespace file), i.e. the namespace the DaemonSet runs in.
    pub lease_namespace: String,
    /// A follower's heartbeat period.
    pub heartbeat_ms: u64,
    /// A follower that has not heard from the primary for this long stops
    /// writing (self-fencing).
    pub lease_ms: u64,
    /// The primary declares a node dead after this much silence (> lease).
    pub dead_after_ms: u64,
    /// Longest a forwarded call may take.
    pub forward_timeout_ms: u64,
    /// A follower answers lookups of keys it read recently without asking
    /// the primary: the primary locks them for the node, which gives such a
    /// lock back once no client of its read the key for this long. 0: every
    /// lookup goes to the primary.
    pub hold_idle_ms: u64,
    /// How a follower authenticates to the primary's peer service (which
    /// checks the [auth]/[tls] settings like the client API): a token file
    /// (an operator token), and for TLS the CA of the primary's certificate
    /// plus this node's certificate and key.
    pub token_file: String,
    pub tls_ca: String,
    pub tls_cert: String,
    pub tls_key: String,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            node_name: String::new(),
            peer_addr: String::new(),
            primary: String::new(),
            primary_addr: String::new(),
            election: ElectionKind::Static,
            etcd_endpoints: vec![],
            election_name: "cxlkv-primary".into(),
            lease_namespace: String::new(),
            heartbeat_ms: 200,
            lease_ms: 2_000,
            dead_after_ms: 3_000,
            forward_timeout_ms: 1_000,
            hold_idle_ms: 500,
            token_file: String::new(),
            tls_ca: String::new(),
            tls_cert: String::new(),
            tls_key: String::new(),
        }
    }
}

impl ClusterConfig {
    pub fn enabled(&self) -> bool {
        !self.node_name.is_empty()
    }
    pub fn is_primary(&self) -> bool {
        self.enabled() && self.node_name == self.primary
    }
    /// The primary is elected (and may change while running).
    pub fn elected(&self) -> bool {
        self.enabled() && self.election != ElectionKind::Static
    }
    pub fn validate(&self) -> Result<()> {
        if !self.enabled() {
            return Ok(());
        }
        match self.election {
            ElectionKind::Static => {}
            ElectionKind::Etcd => {
                if self.etcd_endpoints.is_empty() || self.peer_addr.is_empty() {
                    return Err(Error::invalid(
                        "cluster.election = \"etcd\" needs cluster.etcd_endpoints and this node's cluster.peer_addr",
                    ));
                }
                return self.validate_timings();
            }
            ElectionKind::Kubernetes => return self.validate_kubernetes(),
        }
        if self.node_name.len() > crate::pool::MAX_NODE_NAME || self.primary.is_empty() {
            return Err(Error::invalid(format!(
                "cluster.node_name must be 1..={} bytes and cluster.primary must name the primary",
                crate::pool::MAX_NODE_NAME
            )));
        }
        let addr = if self.is_primary() { &self.peer_addr } else { &self.primary_addr };
        if addr.is_empty() {
            let which = if self.is_primary() { "cluster.peer_addr" } else { "cluster.primary_addr" };
            return Err(Error::invalid(format!("{which} is required for this node's role")));
        }
        self.validate_timings()
    }

    /// The Lease's name and namespace are Kubernetes object names (checked
    /// here rather than refused by the API server at every round).
    fn validate_kubernetes(&self) -> Result<()> {
        if self.peer_addr.is_empty() || self.node_name.len() > crate::pool::MAX_NODE_NAME {
            return Err(Error::invalid(format!(
                "cluster.election = \"kubernetes\" needs this node's cluster.peer_addr (the address the others \
                 reach it at) and a cluster.node_name of at most {} bytes",
                crate::pool::MAX_NODE_NAME
            )));
        }
        if !dns_name(&self.election_name, 253) {
            return Err(Error::invalid(format!(
                "cluster.election_name {:?} is not a Lease name (lowercase letters, digits, '-' and '.', \
                 starting and ending with a letter or digit, at most 253)",
                self.election_name
            )));
        }
        if !self.lease_namespace.is_empty()
            && (!dns_name(&self.lease_namespace, 63) || self.lease_namespace.contains('.'))
        {
            return Err(Error::invalid(format!(
                "cluster.lease_namespace {:?} is not a namespace name (lowercase letters, digits and '-', at most 63)",
                self.lease_namespace
            )));
        }
        self.validate_timings()
    }

    fn validate_timings(&self) -> Result<()> {
        if self.lease_ms == 0 || self.dead_after_ms <= self.lease_ms || self.heartbeat_ms * 2 > self.lease_ms {
            return Err(Error::invalid(
                "cluster timings must satisfy 2 * heartbeat_ms <= lease_ms < dead_after_ms".to_string(),
            ));
        }
        if self.hold_idle_ms > 60_000 {
            // A held key cannot be deleted or evicted: keep that short.
            return Err(Error::invalid(format!(
                "cluster.hold_idle_ms {} is over 60000 (a key a follower holds cannot be deleted or evicted)",
                self.hold_idle_ms
            )));
        }
        Ok(())
    }
}

/// A DNS-1123 subdomain of at most `max` bytes (Kubernetes object names).
fn dns_name(s: &str, max: usize) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !s.is_empty()
        && s.len() <= max
        && s.starts_with(alnum)
        && s.ends_with(alnum)
        && s.chars().all(|c| alnum(c) || c == '-' || c == '.')
}
