//! Server skeleton (mini-redis style): build the pool, handler and service,
//! serve gRPC on a Unix socket (and optionally TCP) plus HTTP /metrics, /live
//! and /ready, run housekeeping, and stop on one cancellation token.
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tokio_util::sync::CancellationToken;

use crate::auth::ServerAuth;
use crate::cluster::forward::Fence;
use crate::config::Config;
use crate::conn::sessions;
use crate::election::Leadership;
use crate::error::{Error, ErrorKind, Result};
use crate::handler::{Handler, Limits};
use crate::metrics::{self, Metrics};
use crate::pool::{
    self, BackendKind, DaxBackend, Geometry, NodeId, NoncoherentTestBackend, Pool, PoolBackend, PoolOptions, ShmBackend,
};
use crate::proto::cxlkv_server::CxlkvServer;
use crate::registry::LocalRegistry;
use crate::rpc::Service;

use crate::wire::MAX_MESSAGE;

pub fn open_pool(cfg: &Config) -> Result<(Pool, pool::OpenOutcome)> {
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
    let opened =
        Pool::open(backend, &PoolOptions { region_size: p.region_size, page_size: p.page_size, format: p.format })?;
    if let Some((unbacked, free)) = opened.0.space_shortfall()? {
        // Not an error: the node works within the room there is (claims that
        // find none are refused, and it evicts), but the operator asked for more.
        tracing::warn!(
            path = %p.path.display(), unbacked_mib = unbacked >> 20, free_mib = free >> 20,
            "the pool file cannot grow to its size: its filesystem has less room than the pool still needs; \
             regions beyond it will not be claimed (in a container, enlarge /dev/shm, or use a smaller --pool-size)"
        );
    }
    Ok(opened)
}

pub fn build_handler(cfg: &Config) -> Result<Arc<Handler>> {
    let (pool, outcome) = open_pool(cfg)?;
    let node = pool.lock_node((cfg.node_id != 0).then_some(cfg.node_id))?;
    let sb = pool.superblock();
    tracing::info!(
        path = %cfg.pool.path.display(), backend = %cfg.pool.backend.as_str(), coherence = pool.coherence().as_str(),
        ?outcome, node, uuid = %sb.uuid_string(),
        regions = sb.region_count, region_size = sb.region_size, page_size = sb.page_size, "pool ready"
    );
    let r = &cfg.registry;
    let registry = Arc::new(
        LocalRegistry::with_policy(r.eviction.config(r.eviction_policy), r.max_tenants)
            .with_quotas(cfg.quotas.clone())
            .with_pin_limit(pin_limit(cfg, &pool)),
    );
    Ok(Arc::new(Handler::new(Arc::new(pool), NodeId(node), registry, Limits::from_config(cfg))?))
}

/// `[registry] max_client_pinned_bytes`, 0 meaning half of the pool's
/// region space: what one client connection may hold locked plus reserved.
pub fn pin_limit(cfg: &Config, pool: &Pool) -> u64 {
    match cfg.registry.max_client_pinned_bytes {
        0 => pool.region_count() as u64 * pool.superblock().region_size / 2,
        n => n,
    }
}

/// The handler of this node's role: a single node (the default), or the
/// cluster's primary or a follower (`[cluster]`).
async fn start_role(
    cfg: &Config,
    shutdown: CancellationToken,
    epoch: u64,
    lease: Option<Arc<Fence>>,
) -> Result<(Arc<Handler>, crate::cluster::Role)> {
    let internal = |e: tokio::task::JoinError| Error::new(ErrorKind::Internal, e.to_string());
    if !cfg.cluster.enabled() {
        let c = cfg.clone();
        let h = tokio::task::spawn_blocking(move || build_handler(&c)).await.map_err(internal)??;
        return Ok((h, crate::cluster::Role::Single));
    }
    let c = cfg.clone();
    let (pool, outcome) = tokio::task::spawn_blocking(move || open_pool(&c)).await.map_err(internal)??;
    tracing::info!(
        path = %cfg.pool.path.display(), ?outcome, uuid = %pool.superblock().uuid_string(),
        node = %cfg.cluster.node_name, primary = %cfg.cluster.primary, "pool ready (cluster)"
    );
    let pool = Arc::new(pool);
    if cfg.cluster.is_primary() {
        crate::cluster::start_primary(cfg, pool, shutdown, lease.map(|l| (epoch, l))).await
    } else {
        crate::cluster::start_follower(cfg, pool, shutdown, epoch).await
    }
}

/// Bind the Unix socket, replacing a stale socket file but never a live one.
async fn bind_uds(path: &Path, mode: u32) -> Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    }
    if path.exists() {
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return Err(Error::new(
                ErrorKind::FailedPrecondition,
                format!("socket {} is in use by a running server", path.display()),
            ));
        }
        std::fs::remove_file(path).map_err(|e| Error::io(format!("remove stale socket {}", path.display()), e))?;
    }
    let l = UnixListener::bind(path).map_err(|e| Error::io(format!("bind {}", path.display()), e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io(format!("chmod {}", path.display()), e))?;
    Ok(l)
}

