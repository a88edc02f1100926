//! Client certificates bound to tenants: `[tls] client_tenants_file` names
//! each certificate by its subject's common name (CN), one per line, with
//! what it grants — `CN *` (operator) or `CN TENANT...`, as in the tokens
//! file. Only certificates that chain to `client_ca` get this far (rustls
//! checks that in the handshake); of those, one whose CN is not listed is
//! refused. The file is re-read when it changes, like the tokens file.
use std::path::Path;

use hashbrown::HashMap;

use super::grants::{grant, grant_lines, Watched, RELOAD_EVERY};
use crate::error::{Error, Result};
use crate::registry::Scope;

#[derive(Debug, Default)]
pub struct CertTenants {
    by_cn: HashMap<String, Scope>,
}

impl CertTenants {
    /// `CN *` or `CN TENANT...` per line (`""` is the empty tenant); `#`
    /// starts a comment.
    pub fn parse(text: &str) -> Result<Self> {
        let mut by_cn = HashMap::new();
        for (n, cn, tenants) in grant_lines(text) {
            let at = |msg: &str| Error::invalid(format!("client tenants file line {n}: {msg}"));
            let scope = grant(&tenants).map_err(|m| at(&format!("a certificate name {m}")))?;
            if by_cn.insert(cn.to_string(), scope).is_some() {
                return Err(at(&format!("{cn:?} appears twice")));
            }
        }
        Ok(Self { by_cn })
    }

    /// What the certificate `der` (the client's own, first in its chain)
    /// grants; Err names what was presented, for the refusal.
    pub fn scope_of(&self, der: &[u8]) -> std::result::Result<Scope, String> {
        let cn = subject_cn(der).ok_or("the client certificate has no readable subject CN")?;
        self.by_cn.get(&cn).cloned().ok_or_else(|| format!("client certificate CN={cn:?} is bound to no tenant"))
    }
}

/// The subject's first common name.
pub fn subject_cn(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_owned)
}

pub type CertTenantsFile = Watched<CertTenants>;

impl Watched<CertTenants> {
    pub fn cert_tenants(path: &Path) -> Result<Self> {
        Self::open(path, CertTenants::parse, RELOAD_EVERY)
    }
}
