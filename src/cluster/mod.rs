//! Several hosts on one pool. One sidecar, the primary (named in the
//! config: static election), holds the registry of the whole pool and is
//! the only writer of pool-wide metadata (node table, region table). Every
//! other sidecar is a follower: it allocates pages in its own regions and
//! forwards registry calls to the primary over the peer service
//! (`proto/peer.proto`), coalesced; it learns of pages freed elsewhere
//! through free notices that ride on its heartbeats, and stops writing when
//! its lease runs out. Nothing here runs on a single node.
mod batcher;
pub mod convert;
pub mod deadline;
pub mod epoch;
pub mod follower;
pub mod forward;
pub mod holds;
pub mod primary;
pub mod reclaim;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::auth::{ClientAuth, ServerAuth};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::handler::{Handler, Limits};
use crate::peer_proto::peer_client::PeerClient;
use crate::peer_proto::peer_server::PeerServer;
use crate::pool::{NodeId, Pool};
use crate::registry::{LocalDirectory, LocalRegistry};
use forward::{Fence, Forwarded, Ident};
use primary::{Notices, PeerService, Primary, PrimaryClaimer};

/// A follower's client of the primary's peer service.
pub type Client = PeerClient<InterceptedService<Channel, epoch::Stamp>>;

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

fn client_auth(cfg: &crate::config::ClusterConfig) -> ClientAuth {
    let p = |s: &str| (!s.is_empty()).then(|| PathBuf::from(s));
    ClientAuth {
        token_file: p(&cfg.token_file),
        tls_ca: p(&cfg.tls_ca),
        tls_cert: p(&cfg.tls_cert),
        tls_key: p(&cfg.tls_key),
        tls_domain: None,
    }
}

