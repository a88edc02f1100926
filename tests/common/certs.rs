//! Test certificates made at run time (no private key is ever committed): a
//! CA, a server certificate for localhost / 127.0.0.1, and client
//! certificates signed by the CA or by an unrelated one.
use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

pub struct Pki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// Signed by `ca`.
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// Signed by another CA that the sidecar does not trust.
    pub rogue_cert: PathBuf,
    pub rogue_key: PathBuf,
    dir: PathBuf,
    issuer: CertifiedIssuer<'static, KeyPair>,
}

fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, name);
    CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap()
}

/// Write a leaf certificate for `names` signed by `issuer`; returns (cert, key).
fn leaf(dir: &Path, file: &str, names: &[&str], issuer: &CertifiedIssuer<'_, KeyPair>) -> (PathBuf, PathBuf) {
    let mut p = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    p.distinguished_name.push(DnType::CommonName, file);
    let key = KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, issuer).unwrap();
    let (c, k) = (dir.join(format!("{file}.pem")), dir.join(format!("{file}.key")));
    std::fs::write(&c, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    (c, k)
}

impl Pki {
    pub fn new(dir: &Path) -> Self {
        let (good, rogue) = (ca("cxlkv test CA"), ca("some other CA"));
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, good.pem()).unwrap();
        let (server_cert, server_key) = leaf(dir, "server", &["localhost", "127.0.0.1"], &good);
        let (client_cert, client_key) = leaf(dir, "client", &["client.test"], &good);
        let (rogue_cert, rogue_key) = leaf(dir, "rogue", &["client.test"], &rogue);
        Self {
            ca,
            server_cert,
            server_key,
            client_cert,
            client_key,
            rogue_cert,
            rogue_key,
            dir: dir.into(),
            issuer: good,
        }
    }

    /// Another client certificate signed by `ca`, with subject CN `cn`;
    /// returns (cert, key).
    #[allow(dead_code)] // not every test binary binds certificates
    pub fn client(&self, cn: &str) -> (PathBuf, PathBuf) {
        leaf(&self.dir, cn, &["client.test"], &self.issuer)
    }

    /// The `[tls]` section of a sidecar config for mutual TLS.
    pub fn server_toml(&self) -> String {
        format!(
            "[tls]\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n",
            self.server_cert.display().to_string(),
            self.server_key.display().to_string(),
            self.ca.display().to_string()
        )
    }
}
