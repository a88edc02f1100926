//! Tenant-bound tokens against the real binary: a client bound to `alice`
//! cannot list, read, look up, lock, store or delete `bob`'s keys, and its
//! attempts change nothing; an operator token sees everything. Per-tenant
//! metric labels are off unless the config turns them on.
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use cxlkv::auth::{AuthedClient, ClientAuth};
use cxlkv::proto;
use proto::inline_get_chunk::Part as GetPart;
use proto::inline_put_chunk::Part as PutPart;

const OPERATOR: &str = "op-0123456789abcdef";
const ALICE: &str = "alice-0123456789abcdef";
const DENIED: u32 = tonic::Code::PermissionDenied as u32;

async fn client(dir: &Path, s: &Sidecar, name: &str, token: &str) -> AuthedClient {
    let file = dir.join(name);
    std::fs::write(&file, token).unwrap();
    ClientAuth { token_file: Some(file), ..Default::default() }.connect_uds(&s.socket).await.unwrap()
}

async fn put(c: &mut AuthedClient, tenant: &str, k: &str, data: &[u8]) -> Result<u32, tonic::Status> {
    let header = proto::InlinePutHeader { key: key(k), tenant: tenant.into(), size: data.len() as u64 };
    let msgs = vec![
        proto::InlinePutChunk { part: Some(PutPart::Header(header)) },
        proto::InlinePutChunk { part: Some(PutPart::Data(Bytes::copy_from_slice(data))) },
    ];
    let r = c.inline_put(tokio_stream::iter(msgs)).await?.into_inner();
    Ok(r.status.unwrap().code)
}

async fn get(c: &mut AuthedClient, k: &str) -> Result<Option<Vec<u8>>, tonic::Status> {
    let mut s = c.inline_get(proto::InlineGetRequest { key: key(k) }).await?.into_inner();
    let Some(GetPart::Header(h)) = s.message().await?.unwrap().part else { panic!("no header") };
    let mut out = vec![];
    while let Some(m) = s.message().await? {
        let Some(GetPart::Data(d)) = m.part else { panic!("data expected") };
        out.extend_from_slice(&d);
    }
    Ok(h.found.then_some(out))
}

async fn list(c: &mut AuthedClient, tenant: &str) -> Result<Vec<String>, tonic::Status> {
    let r = c.list_keys(proto::ListKeysRequest { tenant: tenant.into(), ..Default::default() }).await?;
    let mut keys: Vec<String> =
        r.into_inner().keys.iter().map(|k| format!("{}/{}", k.tenant, String::from_utf8_lossy(&k.key))).collect();
    keys.sort();
    Ok(keys)
}

/// Tenants of the removal log's entries, oldest first.
async fn removed(c: &mut AuthedClient) -> Vec<String> {
    let r = c.removed(proto::RemovedRequest::default()).await.unwrap().into_inner();
    r.keys.into_iter().map(|k| k.tenant).collect()
}

