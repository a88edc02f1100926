//! The one place a node is built, for each term it serves: the pool opened,
//! this node's registry (a single node's, or a primary's, of the whole
//! pool), its handler, and its role — a single node, a cluster's primary
//! (`cluster::Lead`) or a follower (`cluster::Follow`).
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::auth::ServerAuth;
use crate::cluster::{Follow, Lead, Role};
use crate::config::Config;
use crate::error::{Error, ErrorKind, Result};
use crate::events::{EventLog, Feed};
use crate::handler::{Handler, Limits};
use crate::pool::{self, BackendKind, DaxBackend, Geometry, NodeId, NoncoherentTestBackend, Pool, PoolBackend};
use crate::pool::{PoolOptions, ShmBackend};
use crate::registry::directory::Fence;
use crate::registry::{LocalDirectory, LocalRegistry, LockMark};

/// A node serving one term.
pub struct Node {
    pub handler: Arc<Handler>,
    pub role: Role,
    /// Its event stream (`[events]` on): its own, or its primary's relayed.
    pub events: Option<Feed>,
}

/// Build this node for a term: `epoch` and `lease` are the election's
/// (0 and none in a static cluster and on a single node; `lease` only where
/// this node leads).
pub async fn build(
    cfg: &Config,
    auth: &ServerAuth,
    shutdown: CancellationToken,
    epoch: u64,
    lease: Option<Arc<Fence>>,
) -> Result<Node> {
    let c = cfg.clone();
    let pool = Arc::new(off_runtime(move || open_pool(&c)).await?);
    let limits =
        Limits { max_client_pinned_bytes: pin_limit(cfg, &pool), ..Limits::new(&cfg.registry, cfg.pool.prefault) };
    let cluster = &cfg.cluster;
    if !cluster.enabled() {
        let node = pool.lock_node((cfg.node_id != 0).then_some(cfg.node_id))?;
        let grace = view_grace_ms(cfg, &pool)?;
        let (events, registry) = source(cfg, &pool, &shutdown);
        let dir = Arc::new(LocalDirectory::new(Arc::new(registry)));
        let d = dir.clone();
        let handler = off_runtime(move || Handler::with_directory(pool, NodeId(node), d, limits, false)).await?;
        if handler.rebuilt().restored > 0 && grace > 0 {
            // Views of the previous instance may still be read: nothing
            // committed goes until their locks would have lapsed.
            dir.set_grace(grace);
            tracing::info!(
                ms = grace,
                "restarted with view locks outstanding: nothing committed is removed until they lapse"
            );
        }
        return Ok(Node { handler: Arc::new(handler), role: Role::Single, events });
    }
    if cluster.is_primary() {
        let timeout = limits.reservation_timeout_ms;
        let (events, registry) = source(cfg, &pool, &shutdown);
        let grace = view_grace_ms(cfg, &pool)?;
        let lead = Lead::prepare(cluster, pool.clone(), registry, timeout, grace, lease.map(|l| (epoch, l)))?;
        let (node, dir, claimer) = (lead.node, lead.dir.clone(), lead.claimer.clone());
        let handler = off_runtime(move || Handler::with_claimer(pool, node, dir, claimer, limits, true)).await?;
        let handler = Arc::new(handler);
        let log = events.as_ref().map(|f| f.log.clone());
        let role = lead.serve(handler.clone(), log, auth, cfg.server.conn_limits(), shutdown).await?;
        return Ok(Node { handler, role, events });
    }
    let (timeout, pins) = (limits.reservation_timeout_ms, pin_limit(cfg, &pool));
    let follow = Follow::join(cluster, &pool, timeout, pins, epoch, shutdown.clone()).await?;
    let (joined, dir, claimer) = (follow.joined.clone(), follow.forwarded.clone(), follow.claimer.clone());
    let handler = Arc::new(off_runtime(move || Handler::follower(pool, &joined, dir, claimer, limits)).await?);
    let events = cfg.events.enabled.then(|| feed(cfg, EventLog::relay(cfg.events.limits()), true));
    let role = follow.follow(handler.clone(), events.as_ref().map(|f| f.log.clone()), shutdown);
    Ok(Node { handler, role, events })
}

