//! A follower's life: join the primary (its node id, regions and live
//! objects), then heartbeat: each answer renews the lease and brings the
//! free notices owed to this node; a primary that restarted, or that
//! declared this node dead, is joined again.
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::config::ClusterConfig;
use super::epoch::unavailable;
use super::epoch::{self, Client};
use super::forward::{Fence, Forwarded, Ident};
use super::Role;
use crate::auth::ClientAuth;
use crate::error::Result;
use crate::handler::{Claimer, Handler, Joined};
use crate::peer_proto::peer_client::PeerClient;
use crate::peer_proto::{self as pp};
use crate::pool::Pool;
use crate::pool::{NodeId, RegionId};
use crate::registry::convert::from_peer;

/// A follower's term: joined to the primary (its node id, regions and live
/// objects, and the registry boundary that forwards to it), then, with its
/// handler, the heartbeat (`follow`).
pub struct Follow {
    pub joined: Joined,
    pub forwarded: Arc<Forwarded>,
    pub claimer: Arc<ForwardClaimer>,
    heartbeat: Heartbeat0,
}

/// What the heartbeat needs besides the handler.
struct Heartbeat0 {
    client: Client,
    cfg: ClusterConfig,
    ident: Arc<Ident>,
    fence: Arc<Fence>,
    rep: pp::JoinReply,
}

impl Follow {
    /// Join the primary at `cluster.primary_addr`, retrying until it
    /// answers or `shutdown` (a refusal for a wrong configuration stops the
    /// start). Every peer call carries `epoch`, the term's (0: static).
    /// `pin_limit`: what one client may hold locked through held keys.
    pub async fn join(
        c: &ClusterConfig,
        pool: &Pool,
        reservation_timeout_ms: u64,
        pin_limit: u64,
        epoch: u64,
        shutdown: CancellationToken,
    ) -> Result<Self> {
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
            match join(&mut client, c, &uuid, instance, reservation_timeout_ms).await {
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
                        _ = shutdown.cancelled() => return Err(unavailable("shut down before joining")),
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
            forwarded = forwarded.with_holds(c.hold_idle_ms, pin_limit);
        }
        let forwarded = Arc::new(forwarded);
        forwarded.set_policy(&rep.eviction_policy);
        let claimer = Arc::new(ForwardClaimer { client: client.clone(), ident: ident.clone(), timeout });
        let heartbeat = Heartbeat0 { client, cfg: c.clone(), ident, fence, rep };
        Ok(Self { joined, forwarded, claimer, heartbeat })
    }

    /// Start the heartbeat (and the holds' sweeper) with `handler`, built
    /// from what `join` gave, and relay the pool's event stream into
    /// `events` (`[events]` on).
    pub fn follow(
        self,
        handler: Arc<Handler>,
        events: Option<Arc<crate::events::EventLog>>,
        shutdown: CancellationToken,
    ) -> Role {
        let h = self.heartbeat;
        if let Some(log) = events {
            super::relay::spawn(h.client.clone(), log, shutdown.clone());
        }
        spawn_hold_sweeper(self.forwarded.clone(), h.cfg.hold_idle_ms, shutdown.clone());
        tracing::info!(node = self.joined.node.0, primary = %h.cfg.primary_addr, "joined the cluster (follower)");
        let hb = Heartbeat {
            client: h.client,
            cfg: h.cfg,
            handler,
            forwarded: self.forwarded.clone(),
            ident: h.ident,
            fence: h.fence,
            primary_instance: h.rep.primary_instance,
            acked: h.rep.notice_seq,
            surrendered: vec![],
        };
        tokio::spawn(hb.run(shutdown));
        Role::Follower(self.forwarded)
    }
}

