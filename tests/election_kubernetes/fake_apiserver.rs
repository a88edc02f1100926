//! A fake Kubernetes API server holding one coordination.k8s.io/v1 Lease,
//! over plain HTTP/1.1 on loopback: what the real one does for the calls the
//! election makes. It checks the bearer token (401), answers 404 for an
//! absent Lease, 409 for a create of an existing one or a replace at a stale
//! resourceVersion, bumps the resourceVersion on every write, and refuses a
//! body that is not a Lease of the real shape (unknown spec fields, a
//! renewTime that is not an RFC 3339 MicroTime) with 400. `hang` makes it
//! read requests and never answer. It records the verb of every request.
//! `start_tls` serves HTTPS with a given certificate, as the real one does.
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{crypto::ring, ServerConfig};
use tokio_rustls::TlsAcceptor;

pub const NAMESPACE: &str = "cxlkv";
pub const NAME: &str = "cxlkv-primary";

#[derive(Default)]
struct State {
    lease: Option<Value>,
    version: u64,
    verbs: Vec<&'static str>,
    hang: bool,
}

#[derive(Clone)]
pub struct FakeApiServer {
    pub addr: std::net::SocketAddr,
    https: bool,
    token: String,
    state: Arc<Mutex<State>>,
    task: Arc<tokio::task::JoinHandle<()>>,
}

struct Reply(u16, Value);

impl FakeApiServer {
    pub async fn start(token: &str) -> Self {
        Self::listen(token, None).await
    }

    /// HTTPS with the certificate and key in these PEM files.
    pub async fn start_tls(token: &str, cert: &std::path::Path, key: &std::path::Path) -> Self {
        let certs = CertificateDer::pem_file_iter(cert).unwrap().collect::<Result<Vec<_>, _>>().unwrap();
        let key = PrivateKeyDer::from_pem_file(key).unwrap();
        let cfg = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        Self::listen(token, Some(TlsAcceptor::from(Arc::new(cfg)))).await
    }

    async fn listen(token: &str, tls: Option<TlsAcceptor>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let (s, t, https) = (state.clone(), token.to_owned(), tls.is_some());
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let (s, t) = (s.clone(), t.clone());
                match tls.clone() {
                    None => drop(tokio::spawn(serve(conn, s, t))),
                    // A failed handshake (an untrusted client) just ends.
                    Some(tls) => drop(tokio::spawn(async move {
                        if let Ok(conn) = tls.accept(conn).await {
                            serve(conn, s, t).await
                        }
                    })),
                }
            }
        });
        Self { addr, https, token: token.to_owned(), state, task: Arc::new(task) }
    }

    pub fn url(&self) -> String {
        format!("{}://{}", if self.https { "https" } else { "http" }, self.addr)
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    /// The stored Lease as JSON (what `kubectl get lease -o json` shows).
    pub fn lease(&self) -> Option<Value> {
        self.state.lock().unwrap().lease.clone()
    }

    /// Replace the stored Lease's spec, as another writer would.
    pub fn set_spec(&self, spec: Value) {
        let mut s = self.state.lock().unwrap();
        s.version += 1;
        let v = s.version.to_string();
        let l = s.lease.as_mut().expect("a Lease to change");
        l["spec"] = spec;
        l["metadata"]["resourceVersion"] = json!(v);
    }

    pub fn hang(&self, hang: bool) {
        self.state.lock().unwrap().hang = hang;
    }

    /// The verbs (RBAC names) of the requests served so far.
    pub fn verbs(&self) -> Vec<&'static str> {
        self.state.lock().unwrap().verbs.clone()
    }

    pub fn stop(&self) {
        self.task.abort();
    }
}

