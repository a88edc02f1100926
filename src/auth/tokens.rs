//! Bearer tokens: the server's tokens file (each token bound to tenants or
//! to all of them), re-read when it changes, and the interceptor that checks
//! `authorization: Bearer <token>` on every request.
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tonic::service::Interceptor;
use tonic::{Request, Status};

use crate::error::{Error, Result};
use crate::registry::Scope;

/// Shortest token accepted: one must not be guessable.
pub const MIN_TOKEN_BYTES: usize = 16;
/// How often a watched file is checked for a change (a `stat`).
pub const RELOAD_EVERY: Duration = Duration::from_secs(1);

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

/// The lines of a grants file (tokens, certificate names): line number
/// (from 1), the credential, and what follows it; blank lines and `#`
/// comments skipped.
pub(super) fn grant_lines(text: &str) -> impl Iterator<Item = (usize, &str, Vec<&str>)> {
    text.lines().enumerate().filter_map(|(n, line)| {
        let mut words = line.split('#').next().unwrap_or("").split_whitespace();
        let first = words.next()?;
        Some((n + 1, first, words.collect()))
    })
}

/// What a credential's line grants: `*` (an operator: every tenant) or
/// tenants, `""` naming the empty one (LMCache without a `cache_salt`).
pub(super) fn grant(tenants: &[&str]) -> std::result::Result<Scope, &'static str> {
    match tenants {
        [] => Err("needs its tenants, or * for an operator"),
        ["*"] => Ok(Scope::All),
        t if t.contains(&"*") => Err("lists tenants beside *: * cannot be combined with tenants"),
        t => Ok(Scope::tenants(t.iter().map(|t| if *t == "\"\"" { "" } else { t }))),
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

/// What identifies a version of a file: a rewrite, a rename over it or a
/// Kubernetes secret's symlink swap all change it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp(Option<(SystemTime, u64, u64, u64)>);

fn stamp(path: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    Stamp(
        std::fs::metadata(path)
            .ok()
            .map(|m| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len(), m.ino(), m.dev())),
    )
}

/// A file parsed into `T`, parsed again when it changes (checked at most
/// every `every`, on use). A version that does not parse is skipped with a
/// warning: the previous one stays in force until the file is fixed.
pub struct Watched<T> {
    path: PathBuf,
    parse: fn(&str) -> Result<T>,
    every: Duration,
    state: Mutex<(Arc<T>, Stamp, Instant)>,
}

impl<T> Watched<T> {
    pub fn open(path: &Path, parse: fn(&str) -> Result<T>, every: Duration) -> Result<Self> {
        let s = stamp(path);
        let v = read_parse(path, parse)?;
        Ok(Self { path: path.to_owned(), parse, every, state: Mutex::new((Arc::new(v), s, Instant::now())) })
    }

    pub fn current(&self) -> Arc<T> {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if g.2.elapsed() >= self.every {
            g.2 = Instant::now();
            let s = stamp(&self.path);
            if s != g.1 {
                g.1 = s;
                match read_parse(&self.path, self.parse) {
                    Ok(v) => {
                        g.0 = Arc::new(v);
                        tracing::info!(path = %self.path.display(), "reloaded");
                    }
                    Err(e) => {
                        tracing::warn!(path = %self.path.display(), error = %e.message(), "changed file does not parse: kept the previous version")
                    }
                }
            }
        }
        g.0.clone()
    }
}

fn read_parse<T>(path: &Path, parse: fn(&str) -> Result<T>) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
    parse(&text).map_err(|e| Error::invalid(format!("{}: {}", path.display(), e.message())))
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