/// The registry a single node or a primary starts with (empty: the
/// handler rebuilds it from the pool's records), announcing to a new
/// event stream (`[events]` on), batched until `shutdown`.
fn source(cfg: &Config, pool: &Arc<Pool>, shutdown: &CancellationToken) -> (Option<Feed>, LocalRegistry) {
    let r = &cfg.registry;
    let registry = LocalRegistry::with_policy(r.eviction.config(r.eviction_policy), r.max_tenants)
        .with_quotas(cfg.quotas.clone())
        .with_admission(r.admission())
        .with_pin_limit(pin_limit(cfg, pool))
        .with_lock_mark(Arc::new(PoolLockMark(pool.clone())));
    if !cfg.events.enabled {
        return (None, registry);
    }
    let log = EventLog::new(cfg.events.limits());
    log.start(shutdown.clone());
    let registry = registry.with_events(log.sink());
    (Some(feed(cfg, log, false)), registry)
}

/// The pool's view-lock mark, as the registry of the node that writes
/// pool-wide metadata (a single node, a cluster's primary) raises it.
struct PoolLockMark(Arc<Pool>);

impl LockMark for PoolLockMark {
    fn cover(&self, unix_ms: u64) -> Result<()> {
        self.0.set_lock_mark(unix_ms)
    }
}

/// How long view locks granted before this start may still be read (the
/// pool's view-lock mark), at most `max_lock_ttl_ms` (a mark from a clock
/// far ahead, or damaged, delays nothing longer than any lock can live).
fn view_grace_ms(cfg: &Config, pool: &Pool) -> Result<u64> {
    let left = pool.lock_mark()?.saturating_sub(crate::platform::now_unix_ms());
    Ok(left.min(cfg.registry.max_lock_ttl_ms))
}

fn feed(cfg: &Config, log: Arc<EventLog>, relay: bool) -> Feed {
    let e = &cfg.events;
    let grpc = crate::events::watch::Streams::new(e.max_streams, e.max_streams_per_connection, e.stream_bytes as usize);
    Feed { log, relay, zmq: e.endpoints(), grpc }
}

/// `[registry] max_client_pinned_bytes`, 0 meaning half of the pool's
/// region space: what one client connection may hold locked plus reserved.
pub fn pin_limit(cfg: &Config, pool: &Pool) -> u64 {
    match cfg.registry.max_client_pinned_bytes {
        0 => pool.region_count() as u64 * pool.superblock().region_size / 2,
        n => n,
    }
}

/// Open (or create) the pool `[pool]` describes, and say how it went.
pub fn open_pool(cfg: &Config) -> Result<Pool> {
    let p = &cfg.pool;
    let shm_size = || Geometry::for_capacity(p.size, p.region_size, p.page_size, pool::backend::DAX_ALIGN);
    let backend: Box<dyn PoolBackend> = match p.backend {
        BackendKind::Shm => {
            Box::new(ShmBackend::open(&p.path, shm_size()?.pool_size, p.format)?.with_coherence(p.coherence))
        }
        BackendKind::Dax => Box::new(DaxBackend::open(&p.path)?.with_coherence(p.coherence)),
        BackendKind::NoncoherentTest => {
            tracing::warn!("backend \"noncoherent-test\" is for tests: every process keeps a private copy of the pool");
            Box::new(
                NoncoherentTestBackend::open(&p.path, shm_size()?.pool_size, p.format)?.with_coherence(p.coherence)?,
            )
        }
    };
    let (pool, outcome) =
        Pool::open(backend, &PoolOptions { region_size: p.region_size, page_size: p.page_size, format: p.format })?;
    if let Some((unbacked, free)) = pool.space_shortfall()? {
        // Not an error: the node works within the room there is (claims that
        // find none are refused, and it evicts), but the operator asked for more.
        tracing::warn!(
            path = %p.path.display(), unbacked_mib = unbacked >> 20, free_mib = free >> 20,
            "the pool file cannot grow to its size: its filesystem has less room than the pool still needs; \
             regions beyond it will not be claimed (in a container, enlarge /dev/shm, or use a smaller --pool-size)"
        );
    }
    let sb = pool.superblock();
    tracing::info!(
        path = %p.path.display(), backend = %p.backend.as_str(), coherence = pool.coherence().as_str(),
        ?outcome, uuid = %sb.uuid_string(), regions = sb.region_count, region_size = sb.region_size,
        page_size = sb.page_size, node = %cfg.cluster.node_name, "pool ready"
    );
    Ok(pool)
}

/// Run blocking start-up work (mapping, prefaulting, rebuilding) on the
/// blocking pool.
async fn off_runtime<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?
}