/// One keep-alive connection: requests with a Content-Length body (what
/// the client sends), one answer each.
async fn serve<C: AsyncRead + AsyncWrite + Unpin>(conn: C, state: Arc<Mutex<State>>, token: String) {
    let mut conn = BufReader::new(conn);
    loop {
        let Some((method, path, auth, body)) = read_request(&mut conn).await else { return };
        // Checked under the lock that writes take: once `hang(true)` has
        // returned, no write lands.
        let reply = {
            let mut s = state.lock().unwrap();
            if s.hang {
                None
            } else if auth != format!("Bearer {token}") {
                Some(status(401, "Unauthorized", "Unauthorized"))
            } else {
                Some(route(&mut s, &method, &path, body))
            }
        };
        let Some(Reply(code, v)) = reply else { return std::future::pending().await };
        let body = v.to_string();
        let head =
            format!("HTTP/1.1 {code} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len());
        if conn.write_all(head.as_bytes()).await.is_err() || conn.write_all(body.as_bytes()).await.is_err() {
            return;
        }
    }
}

async fn read_request<C: AsyncRead + Unpin>(conn: &mut BufReader<C>) -> Option<(String, String, String, Vec<u8>)> {
    let mut line = String::new();
    conn.read_line(&mut line).await.ok().filter(|n| *n > 0)?;
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next()?.to_owned(), parts.next()?.to_owned());
    let (mut len, mut auth) = (0, String::new());
    loop {
        let mut h = String::new();
        conn.read_line(&mut h).await.ok().filter(|n| *n > 0)?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':')?;
        match k.to_ascii_lowercase().as_str() {
            "content-length" => len = v.trim().parse().ok()?,
            "authorization" => auth = v.trim().to_owned(),
            "transfer-encoding" => panic!("the fake API server reads Content-Length bodies only"),
            _ => {}
        }
    }
    let mut body = vec![0; len];
    conn.read_exact(&mut body).await.ok()?;
    let path = target.split('?').next().unwrap_or_default().to_owned();
    Some((method, path, auth, body))
}

fn status(code: u16, reason: &str, message: &str) -> Reply {
    let v = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                   "message": message, "reason": reason, "code": code});
    Reply(code, v)
}

fn route(s: &mut State, method: &str, path: &str, body: Vec<u8>) -> Reply {
    let leases = format!("/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases");
    let one = format!("{leases}/{NAME}");
    match (method, path) {
        ("GET", p) if p == one => {
            s.verbs.push("get");
            match &s.lease {
                Some(l) => Reply(200, l.clone()),
                None => status(404, "NotFound", &format!("leases.coordination.k8s.io \"{NAME}\" not found")),
            }
        }
        ("POST", p) if p == leases => {
            s.verbs.push("create");
            let l = match checked_lease(&body) {
                Ok(l) => l,
                Err(e) => return status(400, "BadRequest", &e),
            };
            if s.lease.is_some() {
                return status(409, "AlreadyExists", &format!("leases.coordination.k8s.io \"{NAME}\" already exists"));
            }
            Reply(201, store(s, l))
        }
        ("PUT", p) if p == one => {
            s.verbs.push("update");
            let l = match checked_lease(&body) {
                Ok(l) => l,
                Err(e) => return status(400, "BadRequest", &e),
            };
            let Some(cur) = &s.lease else { return status(404, "NotFound", "not found") };
            if l["metadata"]["resourceVersion"] != cur["metadata"]["resourceVersion"] {
                return status(
                    409,
                    "Conflict",
                    "the object has been modified; please apply your changes to the latest version and try again",
                );
            }
            Reply(200, store(s, l))
        }
        _ => status(404, "NotFound", &format!("{method} {path}: no such route")),
    }
}

fn store(s: &mut State, mut l: Value) -> Value {
    s.version += 1;
    l["metadata"]["resourceVersion"] = json!(s.version.to_string());
    s.lease = Some(l.clone());
    l
}

/// The body must be this Lease, with only Lease spec fields, of their types.
fn checked_lease(body: &[u8]) -> Result<Value, String> {
    let l: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    if l["apiVersion"] != "coordination.k8s.io/v1" || l["kind"] != "Lease" || l["metadata"]["name"] != NAME {
        return Err(format!("not the Lease {NAME}: {l}"));
    }
    let spec = l["spec"].as_object().ok_or("no spec")?;
    for (k, v) in spec {
        let ok = match k.as_str() {
            "holderIdentity" | "preferredHolder" | "strategy" => v.is_string(),
            "leaseDurationSeconds" | "leaseTransitions" => v.as_i64().is_some_and(|n| i32::try_from(n).is_ok()),
            "acquireTime" | "renewTime" => v.as_str().is_some_and(is_micro_time),
            _ => false,
        };
        if !ok {
            return Err(format!("spec.{k}: {v} is not a valid value"));
        }
    }
    Ok(l)
}

/// RFC 3339 with microseconds in UTC, as the API server writes a MicroTime:
/// 2006-01-02T15:04:05.000000Z.
pub fn is_micro_time(s: &str) -> bool {
    let b = s.as_bytes();
    let digits = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_digit);
    b.len() == 27
        && digits(0..4)
        && b[4] == b'-'
        && digits(5..7)
        && b[7] == b'-'
        && digits(8..10)
        && b[10] == b'T'
        && digits(11..13)
        && b[13] == b':'
        && digits(14..16)
        && b[16] == b':'
        && digits(17..19)
        && b[19] == b'.'
        && digits(20..26)
        && b[26] == b'Z'
}
