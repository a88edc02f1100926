//! Who may talk to the sidecar: bearer tokens (optionally bound to tenants),
//! TLS with client certificates on TCP, and the Unix socket's peer
//! credentials. Everything here is built from the `[auth]` and `[tls]`
//! config sections once at start and shared by every gRPC listener, so the
//! peer service between sidecars authenticates exactly as the client API
//! does: `ServerAuth::tcp_server` gives a tonic server builder with TLS,
//! `tcp_guard` puts a service behind the token check, `ClientAuth` is the
//! matching client side.
//!
//! What a credential grants travels with each request as a `Scope`
//! extension (see `scope_of`); handlers enforce it.
mod certs;
mod client;
mod grants;
mod peer;
mod tls;
mod tokens;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::Server;

use crate::error::{Error, ErrorKind, Result};
use crate::registry::Scope;

pub use certs::{subject_cn, CertTenants, CertTenantsFile};
pub use client::{AuthedClient, BearerToken, ClientAuth};
pub use grants::Watched;
pub use peer::{chown_group, PeerAllowList, PeerCred};
pub use tokens::{TokenCheck, TokenFile, Tokens};

/// `[auth]`: tokens, the Unix socket's allow-list, and the escape hatch for
/// an unauthenticated non-loopback TCP listener.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Bearer tokens, one per line: `TOKEN *` (operator: every tenant) or
    /// `TOKEN TENANT...` (bound to those tenants). Empty = no tokens.
    pub tokens_file: PathBuf,
    /// Unix socket clients must present a token too; otherwise a socket
    /// client without one is an operator.
    pub socket_requires_token: bool,
    /// Unix socket peers (SO_PEERCRED) allowed to connect: a peer whose uid
    /// is in `allowed_uids` or whose primary gid is in `allowed_gids`. Both
    /// empty = any peer the socket's file mode lets in.
    pub allowed_uids: Vec<u32>,
    pub allowed_gids: Vec<u32>,
    /// Serve TCP on a non-loopback address without client authentication.
    pub insecure_tcp: bool,
}

/// `[tls]`: the TCP listener's certificate and the CA that client
/// certificates must chain to (mutual TLS). All PEM files.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Empty = TLS without client certificates (then use tokens).
    pub client_ca: PathBuf,
    /// Client certificates bound to tenants by subject CN: `CN *` or
    /// `CN TENANT...` per line; a certificate not listed is refused. Empty =
    /// every certificate `client_ca` signed is an operator.
    pub client_tenants_file: PathBuf,
}

fn set(p: &std::path::Path) -> bool {
    !p.as_os_str().is_empty()
}

impl AuthConfig {
    pub fn validate(&self, tls: &TlsConfig) -> Result<()> {
        if self.socket_requires_token && !set(&self.tokens_file) {
            return Err(Error::invalid("auth.socket_requires_token needs auth.tokens_file"));
        }
        if set(&tls.cert) != set(&tls.key) {
            return Err(Error::invalid("tls.cert and tls.key go together"));
        }
        if set(&tls.client_ca) && !set(&tls.cert) {
            return Err(Error::invalid("tls.client_ca needs tls.cert and tls.key (the server's own certificate)"));
        }
        if set(&tls.client_tenants_file) && !set(&tls.client_ca) {
            return Err(Error::invalid("tls.client_tenants_file needs tls.client_ca (client certificates)"));
        }
        Ok(())
    }
}

/// The request's scope: the tenants its credential is bound to, or all of
/// them (operators, and every client where no binding is configured).
pub fn scope_of<T>(req: &tonic::Request<T>) -> Scope {
    req.extensions().get::<Scope>().cloned().unwrap_or_default()
}

/// Authentication of one sidecar's listeners.
pub struct ServerAuth {
    tokens: Option<Arc<TokenFile>>,
    certs: Option<Arc<CertTenantsFile>>,
    tls: Option<tonic::transport::ServerTlsConfig>,
    mutual_tls: bool,
    socket_requires_token: bool,
    insecure_tcp: bool,
    peers: PeerAllowList,
}