/// The primary: registry of the whole pool, rebuilt from every region's
/// records, and the peer service on `cluster.peer_addr`.
/// `elected`: the election's epoch and this node's lease (no lease: static).
pub async fn start_primary(
    cfg: &Config,
    pool: Arc<Pool>,
    shutdown: CancellationToken,
    elected: Option<(u64, Arc<Fence>)>,
) -> Result<(Arc<Handler>, Role)> {
    let c = &cfg.cluster;
    let t = std::time::Instant::now();
    let term_epoch = elected.as_ref().map_or(0, |e| e.0);
    metrics::gauge!("cxlkv_cluster_epoch").set(term_epoch as f64);
    let mut dir_lease = None;
    if let Some((epoch, lease)) = elected {
        // First: a primary of a later epoch may already have written the
        // pool; then this one must not write anything.
        pool.take_epoch(epoch)?;
        dir_lease = Some(lease);
    }
    // Nobody is alive yet: a full table gives up an entry owning nothing.
    let node = pool.node_id_reusing(&c.node_name, |_| true)?;
    let r = &cfg.registry;
    let records = Arc::new(primary::PoolRecords(pool.clone()));
    let registry = Arc::new(
        LocalRegistry::with_policy(r.eviction.config(r.eviction_policy), r.max_tenants)
            .with_quotas(cfg.quotas.clone())
            .with_pin_limit(crate::server::pin_limit(cfg, &pool))
            .with_seq_store(records.clone(), pool.seq_mark()?),
    );
    let notices = Arc::new(Notices::default());
    // Followers may answer from holds of the previous primary for as long
    // as their lease from it lasts: nothing committed goes before then.
    let grace = c.lease_ms + c.heartbeat_ms;
    let mut dir = LocalDirectory::with_sink(registry, notices.clone()).with_eraser(records).with_grace(grace);
    if let Some(l) = dir_lease {
        dir = dir.with_lease(l);
    }
    let dir = Arc::new(dir);
    let (p, d, limits) = (pool.clone(), dir.clone(), Limits::from_config(cfg));
    let claimer = Arc::new(PrimaryClaimer { pool: pool.clone(), primary: std::sync::OnceLock::new() });
    let cl = claimer.clone();
    let handler = tokio::task::spawn_blocking(move || Handler::with_claimer(p, NodeId(node), d, cl, limits, true))
        .await
        .map_err(|e| Error::new(crate::error::ErrorKind::Internal, e.to_string()))??;
    let handler = Arc::new(handler);
    if handler.rebuilt().restored == 0 {
        dir.end_grace(); // nothing committed: nothing any follower can hold
    }
    let took = t.elapsed();
    metrics::gauge!("cxlkv_cluster_takeover_seconds").set(took.as_secs_f64());
    metrics::counter!("cxlkv_cluster_elections_won_total").increment(0);
    tracing::info!(
        ms = took.as_millis() as u64,
        keys = handler.rebuilt().restored,
        "registry of the whole pool rebuilt"
    );
    let timeout = cfg.registry.reservation_timeout_ms;
    let primary = Arc::new(Primary::new(pool, node, dir.clone(), notices, handler.instance_id(), c, timeout));
    // Clients of the previous instance (of this node or of a follower
    // whose reservations this primary never learned of) may still copy
    // into objects being written: their regions change hands no sooner
    // than such a reservation could still be in use.
    for r in handler.regions_being_written() {
        primary.reclaims().fence(r, dir.now_ms() + timeout + reclaim::FENCE_MARGIN_MS);
    }
    // Before the peer service: the primary's regions and reserves take part
    // in phase 3 as every other node's do.
    primary.attach(&handler);
    let _ = claimer.primary.set(primary.clone());
    let auth = ServerAuth::from_config(&cfg.auth, &cfg.tls)?;
    let addr: std::net::SocketAddr =
        c.peer_addr.parse().map_err(|_| Error::invalid(format!("bad cluster.peer_addr {:?}", c.peer_addr)))?;
    auth.check_tcp_exposure(addr)?;
    let l = tokio::net::TcpListener::bind(addr).await.map_err(|e| Error::io(format!("bind peer {addr}"), e))?;
    tracing::info!(addr = %addr, node, "peer service listening (primary)");
    // The client API's limits, not tonic's 4 MiB default: any call a client
    // may make of a follower must fit when forwarded.
    let svc = PeerServer::new(PeerService(primary.clone(), handler.clone(), c.node_name.clone()))
        .max_decoding_message_size(crate::wire::MAX_PEER_MESSAGE)
        .max_encoding_message_size(crate::wire::MAX_PEER_MESSAGE);
    let svc = auth.tcp_guard(InterceptedService::new(svc, epoch::EpochCheck(term_epoch)));
    let mut server = auth.tcp_server()?.tcp_nodelay(true).http2_keepalive_interval(Some(Duration::from_secs(1)));
    let (sd, limits) = (shutdown.clone(), crate::conn::ConnLimits::from_config(&cfg.server));
    tokio::spawn(async move {
        // Accepted with TCP_NODELAY: a forwarded call is one small request
        // and reply, which Nagle + delayed ACK would hold ~40 ms.
        let incoming = crate::server::nodelay(tokio_stream::wrappers::TcpListenerStream::new(l));
        // Bounded as the client listeners are (no session's locks to release).
        let incoming = crate::conn::sessions(incoming, tokio::sync::mpsc::unbounded_channel().0, limits, "peer");
        if let Err(e) = server.add_service(svc).serve_with_incoming_shutdown(incoming, sd.cancelled_owned()).await {
            tracing::error!(error = %e, "peer service stopped");
        }
    });
    metrics::counter!("cxlkv_cluster_nodes_declared_dead_total").increment(0);
    metrics::counter!("cxlkv_cluster_region_reclaims_total", "result" => "acked").increment(0);
    metrics::counter!("cxlkv_cluster_reclaimed_entries_total").increment(0);
    metrics::counter!("cxlkv_cluster_region_repairs_total").increment(0);
    metrics::counter!("cxlkv_cluster_epoch_refusals_total", "caller" => "older").increment(0);
    // Liveness, and the free notices owed to the primary's own regions.
    let (pr, h) = (primary.clone(), handler.clone());
    tokio::spawn(async move {
        let mut acked = 0u64;
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        for n in 0u64.. {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            pr.sweep();
            if n % 10 == 0 {
                let p = pr.clone();
                let _ = tokio::task::spawn_blocking(move || p.repair_region_table()).await;
            }
            let (locs, last) = pr.notices().pending(h.node(), acked, 65_536);
            h.release(&locs);
            acked = last;
            let alive = pr.nodes().iter().filter(|(_, n)| n.alive).count();
            metrics::gauge!("cxlkv_cluster_peers_alive").set(alive as f64);
        }
    });
    Ok((handler, Role::Primary(primary, c.node_name.clone())))
}

