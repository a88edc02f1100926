//! TLS for TCP listeners and their clients, through tonic's rustls support
//! (ring provider). With `client_ca` set, a client must present a
//! certificate that chains to it, or the handshake fails.
use std::path::Path;
use std::time::Duration;

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use super::{set, TlsConfig};
use crate::error::{Error, Result};

/// A handshake that has not finished by then is dropped, so stalled
/// connections cannot pile up.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) fn read(what: &str, p: &Path) -> Result<Vec<u8>> {
    std::fs::read(p).map_err(|e| Error::io(format!("read {what} {}", p.display()), e))
}

/// The listener's TLS configuration, checked by building it once (a bad
/// PEM file or a key that does not match stops the start).
pub(super) fn server_config(t: &TlsConfig) -> Result<Option<ServerTlsConfig>> {
    if !set(&t.cert) {
        return Ok(None);
    }
    let identity = Identity::from_pem(read("tls.cert", &t.cert)?, read("tls.key", &t.key)?);
    let mut c = ServerTlsConfig::new().identity(identity).timeout(HANDSHAKE_TIMEOUT);
    if set(&t.client_ca) {
        c = c.client_ca_root(Certificate::from_pem(read("tls.client_ca", &t.client_ca)?));
    }
    tonic::transport::Server::builder()
        .tls_config(c.clone())
        .map_err(|e| Error::invalid(format!("[tls] {}: {e}", t.cert.display())))?;
    Ok(Some(c))
}

/// A client's TLS: trust `ca` for the server, present `cert`/`key` when given.
pub(super) fn client_config(
    ca: &Path,
    cert_key: Option<(&Path, &Path)>,
    domain: Option<&str>,
) -> Result<ClientTlsConfig> {
    let mut c = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read("CA", ca)?));
    if let Some((cert, key)) = cert_key {
        c = c.identity(Identity::from_pem(read("client certificate", cert)?, read("client key", key)?));
    }
    if let Some(d) = domain {
        c = c.domain_name(d);
    }
    Ok(c)
}
