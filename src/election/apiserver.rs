//! The `LeaseStore` of the `kubernetes` election: one coordination.k8s.io/v1
//! Lease read and written through the Kubernetes API server (kube-client
//! over rustls). In a pod the configuration is the in-cluster one:
//! `KUBERNETES_SERVICE_HOST`/`_PORT`, the service account's `ca.crt`, its
//! token (kube-client re-reads the token file about every minute, so a
//! rotated token is picked up) and its namespace file (the Lease's namespace
//! unless `cluster.lease_namespace` names another).
//!
//! The calls it makes are exactly those the Role in
//! `deploy/kubernetes/base/rbac.yaml` grants: `get`, `create` and `update`
//! (a replace at the read resourceVersion) on `leases`. Every call is bounded
//! by `timeout`, shorter than the election's renew interval, so a hung API
//! server delays the election loop by at most that and the local lease
//! lapses on time.
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube_client::api::{Api, PostParams};
use kube_client::{Client, Config};

use super::kubernetes::{conflict, LeaseRecord, LeaseStore};
use crate::error::{Error, ErrorKind, Result};

/// The Lease `name` in one namespace of one API server.
pub struct ApiLeases {
    api: Api<Lease>,
    name: String,
    namespace: String,
    timeout: Duration,
}

impl ApiLeases {
    /// The API server of the cluster this pod runs in. `namespace` empty:
    /// the service account's own.
    pub fn in_cluster(name: &str, namespace: &str, timeout: Duration) -> Result<Self> {
        let cfg = Config::incluster().map_err(|e| {
            Error::invalid(format!(
                "cluster.election = \"kubernetes\" runs in a Kubernetes pod with a service account: \
                 cannot load the in-cluster configuration ({e})"
            ))
        })?;
        Self::with_config(cfg, name, namespace, timeout)
    }

    /// Any API server (tests: a fake one on loopback). `namespace` empty:
    /// the config's default namespace.
    pub fn with_config(mut cfg: Config, name: &str, namespace: &str, timeout: Duration) -> Result<Self> {
        let namespace = if namespace.is_empty() { cfg.default_namespace.clone() } else { namespace.to_owned() };
        cfg.connect_timeout = Some(timeout);
        cfg.read_timeout = Some(timeout);
        cfg.write_timeout = Some(timeout);
        // A retry after a 429/503 would outlast the renew interval; the
        // election loop retries on its own schedule.
        cfg.default_retry = false;
        let client = Client::try_from(cfg)
            .map_err(|e| Error::invalid(format!("cannot build the Kubernetes API client: {e}")))?;
        let api = Api::namespaced(client, &namespace);
        Ok(Self { api, name: name.to_owned(), namespace, timeout })
    }

    /// Where the Lease is, for messages and `cxlkv status`.
    pub fn describe(&self) -> String {
        format!("Lease {}/{}", self.namespace, self.name)
    }

    /// One API call, bounded by the timeout, its errors made readable.
    async fn call<T>(&self, verb: &str, f: impl std::future::Future<Output = kube_client::Result<T>>) -> Result<T> {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(r) => r.map_err(|e| self.error(verb, e)),
            Err(_) => Err(Error::new(
                ErrorKind::Unavailable,
                format!("{verb} {}: the API server did not answer within {:?}", self.describe(), self.timeout),
            )),
        }
    }

    fn error(&self, verb: &str, e: kube_client::Error) -> Error {
        let kube_client::Error::Api(s) = e else {
            return Error::new(ErrorKind::Unavailable, format!("{verb} {}: {e}", self.describe()));
        };
        match s.code {
            409 => conflict(),
            401 => Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "{verb} {}: the API server refused the service-account token (401 {})",
                    self.describe(),
                    s.message
                ),
            ),
            403 => Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "{verb} {}: the service account may not {verb} leases in namespace {:?} \
                     (403: {}); bind it to the Role in deploy/kubernetes/base/rbac.yaml",
                    self.describe(),
                    self.namespace,
                    s.message
                ),
            ),
            code => Error::new(
                ErrorKind::Unavailable,
                format!("{verb} {}: the API server answered {code} {}: {}", self.describe(), s.reason, s.message),
            ),
        }
    }

    fn to_lease(&self, rec: &LeaseRecord) -> Result<Lease> {
        let int = |v: u64, what: &str| {
            i32::try_from(v).map_err(|_| Error::invalid(format!("{what} {v} does not fit a Lease's int32")))
        };
        Ok(Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                resource_version: (!rec.version.is_empty()).then(|| rec.version.clone()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(rec.holder.clone()),
                lease_duration_seconds: Some(int(rec.duration_s, "leaseDurationSeconds")?),
                acquire_time: Some(micro_time(rec.acquire_ms)?),
                renew_time: Some(micro_time(rec.renew_ms)?),
                lease_transitions: Some(int(rec.transitions, "leaseTransitions")?),
                ..Default::default()
            }),
        })
    }
}

fn micro_time(ms: u64) -> Result<MicroTime> {
    let t = i64::try_from(ms).ok().and_then(|ms| Timestamp::from_millisecond(ms).ok());
    t.map(MicroTime).ok_or_else(|| Error::invalid(format!("{ms} ms is not a time a Lease can hold")))
}

/// The fields the election reads; absent ones (a Lease some other tool
/// created) read as zero, which counts as expired and free.
fn to_record(l: Lease) -> LeaseRecord {
    let spec = l.spec.unwrap_or_default();
    let ms = |t: Option<MicroTime>| t.map_or(0, |t| t.0.as_millisecond().max(0) as u64);
    LeaseRecord {
        holder: spec.holder_identity.unwrap_or_default(),
        duration_s: spec.lease_duration_seconds.unwrap_or(0).max(0) as u64,
        acquire_ms: ms(spec.acquire_time),
        renew_ms: ms(spec.renew_time),
        transitions: spec.lease_transitions.unwrap_or(0).max(0) as u64,
        version: l.metadata.resource_version.unwrap_or_default(),
    }
}

#[tonic::async_trait]
impl LeaseStore for ApiLeases {
    async fn get(&self) -> Result<Option<LeaseRecord>> {
        Ok(self.call("get", self.api.get_opt(&self.name)).await?.map(to_record))
    }

    async fn create(&self, rec: LeaseRecord) -> Result<LeaseRecord> {
        let l = self.to_lease(&LeaseRecord { version: String::new(), ..rec })?;
        Ok(to_record(self.call("create", self.api.create(&PostParams::default(), &l)).await?))
    }

    async fn replace(&self, rec: LeaseRecord) -> Result<LeaseRecord> {
        // Without a resourceVersion the API server would overwrite whatever
        // is there: two candidates could both win.
        if rec.version.is_empty() {
            return Err(Error::new(ErrorKind::Internal, "a Lease replace needs the resourceVersion it read"));
        }
        let l = self.to_lease(&rec)?;
        Ok(to_record(self.call("update", self.api.replace(&self.name, &PostParams::default(), &l)).await?))
    }
}