impl ServerAuth {
    /// Reads the token and certificate files: a file that is missing or
    /// does not parse stops the start.
    pub fn from_config(auth: &AuthConfig, tls: &TlsConfig) -> Result<Self> {
        auth.validate(tls)?;
        let tokens = if set(&auth.tokens_file) { Some(Arc::new(TokenFile::tokens(&auth.tokens_file)?)) } else { None };
        let certs = if set(&tls.client_tenants_file) {
            Some(Arc::new(CertTenantsFile::cert_tenants(&tls.client_tenants_file)?))
        } else {
            None
        };
        register_metrics();
        Ok(Self {
            tokens,
            certs,
            tls: tls::server_config(tls)?,
            mutual_tls: set(&tls.client_ca),
            socket_requires_token: auth.socket_requires_token,
            insecure_tcp: auth.insecure_tcp,
            peers: PeerAllowList::new(&auth.allowed_uids, &auth.allowed_gids),
        })
    }

    /// Whether TCP clients must prove who they are (token or certificate).
    pub fn tcp_authenticated(&self) -> bool {
        self.tokens.is_some() || self.mutual_tls
    }

    /// Refuse a non-loopback TCP listener that anyone who reaches it could
    /// use, unless the operator said so explicitly (then say it loudly).
    pub fn check_tcp_exposure(&self, addr: SocketAddr) -> Result<()> {
        if addr.ip().to_canonical().is_loopback() || self.tcp_authenticated() {
            return Ok(());
        }
        if !self.insecure_tcp {
            return Err(Error::new(
                ErrorKind::FailedPrecondition,
                format!(
                    "refusing to serve gRPC on non-loopback {addr} without client authentication: set \
                     [auth] tokens_file or [tls] client_ca, or pass --insecure-tcp to accept anyone who can reach it"
                ),
            ));
        }
        tracing::warn!(
            %addr,
            "INSECURE: gRPC on a non-loopback TCP address without authentication (--insecure-tcp); anyone who \
             can reach it can read, write and delete every tenant's keys"
        );
        Ok(())
    }

    /// A tonic server for a TCP listener, with TLS when configured.
    pub fn tcp_server(&self) -> Result<Server> {
        let b = Server::builder();
        match &self.tls {
            Some(t) => b.tls_config(t.clone()).map_err(|e| Error::invalid(format!("TLS configuration: {e}"))),
            None => Ok(b),
        }
    }

    /// `svc` behind the token check of a TCP listener: a token is required
    /// when tokens are configured. Services wrap themselves, not the whole
    /// server, so the gRPC health service stays open to probes (over TLS
    /// it still needs the handshake, client certificate included).
    pub fn tcp_guard<S>(&self, svc: S) -> InterceptedService<S, TokenCheck> {
        let check = TokenCheck::new(self.tokens.clone(), self.tokens.is_some(), "tcp").with_certs(self.certs.clone());
        InterceptedService::new(svc, check)
    }

    /// `svc` behind the Unix socket's token check: a token that is sent is
    /// checked; none is required unless `socket_requires_token`.
    pub fn socket_guard<S>(&self, svc: S) -> InterceptedService<S, TokenCheck> {
        InterceptedService::new(svc, TokenCheck::new(self.tokens.clone(), self.socket_requires_token, "unix"))
    }

    pub fn peers(&self) -> &PeerAllowList {
        &self.peers
    }
}

/// Reasons a connection or request was refused, the label of
/// `cxlkv_auth_refusals_total`.
pub const REFUSALS: [(&str, &str); 7] = [
    ("tcp", "missing_token"),
    ("tcp", "bad_token"),
    ("tcp", "unbound_cert"),
    ("unix", "missing_token"),
    ("unix", "bad_token"),
    ("unix", "peer"),
    // The peer port (cluster): a credential bound to tenants is not a node's.
    ("peer", "tenant_bound"),
];

fn register_metrics() {
    metrics::describe_counter!(
        crate::metric_names::AUTH_REFUSALS,
        "Requests and connections refused for missing or wrong credentials, by listener and reason."
    );
    for (listener, reason) in REFUSALS {
        refused(listener, reason, 0);
    }
}

pub fn refused(listener: &'static str, reason: &'static str, n: u64) {
    metrics::counter!(crate::metric_names::AUTH_REFUSALS, "listener" => listener, "reason" => reason).increment(n);
}

#[cfg(test)]
mod tests;
