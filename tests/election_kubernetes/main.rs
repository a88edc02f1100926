//! The `kubernetes` election over HTTP: `ApiLeases` (kube-client) against a
//! fake API server started in the test (`fake_apiserver`), since no real
//! API server can be installed in this test environment. The fake keeps
//! the API server's rules for one Lease (resourceVersion, 404, 409, bearer
//! token, the JSON shape of a coordination.k8s.io/v1 Lease), so these tests
//! prove the wire format and the error mapping the election relies on, and
//! run the election itself end to end over it.
#[path = "../common/certs.rs"]
#[allow(dead_code)]
mod certs;
mod fake_apiserver;

use std::sync::Arc;
use std::time::Duration;

use cxlkv::election::apiserver::ApiLeases;
use cxlkv::election::kubernetes::{self, Kubernetes, LeaseRecord, LeaseStore};
use cxlkv::election::{lease_window_ms, Election, Leader, Leadership};
use cxlkv::error::ErrorKind;
use cxlkv::registry::directory::Fence;
use fake_apiserver::{is_micro_time, FakeApiServer, NAME, NAMESPACE};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use tokio::sync::watch;
use tokio_rustls::rustls::pki_types::{pem::PemObject, CertificateDer};
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "sa-token-1";
/// The election's lease in most tests: a Lease of 2 s (the floor).
const LEASE_MS: u64 = 2000;
/// How long a test waits for what must happen before failing instead of
/// hanging (never a sleep that the test relies on).
const PATIENCE: Duration = Duration::from_secs(20);

/// A client of `api` presenting `token` (from a file, as in a pod).
fn store(api: &FakeApiServer, token: &str, timeout: Duration) -> (ApiLeases, tempfile::NamedTempFile) {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), token).unwrap();
    let mut cfg = kube_client::Config::new(api.url().parse().unwrap());
    cfg.default_namespace = NAMESPACE.into();
    cfg.auth_info.token_file = Some(f.path().to_string_lossy().into_owned());
    (ApiLeases::with_config(cfg, NAME, "", timeout).unwrap(), f)
}

fn record(holder: &str, renew_ms: u64, transitions: u64) -> LeaseRecord {
    LeaseRecord {
        holder: holder.into(),
        duration_s: 2,
        acquire_ms: renew_ms,
        renew_ms,
        transitions,
        version: "".into(),
    }
}

#[tokio::test]
async fn a_lease_round_trips_in_the_api_server_s_json_shape() {
    let api = FakeApiServer::start(TOKEN).await;
    let (s, _f) = store(&api, TOKEN, Duration::from_secs(5));
    assert_eq!(s.get().await.unwrap(), None, "404 reads as no Lease");
    let created = s.create(record("a|10.0.0.1:50052", 1_700_000_000_123, 1)).await.unwrap();
    assert_eq!(created.version, "1");
    // What the API server stored: the fields client-go's election uses.
    let l = api.lease().unwrap();
    let spec = &l["spec"];
    assert_eq!(spec["holderIdentity"], "a|10.0.0.1:50052");
    assert_eq!(spec["leaseDurationSeconds"], 2);
    assert_eq!(spec["leaseTransitions"], 1);
    assert_eq!(spec["renewTime"], "2023-11-14T22:13:20.123000Z");
    assert!(is_micro_time(spec["acquireTime"].as_str().unwrap()), "{l}");
    assert_eq!(l["metadata"]["namespace"], NAMESPACE);
    // Read back, renewed at the read version, read again.
    let got = s.get().await.unwrap().unwrap();
    assert_eq!(got, created);
    let renewed = s.replace(LeaseRecord { renew_ms: 1_700_000_001_000, ..got }).await.unwrap();
    assert_eq!((renewed.version.as_str(), renewed.renew_ms, renewed.transitions), ("2", 1_700_000_001_000, 1));
    assert_eq!(s.get().await.unwrap().unwrap(), renewed);
}