async fn serve_http(
    listener: TcpListener,
    prom: metrics_exporter_prometheus::PrometheusHandle,
    ready: Arc<AtomicBool>,
    shutdown: CancellationToken,
) {
    use axum::{http::StatusCode, routing::get, Router};
    let app = Router::new()
        .route("/metrics", get(move || std::future::ready(prom.render())))
        .route("/live", get(|| async { "live\n" }))
        .route(
            "/ready",
            get(move || {
                let ok = ready.load(Ordering::Acquire);
                async move {
                    if ok {
                        (StatusCode::OK, "ready\n")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
                    }
                }
            }),
        );
    let _ = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await;
}

/// Small RPCs must not wait for Nagle + delayed ACK (~40 ms); tonic's own
/// `tcp_nodelay` only applies to listeners it binds itself.
pub(crate) fn nodelay(
    s: TcpListenerStream,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    s.map(|r| {
        r.inspect(|t| {
            let _ = t.set_nodelay(true);
        })
    })
}

/// Run until `shutdown` is cancelled, then drain within the grace period.
pub async fn run(cfg: Config, shutdown: CancellationToken) -> Result<()> {
    let prom = metrics::install_recorder().ok();
    cfg.socket_mode()?; // a bad mode stops the start before anything is bound
                        // Credentials are read first: a bad tokens or certificate file stops the
                        // start before anything is bound.
    let auth = ServerAuth::from_config(&cfg.auth, &cfg.tls)?;
    if let Ok(addr) = cfg.server.tcp_addr.parse() {
        auth.check_tcp_exposure(addr)?;
    }
    let ready = Arc::new(AtomicBool::new(false));
    // HTTP outlives the gRPC drain so probes see /ready = 503, /live = 200.
    let http_stop = CancellationToken::new();

    // Health endpoints come up first so /live answers while the pool prefaults.
    let http = if cfg.server.metrics_addr.is_empty() {
        None
    } else {
        let l = TcpListener::bind(&cfg.server.metrics_addr)
            .await
            .map_err(|e| Error::io(format!("bind metrics address {}", cfg.server.metrics_addr), e))?;
        tracing::info!(addr = %l.local_addr().map(|a| a.to_string()).unwrap_or_default(), "metrics listening");
        prom.clone().map(|p| tokio::spawn(serve_http(l, p, ready.clone(), http_stop.clone())))
    };

    if cfg.cluster.elected() {
        run_elected(&cfg, &auth, prom.clone(), ready.clone(), shutdown.clone()).await?;
    } else {
        let (handler, role) = start_role(&cfg, shutdown.clone(), 0, None).await?;
        let term = Term { backend: crate::election::ElectionKind::Static.as_str(), epoch: 0 };
        serve(&cfg, &auth, prom.clone(), ready.clone(), (handler, role, term), shutdown.clone()).await?;
    }
    http_stop.cancel();
    if let Some(h) = http {
        let _ = tokio::time::timeout(Duration::from_secs(2), h).await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// The election's backend and epoch of the role being served.
struct Term {
    backend: &'static str,
    epoch: u64,
}

/// Serve one role until `shutdown`, then drain within the grace period and
/// take the socket away (an elected node serves one role per term).
async fn serve(
    cfg: &Config,
    auth: &ServerAuth,
    prom: Option<metrics_exporter_prometheus::PrometheusHandle>,
    ready: Arc<AtomicBool>,
    started: (Arc<Handler>, crate::cluster::Role, Term),
    shutdown: CancellationToken,
) -> Result<()> {
    let mode = cfg.socket_mode()?;
    let (handler, role, term) = started;
    ::metrics::gauge!("cxlkv_cluster_role", "role" => role.name()).set(1.0);
    let metrics = Arc::new(Metrics::new(handler.pool().backend().kind().as_str(), cfg.server.max_tenant_series));
    metrics.rebuilt(&handler.rebuilt());
    let service = Arc::new(
        Service::new(handler.clone(), metrics.clone())
            .with_role(Arc::new(role))
            .with_term(term.backend, term.epoch)
            .with_inline_limits(cfg.server.max_inline_streams, cfg.server.max_inline_streams_per_connection),
    );
    let (health, health_svc) = tonic_health::server::health_reporter();
    // The overall status ("") starts SERVING in tonic-health; it must follow /ready.
    health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
    let grpc = || {
        CxlkvServer::from_arc(service.clone())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE)
    };

    // Every listener is bound before any serves, and the Unix socket (which
    // clients and probes take as the sign of life) last, so "the socket
    // accepts" and readiness both mean every listener is up.
    let tcp = match cfg.server.tcp_addr.as_str() {
        "" => None,
        a => {
            let addr: SocketAddr = a.parse().map_err(|_| Error::invalid(format!("bad tcp_addr {a:?}")))?;
            let l = TcpListener::bind(addr).await.map_err(|e| Error::io(format!("bind {addr}"), e))?;
            tracing::info!(addr = %l.local_addr().map(|a| a.to_string()).unwrap_or_default(), "gRPC TCP listening");
            Some(l)
        }
    };
    let uds = bind_uds(&cfg.server.socket, mode).await?;
    if !cfg.server.socket_group.is_empty() {
        crate::auth::chown_group(&cfg.server.socket, &cfg.server.socket_group)?;
    }
    tracing::info!(socket = %cfg.server.socket.display(), "gRPC listening");
    // A client's locks end with its connection (its reservations do not:
    // it may still be writing into their pages).
    let (closed, mut closed_rx) = tokio::sync::mpsc::unbounded_channel();
    let h = handler.clone();
    tokio::spawn(async move {
        while let Some(s) = closed_rx.recv().await {
            let n = h.session_closed(s).await.unwrap_or(0);
            if n > 0 {
                tracing::info!(locks = n, "released the locks of a closed connection");
            }
        }
    });
    let limits = crate::conn::ConnLimits::from_config(&cfg.server);
    let mut servers = tokio::task::JoinSet::new();
    let (g, hs, sd, c) = (grpc(), health_svc.clone(), shutdown.clone(), closed.clone());
    let (g, peers) = (auth.socket_guard(g), auth.peers().clone());
    // Peers off the allow-list are dropped (closed) before tonic sees them.
    let admitted = tokio_stream::StreamExt::filter(UnixListenerStream::new(uds), move |r| {
        r.as_ref().map_or(true, |s| peers.admit(s))
    });
    servers.spawn(async move {
        tonic::transport::Server::builder()
            .add_service(hs)
            .add_service(g)
            .serve_with_incoming_shutdown(sessions(admitted, c, limits, "unix"), sd.cancelled_owned())
            .await
    });
    if let Some(l) = tcp {
        let (g, hs, sd, c) = (grpc(), health_svc, shutdown.clone(), closed.clone());
        let (tcp_server, g) = (auth.tcp_server()?, auth.tcp_guard(g));
        servers.spawn(async move {
            tcp_server
                .tcp_nodelay(true)
                .add_service(hs)
                .add_service(g)
                .serve_with_incoming_shutdown(
                    sessions(nodelay(TcpListenerStream::new(l)), c, limits, "tcp"),
                    sd.cancelled_owned(),
                )
                .await
        });
    }

    // Housekeeping: reclaim expired reservations and locks, refresh gauges.
    let (h, m, p, sd) = (handler.clone(), metrics.clone(), prom.clone(), shutdown.clone());
    let every = Duration::from_millis(cfg.registry.reap_interval_ms.max(10));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        loop {
            tokio::select! {
                _ = sd.cancelled() => break,
                _ = tick.tick() => {
                    if let Err(e) = h.claim_ahead().await {
                        tracing::warn!(error = %e, "claiming a region ahead of need failed");
                    }
                    match h.reap().await {
                        Ok(0) => {}
                        Ok(n) => tracing::info!(reclaimed = n, "expired reservations reclaimed"),
                        Err(e) => tracing::debug!(error = %e, "housekeeping could not reach the registry"),
                    }
                    if let Ok(s) = h.stats().await {
                        m.refresh(&s);
                    }
                    if let Some(p) = &p { p.run_upkeep(); }
                }
            }
        }
    });

    health.set_serving::<CxlkvServer<Service>>().await;
    health.set_service_status("", tonic_health::ServingStatus::Serving).await;
    ready.store(true, Ordering::Release);
    tracing::info!(node = handler.node().0, "cxlkv serving");

    shutdown.cancelled().await;
    ready.store(false, Ordering::Release);
    health.set_not_serving::<CxlkvServer<Service>>().await;
    health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
    tracing::info!("shutting down: draining in-flight requests");
    let grace = Duration::from_millis(cfg.server.shutdown_grace_ms);
    let drained = tokio::time::timeout(grace, async {
        while let Some(r) = servers.join_next().await {
            if let Ok(Err(e)) = r {
                tracing::warn!(error = %e, "server ended with an error");
            }
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(grace_ms = grace.as_millis() as u64, "grace period over; dropping remaining requests");
    }
    let _ = std::fs::remove_file(&cfg.server.socket);
    Ok(())
}

/// An elected cluster (`cluster.election` other than "static"): follow the
/// election. Each change of leader (or of whether this node leads) ends the
/// current term: the role is drained and the next one started, as a
/// primary (rebuilding the pool-wide registry from the pool's records and
/// writing its epoch into the pool) or as a follower of the new leader.
async fn run_elected(
    cfg: &Config,
    auth: &ServerAuth,
    prom: Option<metrics_exporter_prometheus::PrometheusHandle>,
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
        ::metrics::gauge!("cxlkv_cluster_epoch").set(l.epoch as f64);
        tracing::warn!(leader = %leader.name, epoch = l.epoch, i_lead = l.i_lead, "new term");
        let own_lease = l.i_lead.then(|| lease.clone());
        match start_role(&c, term.clone(), l.epoch, own_lease).await {
            Ok((h, role)) => {
                let t = Term { backend, epoch: l.epoch };
                // A listener of the last term may still be closing: the next
                // term tries again rather than ending the process.
                if let Err(e) = serve(&c, auth, prom.clone(), ready.clone(), (h, role, t), term.clone()).await {
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