fn client_auth(cfg: &ClusterConfig) -> ClientAuth {
    let p = |s: &str| (!s.is_empty()).then(|| PathBuf::from(s));
    ClientAuth {
        token_file: p(&cfg.token_file),
        tls_ca: p(&cfg.tls_ca),
        tls_cert: p(&cfg.tls_cert),
        tls_key: p(&cfg.tls_key),
        tls_domain: None,
    }
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

/// One join: the primary's answer as the handler needs it.
pub async fn join(
    client: &mut Client,
    cfg: &ClusterConfig,
    pool_uuid: &str,
    instance: u64,
    reservation_timeout_ms: u64,
) -> Result<(Joined, pp::JoinReply)> {
    let mut req = tonic::Request::new(pp::JoinRequest {
        name: cfg.node_name.clone(),
        instance,
        peer_addr: cfg.peer_addr.clone(),
        pool_uuid: pool_uuid.to_owned(),
        reservation_timeout_ms,
    });
    req.set_timeout(Duration::from_millis(cfg.forward_timeout_ms));
    let r = client.join(req).await.map_err(refusal)?;
    let r = r.into_inner();
    let joined = Joined {
        node: NodeId(r.node),
        regions: r.regions.iter().copied().map(RegionId).zip(r.generations.iter().copied()).collect(),
        live: r.live.iter().map(from_peer).collect(),
    };
    Ok((joined, r))
}

/// Why a join failed, as the follower logs it: the primary's own words
/// when it refused (a wrong pool, a name in use, a full node table, a
/// credential that is not a node's), "did not answer" only when it did not.
/// FAILED_PRECONDITION and INVALID_ARGUMENT stop the follower (its
/// configuration is wrong); the rest are tried again.
pub fn refusal(s: tonic::Status) -> crate::error::Error {
    use tonic::Code;
    let refused = |kind| crate::error::Error::new(kind, format!("the primary refused this node: {}", s.message()));
    match s.code() {
        Code::FailedPrecondition | Code::InvalidArgument => crate::error::Error::precondition(s.message().to_owned()),
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown => unavailable(s.message()),
        Code::Unauthenticated | Code::PermissionDenied => refused(crate::error::ErrorKind::PermissionDenied),
        c => refused(crate::error::ErrorKind::from_code(c).unwrap_or(crate::error::ErrorKind::Internal)),
    }
}

/// Region claims through the primary.
pub struct ForwardClaimer {
    pub client: Client,
    pub ident: Arc<Ident>,
    pub timeout: Duration,
}

#[tonic::async_trait]
impl Claimer for ForwardClaimer {
    async fn claim(&self, node: NodeId) -> Result<Option<(RegionId, u64)>> {
        self.ask(node, false).await
    }

    async fn reclaim(&self, node: NodeId) -> Result<Option<(RegionId, u64)>> {
        self.ask(node, true).await
    }
}

impl ForwardClaimer {
    async fn ask(&self, NodeId(node): NodeId, reclaim: bool) -> Result<Option<(RegionId, u64)>> {
        let instance = self.ident.instance.load(Ordering::Acquire);
        let mut req = tonic::Request::new(pp::ClaimRegionRequest { node, instance, reclaim });
        req.set_timeout(self.timeout);
        let r = self.client.clone().claim_region(req).await.map_err(|s| unavailable(s.message()))?.into_inner();
        Ok(r.claimed.then_some((RegionId(r.region), r.generation)))
    }
}

/// What the heartbeat loop works with.
pub struct Heartbeat {
    pub client: Client,
    pub cfg: ClusterConfig,
    pub handler: Arc<Handler>,
    pub forwarded: Arc<super::forward::Forwarded>,
    pub ident: Arc<Ident>,
    pub fence: Arc<Fence>,
    pub primary_instance: u64,
    pub acked: u64,
    /// Regions the primary asked back that this node gave up (phase 3),
    /// acknowledged in the next heartbeat.
    pub surrendered: Vec<u32>,
}

impl Heartbeat {
    pub async fn run(mut self, shutdown: CancellationToken) {
        let every = Duration::from_millis(self.cfg.heartbeat_ms.max(10));
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            match self.beat(every * 2).await {
                // The primary waits for this acknowledgement: send it now.
                Ok(()) if !self.surrendered.is_empty() => tick.reset_immediately(),
                Ok(()) => {}
                Err(e) => tracing::debug!(error = %e, "heartbeat failed"),
            }
            metrics::gauge!(crate::metric_names::CLUSTER_LEASE_HELD).set(if self.fence.held() { 1.0 } else { 0.0 });
        }
    }

    async fn beat(&mut self, timeout: Duration) -> Result<()> {
        let r = self.handler.regions();
        let mut req = tonic::Request::new(pp::HeartbeatRequest {
            node: self.handler.node().0,
            instance: self.ident.instance.load(Ordering::Acquire),
            acked: self.acked,
            pages_total: r.pages_total(),
            pages_free: r.free_pages(),
            regions: r.count(),
            forwarded_p50_us: self.forwarded.p50_us(),
            held_keys: self.forwarded.holds().map_or(0, |h| h.len() as u64),
            clock_ms: super::clock::local_ms(),
            surrendered: std::mem::take(&mut self.surrendered),
        });
        req.set_timeout(timeout);
        // The lease counts from when the beat left, not from the answer: the
        // primary's silence clock restarted no earlier than that, so this
        // node stops writing (and answering from its holds) before the
        // primary can declare it dead.
        let sent = std::time::Instant::now();
        let rep = tokio::time::timeout(timeout, self.client.heartbeat(req))
            .await
            .map_err(|_| unavailable("heartbeat timed out"))?
            .map_err(|s| unavailable(s.message()))?
            .into_inner();
        if rep.rejoin || rep.primary_instance != self.primary_instance {
            // The primary forgot this node's locks: no lookup may lean on them.
            if let Some(h) = self.forwarded.holds() {
                h.void();
            }
            return self.rejoin().await.inspect_err(|e| {
                if e.kind() != crate::error::ErrorKind::Unavailable {
                    tracing::warn!(error = %e, "cannot join the primary again; retrying");
                }
            });
        }
        // Asked again until acknowledged: giving a region up is idempotent.
        for &region in &rep.reclaim {
            self.handler.surrender(RegionId(region));
            self.surrendered.push(region);
        }
        let freed: Vec<_> = rep.notices.iter().map(from_peer).collect();
        self.handler.release(&freed);
        self.acked = rep.last_seq;
        self.fence.renew_at(sent);
        Ok(())
    }

    /// The primary restarted or buried this node: start over with what it
    /// knows (the handler reconciles its regions; open reservations die).
    async fn rejoin(&mut self) -> Result<()> {
        // Never 0: an op naming instance 0 is the batch's (`peer.proto`).
        let instance = (self.handler.instance_id() ^ rand::random::<u64>()) | 1;
        let uuid = self.handler.pool().superblock().uuid_string();
        let timeout = self.handler.limits().reservation_timeout_ms;
        let (joined, rep) = join(&mut self.client, &self.cfg, &uuid, instance, timeout).await?;
        let h = self.handler.clone();
        let j = joined.clone();
        tokio::task::spawn_blocking(move || h.rejoined(&j))
            .await
            .map_err(|e| crate::error::Error::new(crate::error::ErrorKind::Internal, e.to_string()))??;
        // Holds first: a lookup sent under the new instance is adopted.
        if let Some(h) = self.forwarded.holds() {
            h.registered(instance);
        }
        self.ident.instance.store(instance, Ordering::Release);
        if rep.primary_instance != self.primary_instance {
            // Every lock this node's clients took went with the old primary
            // (durable ones included): they learn it from a new instance id,
            // and take them again while the new primary's grace lasts.
            self.handler.new_instance();
        }
        self.primary_instance = rep.primary_instance;
        self.acked = rep.notice_seq;
        self.fence.renew();
        tracing::warn!(node = joined.node.0, "joined the primary again");
        Ok(())
    }
}
