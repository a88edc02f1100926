//! A primary's term: before its handler is built, the pool's epoch, this
//! node's id and the whole pool's registry boundary (`prepare`); once the
//! handler has rebuilt that registry from the pool, the peer service and
//! the primary's sweeps (`serve`).
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;

use super::claimer::PrimaryClaimer;
use super::config::ClusterConfig;
use super::notices::Notices;
use super::peer_service::PeerService;
use super::primary::Primary;
use super::records::PoolRecords;
use super::{epoch, reclaim, Role};
use crate::auth::ServerAuth;
use crate::conn::ConnLimits;
use crate::error::{Error, Result};
use crate::handler::Handler;
use crate::peer_proto::peer_server::PeerServer;
use crate::pool::{NodeId, Pool};
use crate::registry::directory::Fence;
use crate::registry::{LocalDirectory, LocalRegistry};

pub struct Lead {
    pub node: NodeId,
    /// The registry of the whole pool, behind its boundary.
    pub dir: Arc<LocalDirectory>,
    /// Regions claimed in this process, and phase 3 for the primary's own
    /// reserves once `serve` has made the primary.
    pub claimer: Arc<PrimaryClaimer>,
    notices: Arc<Notices>,
    cluster: ClusterConfig,
    pool: Arc<Pool>,
    epoch: u64,
    reservation_timeout_ms: u64,
    started: Instant,
}

impl Lead {
    /// `elected`: the election's epoch and this node's lease (none: a
    /// static primary). `registry` is empty; the handler built with `dir`
    /// rebuilds it from every region's records.
    pub fn prepare(
        cluster: &ClusterConfig,
        pool: Arc<Pool>,
        registry: LocalRegistry,
        reservation_timeout_ms: u64,
        view_grace_ms: u64,
        elected: Option<(u64, Arc<Fence>)>,
    ) -> Result<Self> {
        let epoch = elected.as_ref().map_or(0, |e| e.0);
        metrics::gauge!(crate::metric_names::CLUSTER_EPOCH).set(epoch as f64);
        if let Some((epoch, _)) = &elected {
            // First: a primary of a later epoch may already have written the
            // pool; then this one must not write anything.
            pool.take_epoch(*epoch)?;
        }
        // Nobody is alive yet: a full table gives up an entry owning nothing.
        let node = NodeId(pool.node_id_reusing(&cluster.node_name, |_| true)?);
        let records = Arc::new(PoolRecords(pool.clone()));
        let registry = Arc::new(registry.with_seq_store(records.clone(), pool.seq_mark()?));
        let notices = Arc::new(Notices::default());
        // Followers may answer from holds of the previous primary for as
        // long as their lease from it lasts, and views locked before may be
        // read until the pool's view-lock mark: nothing committed goes before.
        let grace = (cluster.lease_ms + cluster.heartbeat_ms).max(view_grace_ms);
        let mut dir = LocalDirectory::with_sink(registry, notices.clone()).with_eraser(records).with_grace(grace);
        if let Some((_, lease)) = elected {
            dir = dir.with_lease(lease);
        }
        let claimer = Arc::new(PrimaryClaimer { pool: pool.clone(), primary: std::sync::OnceLock::new() });
        Ok(Self {
            node,
            dir: Arc::new(dir),
            claimer,
            notices,
            cluster: cluster.clone(),
            pool,
            epoch,
            reservation_timeout_ms,
            started: Instant::now(),
        })
    }

    /// Serve the peer service with `handler` (built with `dir` and
    /// `claimer`, its registry rebuilt) and the pool's event stream
    /// `events` for followers to relay, and run the primary's sweeps.
    pub async fn serve(
        self,
        handler: Arc<Handler>,
        events: Option<Arc<crate::events::EventLog>>,
        auth: &ServerAuth,
        limits: ConnLimits,
        shutdown: CancellationToken,
    ) -> Result<Role> {
        let c = &self.cluster;
        if handler.rebuilt().restored == 0 {
            self.dir.end_grace(); // nothing committed: nothing anybody can hold
        }
        let took = self.started.elapsed();
        metrics::gauge!(crate::metric_names::CLUSTER_TAKEOVER_SECONDS).set(took.as_secs_f64());
        metrics::counter!(crate::metric_names::CLUSTER_ELECTIONS_WON).increment(0);
        tracing::info!(
            ms = took.as_millis() as u64,
            keys = handler.rebuilt().restored,
            "registry of the whole pool rebuilt"
        );
        let (timeout, dir) = (self.reservation_timeout_ms, self.dir.clone());
        let primary = Arc::new(Primary::new(
            self.pool,
            self.node.0,
            dir.clone(),
            self.notices,
            handler.instance_id(),
            c,
            timeout,
        ));
        // Clients of the previous instance (of this node or of a follower
        // whose reservations this primary never learned of) may still copy
        // into objects being written: their regions change hands no sooner
        // than such a reservation could still be in use.
        for r in handler.regions_being_written() {
            primary.reclaims().fence(r, dir.now_ms() + timeout + reclaim::FENCE_MARGIN_MS);
        }
        // Before the peer service: the primary's regions and reserves take
        // part in phase 3 as every other node's do.
        primary.attach(&handler);
        let gate = reclaim::Gate { reclaims: primary.reclaims().clone(), pool: handler.pool_arc() };
        dir.set_gate(Arc::new(gate));
        let _ = self.claimer.primary.set(primary.clone());
        let peers = PeerService::new(primary.clone(), handler.clone(), c.node_name.clone(), events);
        serve_peers(c, peers, auth, limits, self.epoch, shutdown.clone()).await?;
        spawn_sweeps(primary.clone(), handler, shutdown);
        Ok(Role::Primary(primary, c.node_name.clone()))
    }
}

