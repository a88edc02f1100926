//! The Unix socket's side of authentication: an allow-list of uids and
//! gids over who is on the other end (`conn::PeerCred`, SO_PEERCRED), and
//! the socket file's group.
use std::path::Path;

use tokio::net::UnixStream;

pub use crate::conn::PeerCred;
use crate::error::{Error, Result};

/// Peers allowed on the Unix socket: uid in `uids` or primary gid in
/// `gids`. Both empty: everyone the socket's file mode lets in. (SO_PEERCRED
/// carries the primary gid only, not supplementary groups.)
#[derive(Debug, Clone, Default)]
pub struct PeerAllowList {
    uids: Vec<u32>,
    gids: Vec<u32>,
}

impl PeerAllowList {
    pub fn new(uids: &[u32], gids: &[u32]) -> Self {
        Self { uids: uids.to_vec(), gids: gids.to_vec() }
    }

    pub fn is_open(&self) -> bool {
        self.uids.is_empty() && self.gids.is_empty()
    }

    pub fn allows(&self, peer: Option<PeerCred>) -> bool {
        self.is_open() || peer.is_some_and(|p| self.uids.contains(&p.uid) || self.gids.contains(&p.gid))
    }

    /// Whether to serve this connection; a refused one is logged and
    /// counted, and the caller drops (closes) it.
    pub fn admit(&self, s: &UnixStream) -> bool {
        if self.is_open() {
            return true;
        }
        let peer = PeerCred::of(s);
        if self.allows(peer) {
            return true;
        }
        let (uid, gid, pid) = peer.map_or((None, None, None), |p| (Some(p.uid), Some(p.gid), p.pid));
        tracing::warn!(
            ?uid,
            ?gid,
            ?pid,
            "refused a Unix socket connection: peer not in auth.allowed_uids/allowed_gids"
        );
        super::refused("unix", "peer", 1);
        false
    }
}

/// Give the socket file to `group` (a group name or a numeric gid).
pub fn chown_group(path: &Path, group: &str) -> Result<()> {
    use nix::unistd::{Gid, Group};
    let gid = match group.parse::<u32>() {
        Ok(n) => Gid::from_raw(n),
        Err(_) => {
            Group::from_name(group)
                .map_err(|e| Error::io(format!("look up group {group:?}"), e))?
                .ok_or_else(|| Error::invalid(format!("server.socket_group: no group named {group:?}")))?
                .gid
        }
    };
    nix::unistd::chown(path, None, Some(gid)).map_err(|e| Error::io(format!("chgrp {group} {}", path.display()), e))
}
