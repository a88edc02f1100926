//! The sockets a node is served on: HTTP `/metrics`, `/live`, `/ready`
//! (first, so probes answer while the pool prefaults), then gRPC on TCP and
//! on the Unix socket (last: when it accepts, everything is bound), each
//! behind its credentials and its connection bounds (`conn.rs`).
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::net::{TcpListener, UnixListener};
use tokio::task::{JoinHandle, JoinSet};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tokio_util::sync::CancellationToken;
use tonic_health::server::HealthReporter;

use super::Prometheus;
use crate::auth::ServerAuth;
use crate::config::Config;
use crate::conn::{nodelay, sessions};
use crate::error::{Error, ErrorKind, Result};
use crate::handler::Handler;
use crate::proto::cxlkv_server::CxlkvServer;
use crate::rpc::Service;
use crate::wire::MAX_MESSAGE;

/// The HTTP probes and metrics on `addr` ("" = none), until `stop`.
pub(super) async fn probes(
    addr: &str,
    prom: Prometheus,
    ready: Arc<AtomicBool>,
    stop: CancellationToken,
) -> Result<Option<JoinHandle<()>>> {
    if addr.is_empty() {
        return Ok(None);
    }
    let l = TcpListener::bind(addr).await.map_err(|e| Error::io(format!("bind metrics address {addr}"), e))?;
    tracing::info!(addr = %l.local_addr().map(|a| a.to_string()).unwrap_or_default(), "metrics listening");
    Ok(prom.map(|p| tokio::spawn(serve_http(l, p, ready, stop))))
}

fn api(service: &Arc<Service>) -> CxlkvServer<Service> {
    CxlkvServer::from_arc(service.clone()).max_decoding_message_size(MAX_MESSAGE).max_encoding_message_size(MAX_MESSAGE)
}

/// The gRPC servers of a term, to drain at shutdown, and the health
/// service's reporter (NOT_SERVING until the term is ready).
pub(super) type Served = (JoinSet<std::result::Result<(), tonic::transport::Error>>, HealthReporter);

/// Bind and serve the gRPC listeners (the API and the health service);
/// closed connections release their sessions' locks through `handler`.
pub(super) async fn grpc(
    cfg: &Config,
    auth: &ServerAuth,
    service: Arc<Service>,
    handler: Arc<Handler>,
    shutdown: CancellationToken,
) -> Result<Served> {
    let (health, health_svc) = tonic_health::server::health_reporter();
    // The overall status ("") starts SERVING in tonic-health; it must follow /ready.
    health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
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
    let uds = bind_uds(&cfg.server.socket, cfg.socket_mode()?).await?;
    if !cfg.server.socket_group.is_empty() {
        crate::auth::chown_group(&cfg.server.socket, &cfg.server.socket_group)?;
    }
    tracing::info!(socket = %cfg.server.socket.display(), "gRPC listening");
    // A client's locks end with its connection (its reservations do not:
    // it may still be writing into their pages).
    let (closed, mut closed_rx) = tokio::sync::mpsc::unbounded_channel::<crate::conn::Closed>();
    let (h, named) = (handler.clone(), service.sessions().clone());
    tokio::spawn(async move {
        // Durable sessions whose client processes are gone are released
        // like a connection's own: checked when a connection closes, and
        // twice a second (a killed process may close its socket first).
        let mut reap = tokio::time::interval(std::time::Duration::from_millis(500));
        loop {
            let mut gone = tokio::select! {
                c = closed_rx.recv() => {
                    let Some(c) = c else { break };
                    named.detach(&c.durable);
                    vec![c.session]
                }
                _ = reap.tick() => vec![],
            };
            gone.extend(named.reap());
            for s in gone {
                let n = h.session_closed(s).await.unwrap_or(0);
                if n > 0 {
                    tracing::info!(locks = n, durable = s.is_durable(), "released the locks of a closed session");
                }
            }
        }
    });
    let limits = cfg.server.conn_limits();
    let h2_streams = cfg.server.http2_max_concurrent_streams;
    let mut servers = tokio::task::JoinSet::new();
    let (g, hs, sd, c) = (api(&service), health_svc.clone(), shutdown.clone(), closed.clone());
    let (g, peers) = (auth.socket_guard(g), auth.peers().clone());
    // Peers off the allow-list are dropped (closed) before tonic sees them.
    let admitted = tokio_stream::StreamExt::filter(UnixListenerStream::new(uds), move |r| {
        r.as_ref().map_or(true, |s| peers.admit(s))
    });
    servers.spawn(async move {
        tonic::transport::Server::builder()
            .max_concurrent_streams(h2_streams)
            .add_service(hs)
            .add_service(g)
            .serve_with_incoming_shutdown(sessions(admitted, c, limits, "unix"), sd.cancelled_owned())
            .await
    });
    if let Some(l) = tcp {
        let (g, hs, sd, c) = (api(&service), health_svc, shutdown.clone(), closed.clone());
        let (tcp_server, g) = (auth.tcp_server()?, auth.tcp_guard(g));
        servers.spawn(async move {
            tcp_server
                .tcp_nodelay(true)
                .max_concurrent_streams(h2_streams)
                .add_service(hs)
                .add_service(g)
                .serve_with_incoming_shutdown(
                    sessions(nodelay(TcpListenerStream::new(l)), c, limits, "tcp"),
                    sd.cancelled_owned(),
                )
                .await
        });
    }

    Ok((servers, health))
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