#[tokio::test]
async fn a_stale_replace_and_a_second_create_are_conflicts() {
    let api = FakeApiServer::start(TOKEN).await;
    let (s, _f) = store(&api, TOKEN, Duration::from_secs(5));
    let first = s.create(record("a|x:1", 1_000, 1)).await.unwrap();
    let again = s.create(record("b|x:2", 1_000, 1)).await.unwrap_err();
    assert_eq!(again.kind(), ErrorKind::Aborted, "{again}");
    // Another writer renews; a replace at the version read before loses.
    api.set_spec(serde_json::json!({"holderIdentity": "c|x:3", "leaseDurationSeconds": 2, "leaseTransitions": 2}));
    let stale = s.replace(LeaseRecord { holder: "b|x:2".into(), ..first }).await.unwrap_err();
    assert_eq!(stale.kind(), ErrorKind::Aborted, "{stale}");
    assert_eq!(api.lease().unwrap()["spec"]["holderIdentity"], "c|x:3");
}

#[tokio::test]
async fn a_refused_token_is_a_clear_error() {
    let api = FakeApiServer::start(TOKEN).await;
    let (s, _f) = store(&api, "expired-token", Duration::from_secs(5));
    let e = s.get().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert!(e.message().contains("refused the service-account token") && e.message().contains("401"), "{e}");
    let (s, _f) = store(&api, api.token(), Duration::from_secs(5));
    assert_eq!(s.get().await.unwrap(), None, "the right token is accepted");
}

#[tokio::test]
async fn a_hung_or_unreachable_api_server_is_an_error_not_a_wait() {
    let api = FakeApiServer::start(TOKEN).await;
    api.hang(true);
    let (s, _f) = store(&api, TOKEN, Duration::from_millis(300));
    let e = tokio::time::timeout(PATIENCE, s.get()).await.expect("bounded by the request timeout").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    // Nothing listens on a port that was just released.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut cfg = kube_client::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
    cfg.default_namespace = NAMESPACE.into();
    let s = ApiLeases::with_config(cfg, NAME, "", Duration::from_millis(300)).unwrap();
    let e = tokio::time::timeout(PATIENCE, s.get()).await.expect("bounded by the request timeout").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
}

#[tokio::test]
async fn a_pod_s_settings_reach_the_api_server_over_tls_verified_with_its_ca() {
    let dir = tempfile::tempdir().unwrap();
    let pki = certs::Pki::new(dir.path());
    let api = FakeApiServer::start_tls(TOKEN, &pki.server_cert, &pki.server_key).await;
    // What the in-cluster configuration sets: the service's address (an
    // IP, which the certificate must name), ca.crt and the token file.
    let config = |ca: &std::path::Path, token: &std::path::Path| {
        let mut cfg = kube_client::Config::new(api.url().parse().unwrap());
        cfg.default_namespace = NAMESPACE.into();
        // Config::incluster sets both: the bytes and the file it re-reads.
        let der = CertificateDer::pem_file_iter(ca).unwrap().map(|c| c.unwrap().to_vec()).collect();
        cfg.root_cert = Some(der);
        cfg.root_cert_file = Some(ca.into());
        cfg.auth_info.token_file = Some(token.to_string_lossy().into_owned());
        ApiLeases::with_config(cfg, NAME, "", Duration::from_secs(5)).unwrap()
    };
    let token = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(token.path(), TOKEN).unwrap();
    let s = config(&pki.ca, token.path());
    assert_eq!(s.get().await.unwrap(), None);
    s.create(record("a|10.0.0.1:50052", 1_000, 1)).await.unwrap();
    assert_eq!(api.lease().unwrap()["spec"]["holderIdentity"], "a|10.0.0.1:50052");
    // A server whose certificate that CA did not sign is not talked to.
    let rogue = config(&pki.rogue_cert, token.path());
    let e = rogue.get().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert_eq!(api.verbs(), ["get", "create"], "nothing reached the server without a verified certificate");
}

/// One candidate running the election loop over its own HTTP client.
struct Candidate {
    rx: watch::Receiver<Leadership>,
    lease: Arc<Fence>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    _token: tempfile::NamedTempFile,
}

fn candidate(api: &FakeApiServer, name: &str, lease_ms: u64) -> Candidate {
    let (s, f) = store(api, TOKEN, kubernetes::request_timeout(lease_ms));
    let me = Leader { name: name.into(), peer_addr: format!("10.0.0.{}:50052", name.len()) };
    let e: Box<dyn Election> = Box::new(Kubernetes::new(s, me, lease_ms));
    let cfg = cxlkv::config::ClusterConfig { lease_ms, ..Default::default() };
    let lease = Arc::new(Fence::new(lease_window_ms(&cfg)));
    let (tx, rx) = watch::channel(Leadership::default());
    let stop = CancellationToken::new();
    let task = tokio::spawn(e.run(tx, lease.clone(), stop.clone()));
    Candidate { rx, lease, stop, task, _token: f }
}