/// The peer service on `cluster.peer_addr`, with the client API's
/// credentials (node credentials only: `epoch::EpochCheck`) and limits.
async fn serve_peers(
    c: &ClusterConfig,
    peers: PeerService,
    auth: &ServerAuth,
    limits: ConnLimits,
    term_epoch: u64,
    shutdown: CancellationToken,
) -> Result<()> {
    let addr: std::net::SocketAddr =
        c.peer_addr.parse().map_err(|_| Error::invalid(format!("bad cluster.peer_addr {:?}", c.peer_addr)))?;
    auth.check_tcp_exposure(addr)?;
    let l = tokio::net::TcpListener::bind(addr).await.map_err(|e| Error::io(format!("bind peer {addr}"), e))?;
    tracing::info!(addr = %addr, node = peers.node().0, "peer service listening (primary)");
    // The client API's limits, not tonic's 4 MiB default: any call a client
    // may make of a follower must fit when forwarded.
    let svc = PeerServer::new(peers)
        .max_decoding_message_size(crate::wire::MAX_PEER_MESSAGE)
        .max_encoding_message_size(crate::wire::MAX_PEER_MESSAGE);
    let svc = auth.tcp_guard(InterceptedService::new(svc, epoch::EpochCheck(term_epoch)));
    let mut server = auth.tcp_server()?.tcp_nodelay(true).http2_keepalive_interval(Some(Duration::from_secs(1)));
    tokio::spawn(async move {
        // Accepted with TCP_NODELAY: a forwarded call is one small request
        // and reply, which Nagle + delayed ACK would hold ~40 ms. Bounded as
        // the client listeners are (no session's locks to release).
        let incoming = crate::conn::nodelay(tokio_stream::wrappers::TcpListenerStream::new(l));
        let incoming = crate::conn::sessions(incoming, tokio::sync::mpsc::unbounded_channel().0, limits, "peer");
        let served = server.add_service(svc).serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned());
        if let Err(e) = served.await {
            tracing::error!(error = %e, "peer service stopped");
        }
    });
    Ok(())
}

/// Liveness (nodes declared dead), the region table's repair, and the free
/// notices owed to the primary's own regions.
fn spawn_sweeps(primary: Arc<Primary>, handler: Arc<Handler>, shutdown: CancellationToken) {
    metrics::counter!(crate::metric_names::CLUSTER_NODES_DECLARED_DEAD).increment(0);
    metrics::counter!(crate::metric_names::CLUSTER_REGION_RECLAIMS, "result" => "acked").increment(0);
    metrics::counter!(crate::metric_names::CLUSTER_RECLAIMED_ENTRIES).increment(0);
    metrics::counter!(crate::metric_names::CLUSTER_REGION_REPAIRS).increment(0);
    metrics::counter!(crate::metric_names::CLUSTER_STALE_OPS).increment(0);
    metrics::counter!(crate::metric_names::CLUSTER_EPOCH_REFUSALS, "caller" => "older").increment(0);
    tokio::spawn(async move {
        let mut acked = 0u64;
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        for n in 0u64.. {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            primary.sweep();
            if n % 10 == 0 {
                let p = primary.clone();
                let _ = tokio::task::spawn_blocking(move || p.repair_region_table()).await;
            }
            let (locs, last) = primary.notices().pending(handler.node(), acked, 65_536);
            handler.release(&locs);
            acked = last;
            let alive = primary.nodes().iter().filter(|(_, n)| n.alive).count();
            metrics::gauge!(crate::metric_names::CLUSTER_PEERS_ALIVE).set(alive as f64);
        }
    });
}
