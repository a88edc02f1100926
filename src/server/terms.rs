//! An elected cluster's terms: each change of leader, or of whether this
//! node leads, ends the node's term; its role is drained and the next one
//! built (`node.rs`) in the same process.
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Term;
use crate::auth::ServerAuth;
use crate::config::Config;
use crate::election::Leadership;
use crate::error::Result;
use crate::registry::directory::Fence;

/// An elected cluster (`cluster.election` other than "static"): follow the
/// election. Each change of leader (or of whether this node leads) ends the
/// current term: the role is drained and the next one started, as a
/// primary (rebuilding the pool-wide registry from the pool's records and
/// writing its epoch into the pool) or as a follower of the new leader.
pub(super) async fn run_elected(
    cfg: &Config,
    auth: &ServerAuth,
    prom: super::Prometheus,
    ready: Arc<AtomicBool>,
    shutdown: CancellationToken,
) -> Result<()> {
    let election = crate::election::from_config(&cfg.cluster)?;
    let backend = election.backend();
    let (tx, mut rx) = tokio::sync::watch::channel(Leadership::default());
    let lease = Arc::new(Fence::new(crate::election::lease_window_ms(&cfg.cluster)));
    tokio::spawn(election.run(tx, lease.clone(), shutdown.clone()));
    loop {
        let Some(l) = next_term(&mut rx, &cfg.cluster.node_name, &shutdown).await else { return Ok(()) };
        let leader = l.leader.clone().expect("a term has a leader");
        let mut c = cfg.clone();
        c.cluster.primary = leader.name.clone();
        c.cluster.primary_addr = leader.peer_addr.clone();
        let term = shutdown.child_token();
        tokio::spawn(end_term_on_change(rx.clone(), l.clone(), term.clone()));
        ::metrics::gauge!(crate::metric_names::CLUSTER_EPOCH).set(l.epoch as f64);
        tracing::warn!(leader = %leader.name, epoch = l.epoch, i_lead = l.i_lead, "new term");
        let own_lease = l.i_lead.then(|| lease.clone());
        match crate::node::build(&c, auth, term.clone(), l.epoch, own_lease).await {
            Ok(node) => {
                let t = Term { backend, epoch: l.epoch };
                // A listener of the last term may still be closing: the next
                // term tries again rather than ending the process.
                if let Err(e) = super::serve(&c, auth, prom.clone(), ready.clone(), (node, t), term.clone()).await {
                    tracing::warn!(error = %e, "this term's role stopped with an error");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot take this term's role; waiting for the next term");
                tokio::select! {
                    _ = term.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
            }
        }
        term.cancel();
        if shutdown.is_cancelled() {
            return Ok(());
        }
    }
}

/// The next leadership with a leader this node can act on (None: shutdown).
/// A leader with this node's name that this process did not win (a key of
/// an earlier life of this node) is waited out.
async fn next_term(
    rx: &mut tokio::sync::watch::Receiver<Leadership>,
    me: &str,
    shutdown: &CancellationToken,
) -> Option<Leadership> {
    loop {
        let l = rx.borrow_and_update().clone();
        if let Some(leader) = &l.leader {
            if (leader.name == me) == l.i_lead {
                return Some(l);
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = rx.changed() => r.ok()?,
        }
    }
}

/// Cancel `term` when the leader, or whether this node leads, changes.
async fn end_term_on_change(mut rx: tokio::sync::watch::Receiver<Leadership>, at: Leadership, term: CancellationToken) {
    loop {
        tokio::select! {
            _ = term.cancelled() => return,
            r = rx.changed() => {
                let now = rx.borrow_and_update().clone();
                if r.is_err() || now.leader != at.leader || now.i_lead != at.i_lead {
                    term.cancel();
                    return;
                }
            }
        }
    }
}