async fn until(rx: &mut watch::Receiver<Leadership>, f: impl FnMut(&Leadership) -> bool) -> Leadership {
    tokio::time::timeout(PATIENCE, rx.wait_for(f)).await.expect("in time").unwrap().clone()
}

#[tokio::test]
async fn when_the_leader_stops_renewing_the_other_takes_over_in_the_next_epoch() {
    let api = FakeApiServer::start(TOKEN).await;
    let mut a = candidate(&api, "a", LEASE_MS);
    let la = until(&mut a.rx, |l| l.i_lead).await;
    assert_eq!(la.epoch, 1);
    let mut b = candidate(&api, "bb", LEASE_MS);
    let lb = until(&mut b.rx, |l| l.leader.is_some()).await;
    assert_eq!((lb.i_lead, lb.epoch, lb.leader.unwrap().name.as_str()), (false, 1, "a"));
    // a dies without a word: its Lease must expire before b takes it.
    a.task.abort();
    let lb = until(&mut b.rx, |l| l.i_lead).await;
    assert_eq!((lb.epoch, lb.leader.unwrap().name.as_str()), (2, "bb"));
    let spec = api.lease().unwrap()["spec"].clone();
    assert_eq!(
        (spec["holderIdentity"].as_str(), spec["leaseTransitions"].as_i64()),
        (Some("bb|10.0.0.2:50052"), Some(2))
    );
    // The calls are exactly what the Role grants (deploy/kubernetes/base/rbac.yaml).
    let mut verbs = api.verbs();
    verbs.sort();
    verbs.dedup();
    assert_eq!(verbs, ["create", "get", "update"]);
    b.stop.cancel();
    b.task.await.unwrap();
}

#[tokio::test]
async fn a_leader_shut_down_releases_the_lease_after_it_stops_leading() {
    let api = FakeApiServer::start(TOKEN).await;
    let mut a = candidate(&api, "a", LEASE_MS);
    until(&mut a.rx, |l| l.i_lead).await;
    a.stop.cancel();
    a.task.await.unwrap();
    assert!(!a.rx.borrow().i_lead && !a.lease.held());
    let spec = api.lease().unwrap()["spec"].clone();
    assert_eq!((spec["holderIdentity"].as_str(), spec["leaseTransitions"].as_i64()), (Some(""), Some(1)));
    // The next candidate takes the free Lease in the next epoch.
    let mut b = candidate(&api, "bb", LEASE_MS);
    assert_eq!(until(&mut b.rx, |l| l.i_lead).await.epoch, 2);
    b.stop.cancel();
    b.task.await.unwrap();
}

#[tokio::test]
async fn a_leader_whose_api_server_stops_answering_stops_leading_before_its_lease_can_pass_on() {
    let api = FakeApiServer::start(TOKEN).await;
    // A 6 s Lease: the local lease (4 s) ends 2 s before it, a margin no
    // scheduling delay of this test comes near.
    let mut a = candidate(&api, "a", 6000);
    until(&mut a.rx, |l| l.i_lead).await;
    api.hang(true);
    // The last renewal the API server accepted (none can land after this).
    let spec = api.lease().unwrap()["spec"].clone();
    let renewed: Timestamp = spec["renewTime"].as_str().unwrap().parse().unwrap();
    let expires = renewed + SignedDuration::from_secs(spec["leaseDurationSeconds"].as_i64().unwrap());
    // The local lease, which the registry checks on every call of a
    // primary, lapses while the Lease is still its own: no other node can
    // have been primary yet.
    tokio::time::timeout(PATIENCE, async {
        while a.lease.held() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the local lease lapses");
    let lapsed = Timestamp::now();
    assert!(lapsed < expires, "the local lease lapsed at {lapsed}, after the Lease expired at {expires}");
    // And the election says so.
    until(&mut a.rx, |l| !l.i_lead).await;
    a.stop.cancel();
    tokio::time::timeout(PATIENCE, a.task).await.expect("shutdown is bounded by the request timeout").unwrap();
    api.stop();
}
