//! Server skeleton (mini-redis style): read the credentials, bring up the
//! HTTP probes, build the node (`node.rs`) for each term, serve it on its
//! listeners with housekeeping, and stop on one cancellation token.
//! `listeners.rs` binds and serves the sockets, `housekeeping.rs` is the
//! periodic tick, `terms.rs` follows an elected cluster's terms; this file
//! runs a term and its shutdown (drain within the grace period).
mod housekeeping;
mod listeners;
mod terms;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::auth::ServerAuth;
use crate::config::Config;
use crate::error::Result;
use crate::metrics::{self, Metrics};
use crate::node::Node;
use crate::proto::cxlkv_server::CxlkvServer;
use crate::rpc::Service;

/// The Prometheus recorder's handle (none when a recorder was installed first).
type Prometheus = Option<metrics_exporter_prometheus::PrometheusHandle>;

/// The election's backend and epoch of the role being served.
struct Term {
    backend: &'static str,
    epoch: u64,
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
    // HTTP outlives the gRPC drain so probes see /ready = 503, /live = 200;
    // it comes up first so /live answers while the pool prefaults.
    let http_stop = CancellationToken::new();
    let http = listeners::probes(&cfg.server.metrics_addr, prom.clone(), ready.clone(), http_stop.clone()).await?;
    if cfg.cluster.elected() {
        terms::run_elected(&cfg, &auth, prom.clone(), ready.clone(), shutdown.clone()).await?;
    } else {
        let node = crate::node::build(&cfg, &auth, shutdown.clone(), 0, None).await?;
        let term = Term { backend: crate::election::ElectionKind::Static.as_str(), epoch: 0 };
        serve(&cfg, &auth, prom.clone(), ready.clone(), (node, term), shutdown.clone()).await?;
    }
    http_stop.cancel();
    if let Some(h) = http {
        let _ = tokio::time::timeout(Duration::from_secs(2), h).await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// Serve one node until `shutdown`, then drain within the grace period and
/// take the socket away (an elected node serves one role per term).
async fn serve(
    cfg: &Config,
    auth: &ServerAuth,
    prom: Prometheus,
    ready: Arc<AtomicBool>,
    (node, term): (Node, Term),
    shutdown: CancellationToken,
) -> Result<()> {
    let Node { handler, role, events } = node;
    if let Some(f) = &events {
        let on = crate::events::transport::start_all(&f.log, &cfg.events, &shutdown).await?;
        tracing::info!(transports = ?on, "KV events served");
    }
    ::metrics::gauge!(crate::metric_names::CLUSTER_ROLE, "role" => role.name()).set(1.0);
    let ops = crate::rpc::Op::ALL.map(crate::rpc::Op::label);
    let metrics = Arc::new(Metrics::new(handler.pool().backend().kind().as_str(), cfg.server.max_tenant_series, &ops));
    metrics.rebuilt(&handler.rebuilt());
    let service = Arc::new(
        Service::new(handler.clone(), metrics.clone())
            .with_role(Arc::new(role))
            .with_term(term.backend, term.epoch)
            .with_inline_limits(cfg.server.max_inline_streams, cfg.server.max_inline_streams_per_connection)
            .with_sessions(cfg.server.max_sessions, session_linger(cfg))
            .with_events(events, cfg.events.max_item_tokens),
    );
    let (mut servers, health) = listeners::grpc(cfg, auth, service, handler.clone(), shutdown.clone()).await?;
    housekeeping::spawn(handler.clone(), metrics, prom, cfg.registry.reap_interval_ms, shutdown.clone());

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

/// How long a durable session's name is kept after its last connection
/// closed: its locks and reservations have lapsed by then.
fn session_linger(cfg: &Config) -> Duration {
    Duration::from_millis(cfg.registry.max_lock_ttl_ms + cfg.registry.reservation_timeout_ms)
}
