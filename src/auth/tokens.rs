//! Bearer tokens: the server's tokens file (each token bound to tenants or
//! to all of them), re-read when it changes, and the interceptor that checks
//! `authorization: Bearer <token>` on every request.
use std::path::Path;
use std::sync::Arc;

use tonic::service::Interceptor;
use tonic::{Request, Status};

use super::grants::{grant, grant_lines, Watched, RELOAD_EVERY};
use crate::error::{Error, Result};
use crate::registry::Scope;

/// Shortest token accepted: one must not be guessable.
pub const MIN_TOKEN_BYTES: usize = 16;

/// The tokens of a tokens file and what each grants.
#[derive(Debug, Default)]
pub struct Tokens {
    entries: Vec<(Box<[u8]>, Scope)>,
}

/// A token must be an HTTP header value without spaces, and long enough.
pub fn check_token(t: &str) -> std::result::Result<(), String> {
    if t.len() < MIN_TOKEN_BYTES {
        return Err(format!("token shorter than {MIN_TOKEN_BYTES} bytes"));
    }
    if !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("token has a byte that is not printable ASCII".into());
    }
    Ok(())
}

impl Tokens {
    /// `TOKEN *` (operator) or `TOKEN TENANT...` per line; `""` names the
    /// empty tenant (LMCache without a `cache_salt`); `#` starts a comment.
    /// Errors name the line, never the token.
    pub fn parse(text: &str) -> Result<Self> {
        let mut entries: Vec<(Box<[u8]>, Scope)> = vec![];
        for (n, token, tenants) in grant_lines(text) {
            let at = |msg: &str| Error::invalid(format!("tokens file line {n}: {msg}"));
            check_token(token).map_err(|m| at(&m))?;
            let scope = grant(&tenants).map_err(|m| at(&format!("a token {m}")))?;
            if entries.iter().any(|(k, _)| **k == *token.as_bytes()) {
                return Err(at("the token appears twice"));
            }
            entries.push((token.as_bytes().into(), scope));
        }
        Ok(Self { entries })
    }

    /// What `presented` grants, if it is a token. Every entry is compared in
    /// full, so the time taken says nothing about how much of a token matched.
    pub fn find(&self, presented: &[u8]) -> Option<Scope> {
        let mut found = None;
        for (t, scope) in &self.entries {
            if ct_eq(t, presented) && found.is_none() {
                found = Some(scope.clone());
            }
        }
        found
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Constant-time equality of the contents (the length is not secret: it is
/// the same for every token an operator generates).
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// The server's tokens file.
pub type TokenFile = Watched<Tokens>;

impl Watched<Tokens> {
    pub fn tokens(path: &Path) -> Result<Self> {
        Self::open(path, Tokens::parse, RELOAD_EVERY)
    }
}

/// Checks `authorization: Bearer <token>` and puts the token's `Scope` into
/// the request. Without tokens configured it lets everything through; a
/// token that is presented is always checked, a missing one is refused only
/// where tokens are `required`.
#[derive(Clone)]
pub struct TokenCheck {
    tokens: Option<Arc<TokenFile>>,
    required: bool,
    listener: &'static str,
    /// TCP with mutual TLS: client certificates bound to tenants.
    certs: Option<Arc<super::certs::CertTenantsFile>>,
}

impl TokenCheck {
    pub fn new(tokens: Option<Arc<TokenFile>>, required: bool, listener: &'static str) -> Self {
        Self { tokens, required, listener, certs: None }
    }

    /// A request without a token is then granted what its client
    /// certificate is bound to, and refused if it is bound to nothing.
    pub fn with_certs(mut self, certs: Option<Arc<super::certs::CertTenantsFile>>) -> Self {
        self.certs = certs;
        self
    }

    fn refuse(&self, reason: &'static str, msg: &str) -> Status {
        // Per request and attacker-driven: debug only; the metric counts them.
        tracing::debug!(listener = self.listener, reason, "request refused");
        super::refused(self.listener, reason, 1);
        Status::unauthenticated(msg)
    }
}

impl Interceptor for TokenCheck {
    /// A request that passes admits its connection (`conn::ConnState::admit`):
    /// connections that never send one are closed after the handshake timeout.
    fn call(&mut self, req: Request<()>) -> std::result::Result<Request<()>, Status> {
        let req = self.check(req)?;
        if let Some(c) = crate::conn::conn_of(&req) {
            c.state.admit();
        }
        Ok(req)
    }
}

impl TokenCheck {
    fn check(&mut self, mut req: Request<()>) -> std::result::Result<Request<()>, Status> {
        let value = req.metadata().get("authorization").filter(|_| self.tokens.is_some()).cloned();
        let Some(value) = value else {
            if let Some(certs) = &self.certs {
                // The listener's connections are `conn::Conn`s, so tonic's TLS
                // info wraps their `ConnInfo` (`Request::peer_certs` looks
                // for a plain TCP stream's).
                type Tls = tonic::transport::server::TlsConnectInfo<crate::conn::ConnInfo>;
                let certs_of = req.extensions().get::<Tls>().and_then(|i| i.peer_certs());
                let der = certs_of.and_then(|c| c.first().map(|c| c.to_vec()));
                // rustls already refused a connection without a certificate.
                let granted = der.ok_or_else(|| "no client certificate".to_string());
                return match granted.and_then(|d| certs.current().scope_of(&d)) {
                    Ok(scope) => {
                        req.extensions_mut().insert(scope);
                        Ok(req)
                    }
                    Err(msg) => Err(self.refuse("unbound_cert", &msg)),
                };
            }
            if self.required {
                return Err(self.refuse("missing_token", "a bearer token is required (authorization: Bearer <token>)"));
            }
            return Ok(req);
        };
        let tokens = self.tokens.as_ref().expect("checked above");
        match bearer(value.as_bytes()).and_then(|t| tokens.current().find(t)) {
            Some(scope) => {
                req.extensions_mut().insert(scope);
                Ok(req)
            }
            None => Err(self.refuse("bad_token", "invalid bearer token")),
        }
    }
}

/// The token of an `authorization` value `Bearer <token>` (the scheme is
/// case-insensitive, as in RFC 6750).
fn bearer(v: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = v.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| rest.trim_ascii())
}