async fn stats(c: &mut AuthedClient) -> proto::StatsReply {
    c.stats(proto::StatsRequest {}).await.unwrap().into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_bound_client_cannot_touch_another_tenants_keys() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("{OPERATOR} *\n{ALICE} alice \"\"\n")).unwrap();
    let cfg = dir.path().join("cxlkv.toml");
    let toml = format!("[auth]\ntokens_file = {:?}\nsocket_requires_token = true\n", tokens.display().to_string());
    std::fs::write(&cfg, toml).unwrap();
    let s = Sidecar::start(dir.path(), "a", &["--config", cfg.to_str().unwrap()]);
    let mut op = client(dir.path(), &s, "op", OPERATOR).await;
    let mut alice = client(dir.path(), &s, "alice", ALICE).await;
    // Without a token the socket refuses (socket_requires_token).
    let e = s.client().await.pool_info(proto::PoolInfoRequest {}).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);

    assert_eq!(put(&mut op, "bob", "b1", b"bob's secret").await.unwrap(), 0);
    assert_eq!(put(&mut op, "bob", "b2", b"bob's other").await.unwrap(), 0);
    assert_eq!(put(&mut alice, "alice", "a1", b"alice's").await.unwrap(), 0);
    assert_eq!(put(&mut alice, "", "n1", b"no salt").await.unwrap(), 0, "\"\" binds the empty tenant");
    let before = list(&mut op, "").await.unwrap();
    assert_eq!(before, ["/n1", "alice/a1", "bob/b1", "bob/b2"]);

    // List: only her tenants' keys; naming another tenant is refused.
    assert_eq!(list(&mut alice, "").await.unwrap(), ["/n1", "alice/a1"]);
    assert_eq!(list(&mut alice, "bob").await.unwrap_err().code(), tonic::Code::PermissionDenied);
    // Inline read.
    assert_eq!(get(&mut alice, "b1").await.unwrap_err().code(), tonic::Code::PermissionDenied);
    assert_eq!(get(&mut alice, "a1").await.unwrap().unwrap(), b"alice's");
    // Lookup: per key, nothing locked for bob's.
    let look = proto::LookupRequest { keys: vec![key("a1"), key("b1"), key("zz")], ..Default::default() };
    let r = alice.lookup_and_lock(look).await.unwrap().into_inner().results;
    assert!(r[0].found && r[0].status.is_none());
    assert!(!r[1].found && r[1].location.is_none());
    assert_eq!(r[1].status.as_ref().unwrap().code, DENIED);
    assert!(!r[2].found && r[2].status.is_none(), "a miss stays a miss");
    assert_eq!(stats(&mut op).await.locked_keys, 1, "only alice's own key is locked");
    // Exists: bob's keys do not exist for her.
    let ex = alice.exists(proto::ExistsRequest { keys: vec![key("a1"), key("b1")] }).await.unwrap();
    assert_eq!(ex.into_inner().exists, [true, false]);
    // Delete: refused per key, the key stays.
    let d = alice.delete(proto::DeleteRequest { keys: vec![key("b1"), key("b2")] }).await.unwrap().into_inner();
    assert_eq!(d.statuses.iter().map(|s| s.code).collect::<Vec<_>>(), [DENIED, DENIED]);
    assert_eq!(d.sizes, [0, 0]);
    // Store under bob's tenant: refused whole, nothing reserved.
    let items = vec![proto::ReserveItem { key: key("b3"), size: 10, ..Default::default() }];
    let e = alice.reserve(proto::ReserveRequest { tenant: "bob".into(), items, ..Default::default() }).await;
    assert_eq!(e.unwrap_err().code(), tonic::Code::PermissionDenied);
    assert_eq!(put(&mut alice, "bob", "b3", b"forged").await.unwrap_err().code(), tonic::Code::PermissionDenied);
    // Stats name only her tenants.
    let mut seen: Vec<String> = stats(&mut alice).await.tenants.into_iter().map(|t| t.tenant).collect();
    seen.sort();
    assert_eq!(seen, ["", "alice"]);

    // Nothing of bob's changed: same keys, same bytes, nothing reserved.
    assert_eq!(list(&mut op, "").await.unwrap(), before);
    assert_eq!(get(&mut op, "b1").await.unwrap().unwrap(), b"bob's secret");
    let st = stats(&mut op).await;
    assert_eq!((st.keys, st.reserved), (4, 0));

    // The removal log shows her only her tenants' removals.
    let d = op.delete(proto::DeleteRequest { keys: vec![key("b2")] }).await.unwrap().into_inner();
    assert_eq!(d.statuses[0].code, 0);
    let unlock = proto::UnlockRequest { keys: vec![key("a1")] };
    assert_eq!(alice.unlock(unlock).await.unwrap().into_inner().statuses[0].code, 0);
    let d = alice.delete(proto::DeleteRequest { keys: vec![key("a1")] }).await.unwrap().into_inner();
    assert_eq!(d.statuses[0].code, 0, "her own key she may delete");
    assert_eq!(removed(&mut alice).await, ["alice"]);
    assert_eq!(removed(&mut op).await, ["bob", "alice"], "the operator sees both removals");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_tenant_metric_labels_are_off_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let maddr = format!("127.0.0.1:{}", free_port());
    let s = Sidecar::start(dir.path(), "a", &["--metrics-addr", &maddr]);
    let mut c = s.client().await;
    let mut m = PoolMap::open(&mut c).await;
    store(&mut c, &mut m, "secret-tenant", &[("k", pattern(1, 1234))]).await;
    // Wait for a housekeeping tick to publish the sum, then look at names.
    let t = Instant::now();
    let body = loop {
        let body = http_get(&maddr, "/metrics");
        if body.contains("cxlkv_tenant_stored_bytes{tenant=\"_other\"} 1234\n") {
            break body;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "the sum never appeared:\n{body}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!body.contains("secret-tenant"), "a tenant name reached /metrics");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_bound_to_a_tenant_sees_only_its_keys() {
    let dir = tempfile::tempdir().unwrap();
    let pki = common::certs::Pki::new(dir.path());
    let bindings = dir.path().join("cert-tenants");
    std::fs::write(&bindings, "alice-client alice\nops *\n").unwrap();
    let cfg = dir.path().join("cxlkv.toml");
    let toml = format!("{}client_tenants_file = {:?}\n", pki.server_toml(), bindings.display().to_string());
    std::fs::write(&cfg, toml).unwrap();
    let tcp = format!("127.0.0.1:{}", free_port());
    let _s = Sidecar::start(dir.path(), "a", &["--config", cfg.to_str().unwrap(), "--tcp", &tcp]);
    let connect = |cn: &str| {
        let (cert, key) = pki.client(cn);
        let auth = ClientAuth {
            tls_ca: Some(pki.ca.clone()),
            tls_cert: Some(cert),
            tls_key: Some(key),
            tls_domain: Some("localhost".into()),
            ..Default::default()
        };
        let tcp = tcp.clone();
        async move { auth.connect_tcp(&tcp).await.unwrap() }
    };
    let (mut ops, mut alice, mut stranger) =
        (connect("ops").await, connect("alice-client").await, connect("stranger").await);

    assert_eq!(put(&mut ops, "bob", "b1", b"bob's secret").await.unwrap(), 0);
    assert_eq!(put(&mut alice, "alice", "a1", b"alice's").await.unwrap(), 0);
    assert_eq!(put(&mut alice, "bob", "b2", b"forged").await.unwrap_err().code(), tonic::Code::PermissionDenied);
    assert_eq!(get(&mut alice, "b1").await.unwrap_err().code(), tonic::Code::PermissionDenied);
    assert_eq!(list(&mut alice, "").await.unwrap(), ["alice/a1"]);
    assert_eq!(list(&mut ops, "").await.unwrap(), ["alice/a1", "bob/b1"], "the operator certificate sees all");
    // A certificate the CA signed but the file does not bind: refused.
    let e = list(&mut stranger, "").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    assert!(e.message().contains("CN=\"stranger\" is bound to no tenant"), "{}", e.message());

    // Bound without a restart: the file is re-read when it changes.
    std::fs::write(&bindings, "alice-client alice\nops *\nstranger bob\n").unwrap();
    let t = Instant::now();
    loop {
        match list(&mut stranger, "").await {
            Ok(keys) => {
                assert_eq!(keys, ["bob/b1"]);
                break;
            }
            Err(e) => assert_eq!(e.code(), tonic::Code::Unauthenticated),
        }
        assert!(t.elapsed() < Duration::from_secs(10), "the new binding never took effect");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(get(&mut stranger, "b1").await.unwrap().unwrap(), b"bob's secret");
    assert_eq!(list(&mut alice, "").await.unwrap(), ["alice/a1"], "alice's binding is unchanged");
}
