//! The client side of authentication, for `cxlkv status`, tests and peer
//! sidecars: a bearer token read from a file (re-read when it changes) and
//! TLS with an optional client certificate.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

use super::grants::{Watched, RELOAD_EVERY};
use super::tokens::check_token;
use crate::error::{Error, ErrorKind, Result};
use crate::proto::cxlkv_client::CxlkvClient;
use crate::wire::MAX_MESSAGE;

pub type AuthedClient = CxlkvClient<InterceptedService<Channel, BearerToken>>;

/// How a client proves who it is. All empty: a plain connection.
#[derive(Debug, Clone, Default)]
pub struct ClientAuth {
    /// File holding the token (surrounding whitespace ignored).
    pub token_file: Option<PathBuf>,
    /// CA of the server's certificate; set = TLS.
    pub tls_ca: Option<PathBuf>,
    /// Client certificate and key for mutual TLS.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// Name to check the server's certificate against (default: the host
    /// of the address).
    pub tls_domain: Option<String>,
}

fn parse_token(text: &str) -> Result<MetadataValue<Ascii>> {
    let t = text.trim();
    check_token(t).map_err(Error::invalid)?;
    format!("Bearer {t}").parse().map_err(|_| Error::invalid("token is not a valid header value"))
}

/// Adds `authorization: Bearer <token>` to every request when a token file
/// is set; the file is re-read when it changes (checked at most once a
/// second), so a long-lived client follows a rotation.
#[derive(Clone, Default)]
pub struct BearerToken(Option<Arc<Watched<MetadataValue<Ascii>>>>);

impl BearerToken {
    pub fn from_file(path: &Path) -> Result<Self> {
        Ok(Self(Some(Arc::new(Watched::open(path, parse_token, RELOAD_EVERY)?))))
    }
}

impl Interceptor for BearerToken {
    fn call(&mut self, mut req: Request<()>) -> std::result::Result<Request<()>, Status> {
        if let Some(t) = &self.0 {
            req.metadata_mut().insert("authorization", (*t.current()).clone());
        }
        Ok(req)
    }
}

impl ClientAuth {
    pub fn token(&self) -> Result<BearerToken> {
        self.token_file.as_deref().map_or(Ok(BearerToken::default()), BearerToken::from_file)
    }

    /// An endpoint for `host:port`: `https` with TLS when a CA is set.
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint> {
        let bad = |e: tonic::transport::Error| Error::invalid(format!("address {addr:?}: {e}"));
        let Some(ca) = &self.tls_ca else {
            return Ok(Endpoint::from_shared(format!("http://{addr}")).map_err(bad)?.tcp_nodelay(true));
        };
        let cert_key = match (&self.tls_cert, &self.tls_key) {
            (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
            (None, None) => None,
            _ => return Err(Error::invalid("a client certificate needs its key, and the other way round")),
        };
        let tls = super::tls::client_config(ca, cert_key, self.tls_domain.as_deref())?;
        let e = Endpoint::from_shared(format!("https://{addr}")).map_err(bad)?.tcp_nodelay(true);
        e.tls_config(tls).map_err(|e| Error::invalid(format!("TLS: {e}")))
    }

    pub async fn connect_tcp(&self, addr: &str) -> Result<AuthedClient> {
        let ch = self.endpoint(addr)?.connect().await.map_err(|e| unreachable(addr, &e))?;
        Ok(wrap(ch, self.token()?))
    }

    /// The Unix socket (a token, never TLS).
    pub async fn connect_uds(&self, path: &Path) -> Result<AuthedClient> {
        let ch = crate::client::channel_uds(path.to_owned()).await.map_err(|e| unreachable(path.display(), &e))?;
        Ok(wrap(ch, self.token()?))
    }
}

fn unreachable(what: impl std::fmt::Display, e: &tonic::transport::Error) -> Error {
    use std::error::Error as _;
    let cause = e.source().map(|s| format!(": {s}")).unwrap_or_default();
    Error::new(ErrorKind::Unavailable, format!("cannot reach cxlkv at {what}: {e}{cause}"))
}

fn wrap(ch: Channel, token: BearerToken) -> AuthedClient {
    CxlkvClient::with_interceptor(ch, token)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE)
}
