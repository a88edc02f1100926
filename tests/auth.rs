//! Authentication against the real binary: bearer tokens on TCP and the Unix
//! socket (and their rotation), mutual TLS, the refusal to expose an
//! unauthenticated non-loopback listener, and the Unix socket's peer
//! allow-list and group.
mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::certs::Pki;
use common::*;
use cxlkv::auth::{AuthedClient, ClientAuth};
use cxlkv::proto;

const OPERATOR: &str = "op-0123456789abcdef";
const WRONG: &str = "op-0123456789abcdeX";

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A config file with `extra` TOML, for `--config`.
fn config(dir: &Path, extra: &str) -> String {
    write(dir, "cxlkv.toml", extra).display().to_string()
}

fn token_auth(dir: &Path, name: &str, token: &str) -> ClientAuth {
    ClientAuth { token_file: Some(write(dir, name, &format!("{token}\n"))), ..Default::default() }
}

async fn pool_info(c: &mut AuthedClient) -> Result<proto::PoolInfoReply, tonic::Status> {
    c.pool_info(proto::PoolInfoRequest {}).await.map(|r| r.into_inner())
}

/// Wait (bounded) until the sidecar logged `needle`.
fn wait_log(s: &Sidecar, needle: &str) {
    let t = Instant::now();
    while !s.logs().contains(needle) {
        assert!(t.elapsed() < Duration::from_secs(30), "no {needle:?} in the log: {}", s.logs());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_required_on_tcp_and_checked_on_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = write(dir.path(), "tokens", &format!("# operators\n{OPERATOR} *\n"));
    let cfg = config(dir.path(), &format!("[auth]\ntokens_file = {:?}\n", tokens.display().to_string()));
    let (tcp, maddr) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
    let s = Sidecar::start(dir.path(), "a", &["--config", &cfg, "--tcp", &tcp, "--metrics-addr", &maddr]);

    let mut none = ClientAuth::default().connect_tcp(&tcp).await.unwrap();
    let e = pool_info(&mut none).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    let mut wrong = token_auth(dir.path(), "wrong", WRONG).connect_tcp(&tcp).await.unwrap();
    assert_eq!(pool_info(&mut wrong).await.unwrap_err().code(), tonic::Code::Unauthenticated);
    let mut plain = cxlkv::client::connect_tcp(&tcp).await.unwrap();
    let e = plain.reserve(proto::ReserveRequest::default()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "every RPC is guarded, not just PoolInfo");
    let mut op = token_auth(dir.path(), "op", OPERATOR).connect_tcp(&tcp).await.unwrap();
    assert_eq!(pool_info(&mut op).await.unwrap().node_id, 1);

    // The socket: no token = operator (socket_requires_token is off); a
    // token that is sent must be right.
    let mut uds = s.client().await;
    uds.pool_info(proto::PoolInfoRequest {}).await.unwrap();
    let mut uds_wrong = token_auth(dir.path(), "wrong", WRONG).connect_uds(&s.socket).await.unwrap();
    assert_eq!(pool_info(&mut uds_wrong).await.unwrap_err().code(), tonic::Code::Unauthenticated);

    assert_eq!(metric::<u64>(&maddr, "cxlkv_auth_refusals_total{listener=\"tcp\",reason=\"missing_token\"}"), Some(2));
    assert_eq!(metric::<u64>(&maddr, "cxlkv_auth_refusals_total{listener=\"tcp\",reason=\"bad_token\"}"), Some(1));
    assert_eq!(metric::<u64>(&maddr, "cxlkv_auth_refusals_total{listener=\"unix\",reason=\"bad_token\"}"), Some(1));

    // `cxlkv status` presents a token file.
    let status = |token: &Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_cxlkv"))
            .args(["status", "--tcp", &tcp, "--token-file", token.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let out = status(&dir.path().join("op"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = status(&dir.path().join("wrong"));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("Unauthenticated"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_tokens_file_takes_effect_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = write(dir.path(), "tokens", &format!("{OPERATOR} *\n"));
    let cfg = config(dir.path(), &format!("[auth]\ntokens_file = {:?}\n", tokens.display().to_string()));
    let tcp = format!("127.0.0.1:{}", free_port());
    let _s = Sidecar::start(dir.path(), "a", &["--config", &cfg, "--tcp", &tcp]);
    let new = "new-0123456789abcdef";
    let mut old_c = token_auth(dir.path(), "old", OPERATOR).connect_tcp(&tcp).await.unwrap();
    let mut new_c = token_auth(dir.path(), "new", new).connect_tcp(&tcp).await.unwrap();
    pool_info(&mut old_c).await.unwrap();
    assert_eq!(pool_info(&mut new_c).await.unwrap_err().code(), tonic::Code::Unauthenticated);
    // Rotate as documented: write a new file, rename it over the old one.
    let next = write(dir.path(), "tokens.next", &format!("{new} *\n"));
    std::fs::rename(next, &tokens).unwrap();
    let t = Instant::now();
    while pool_info(&mut new_c).await.is_err() {
        assert!(t.elapsed() < Duration::from_secs(10), "the new token was never accepted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(pool_info(&mut old_c).await.unwrap_err().code(), tonic::Code::Unauthenticated, "old token revoked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_a_missing_or_foreign_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let cfg = config(dir.path(), &pki.server_toml());
    let tcp = format!("127.0.0.1:{}", free_port());
    let s = Sidecar::start(dir.path(), "a", &["--config", &cfg, "--tcp", &tcp]);
    let tls = |cert: Option<(&PathBuf, &PathBuf)>| ClientAuth {
        tls_ca: Some(pki.ca.clone()),
        tls_cert: cert.map(|c| c.0.clone()),
        tls_key: cert.map(|c| c.1.clone()),
        tls_domain: Some("localhost".into()),
        ..Default::default()
    };
    let good = tls(Some((&pki.client_cert, &pki.client_key)));
    let mut a = good.connect_tcp(&tcp).await.unwrap();
    let mut b = good.connect_tcp(&tcp).await.unwrap();
    assert_eq!(pool_info(&mut a).await.unwrap().node_id, 1);

    // Refused in the handshake: no certificate, another CA's, or no TLS.
    let refused = |r: Result<AuthedClient, cxlkv::error::Error>| async move {
        match r {
            Err(_) => true,
            Ok(mut c) => pool_info(&mut c).await.is_err(),
        }
    };
    assert!(refused(tls(None).connect_tcp(&tcp).await).await, "no client certificate");
    assert!(refused(tls(Some((&pki.rogue_cert, &pki.rogue_key))).connect_tcp(&tcp).await).await, "foreign CA");
    assert!(refused(ClientAuth::default().connect_tcp(&tcp).await).await, "plain TCP");

    // Each TLS connection is a session of its own: one's lock is not the other's.
    let mut plain = s.client().await;
    inline_put(&mut plain, "k", 10, vec![vec![7; 10]]).await.unwrap();
    let look = proto::LookupRequest { keys: vec![key("k")], ..Default::default() };
    assert!(a.lookup_and_lock(look).await.unwrap().into_inner().results[0].found);
    let r = b.unlock(proto::UnlockRequest { keys: vec![key("k")] }).await.unwrap().into_inner();
    assert_eq!(r.statuses[0].code, tonic::Code::PermissionDenied as u32);

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cxlkv"))
        .args(["status", "--tcp", &tcp, "--tls-ca", pki.ca.to_str().unwrap(), "--tls-domain", "localhost"])
        .args(["--tls-cert", pki.client_cert.to_str().unwrap(), "--tls-key", pki.client_key.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("keys: 1 stored"));
}

#[test]
fn a_non_loopback_listener_needs_credentials_or_insecure_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let any = format!("0.0.0.0:{}", free_port());
    let mut s = Sidecar::start_unchecked(dir.path(), "a", &["--tcp", &any]);
    assert!(!s.wait_exit(Duration::from_secs(30)).success());
    assert!(s.logs().contains("refusing to serve gRPC on non-loopback"), "{}", s.logs());
    assert!(!s.socket.exists(), "nothing was served");

    let s = Sidecar::start(dir.path(), "b", &["--tcp", &any, "--insecure-tcp"]);
    assert!(s.logs().contains("INSECURE"), "the operator's choice is logged loudly: {}", s.logs());
    drop(s);

    let tokens = write(dir.path(), "tokens", &format!("{OPERATOR} *\n"));
    let cfg = config(dir.path(), &format!("[auth]\ntokens_file = {:?}\n", tokens.display().to_string()));
    let s = Sidecar::start(dir.path(), "c", &["--config", &cfg, "--tcp", &any]);
    assert!(!s.logs().contains("INSECURE"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_socket_refuses_peers_off_its_allow_list() {
    let dir = tempfile::tempdir().unwrap();
    let (uid, gid) = (nix::unistd::getuid().as_raw(), nix::unistd::getgid().as_raw());
    let maddr = format!("127.0.0.1:{}", free_port());
    let cfg = config(dir.path(), &format!("[auth]\nallowed_uids = [{}]\n", uid + 4242));
    let s = Sidecar::start_unchecked(dir.path(), "a", &["--config", &cfg, "--metrics-addr", &maddr]);
    wait_log(&s, "cxlkv serving");
    let served = match cxlkv::client::connect_uds(&s.socket).await {
        Ok(mut c) => c.pool_info(proto::PoolInfoRequest {}).await.is_ok(),
        Err(_) => false,
    };
    assert!(!served, "uid {uid} is not on the list");
    wait_log(&s, "refused a Unix socket connection");
    assert!(s.logs().contains(&format!("uid=Some({uid})")), "{}", s.logs());
    assert!(metric::<u64>(&maddr, "cxlkv_auth_refusals_total{listener=\"unix\",reason=\"peer\"}").unwrap() >= 1);
    drop(s);

    // Our primary gid on the list lets us in; the socket takes the
    // configured mode and group.
    let cfg = config(
        dir.path(),
        &format!("[server]\nsocket_mode = \"0600\"\nsocket_group = \"{}\"\n[auth]\nallowed_gids = [{gid}]\n", gid + 7),
    );
    let s = Sidecar::start(dir.path(), "b", &["--config", &cfg]);
    s.client().await.pool_info(proto::PoolInfoRequest {}).await.unwrap();
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let m = std::fs::metadata(&s.socket).unwrap();
    assert_eq!((m.permissions().mode() & 0o777, m.gid()), (0o600, gid + 7));
}