/// A follower: join the primary (retrying until it answers or shutdown),
/// take the regions it reports, then heartbeat. Every peer call carries
/// `epoch`, the term's (0 in a static cluster).
pub async fn start_follower(
    cfg: &Config,
    pool: Arc<Pool>,
    shutdown: CancellationToken,
    epoch: u64,
) -> Result<(Arc<Handler>, Role)> {
    let c = &cfg.cluster;
    let auth = client_auth(c);
    let timeout = Duration::from_millis(c.forward_timeout_ms);
    let channel = auth
        .endpoint(&c.primary_addr)?
        .connect_timeout(timeout)
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(1))
        .keep_alive_while_idle(true)
        .connect_lazy();
    let mut client: Client = PeerClient::with_interceptor(channel, epoch::Stamp::new(auth.token()?, epoch))
        .max_decoding_message_size(crate::wire::MAX_PEER_MESSAGE)
        .max_encoding_message_size(crate::wire::MAX_PEER_MESSAGE);
    let instance = rand::random::<u64>() | 1;
    let uuid = pool.superblock().uuid_string();
    let (joined, rep) = loop {
        match follower::join(&mut client, c, &uuid, instance, cfg.registry.reservation_timeout_ms).await {
            Ok(x) => break x,
            Err(e) if e.kind() == crate::error::ErrorKind::FailedPrecondition => return Err(e),
            Err(e) => {
                let what = if e.kind() == crate::error::ErrorKind::Unavailable {
                    "cannot reach the primary yet; retrying"
                } else {
                    "the primary refused to let this node join; retrying"
                };
                tracing::warn!(error = %e, primary = %c.primary_addr, "{what}");
                tokio::select! {
                    _ = shutdown.cancelled() => return Err(Error::new(crate::error::ErrorKind::Unavailable, "shut down before joining")),
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
            }
        }
    };
    let ident = Arc::new(Ident::default());
    ident.node.store(joined.node.0 as u64, Ordering::Release);
    ident.instance.store(instance, Ordering::Release);
    let fence = Arc::new(Fence::new(rep.lease_ms.max(1)));
    fence.renew();
    let mut forwarded = Forwarded::new(client.clone(), ident.clone(), fence.clone(), timeout);
    if c.hold_idle_ms > 0 {
        forwarded = forwarded.with_holds(c.hold_idle_ms, crate::server::pin_limit(cfg, &pool));
    }
    let forwarded = Arc::new(forwarded);
    spawn_hold_sweeper(forwarded.clone(), c.hold_idle_ms, shutdown.clone());
    forwarded.set_policy(&rep.eviction_policy);
    let claimer = Arc::new(follower::ForwardClaimer { client: client.clone(), ident: ident.clone(), timeout });
    let (p, j, d, limits) = (pool, joined.clone(), forwarded.clone(), Limits::from_config(cfg));
    let handler = tokio::task::spawn_blocking(move || Handler::follower(p, &j, d, claimer, limits))
        .await
        .map_err(|e| Error::new(crate::error::ErrorKind::Internal, e.to_string()))??;
    let handler = Arc::new(handler);
    let hb = follower::Heartbeat {
        client,
        cfg: c.clone(),
        handler: handler.clone(),
        forwarded: forwarded.clone(),
        ident,
        fence,
        primary_instance: rep.primary_instance,
        acked: rep.notice_seq,
        surrendered: vec![],
    };
    tokio::spawn(hb.run(shutdown));
    tracing::info!(node = joined.node.0, primary = %c.primary_addr, "joined the cluster (follower)");
    Ok((handler, Role::Follower(forwarded)))
}

/// Give back the holds no client read for `idle_ms` (`holds.rs`), every
/// half of it; nothing when holds are off.
fn spawn_hold_sweeper(forwarded: Arc<Forwarded>, idle_ms: u64, shutdown: CancellationToken) {
    if idle_ms == 0 {
        return;
    }
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis((idle_ms / 2).max(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(e) = forwarded.sweep_holds().await {
                // Not given back: they lapse at the primary on their own.
                tracing::debug!(error = %e, "giving back idle holds failed");
            }
        }
    });
}
