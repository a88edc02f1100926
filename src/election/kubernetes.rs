//! `kubernetes`: a coordination.k8s.io/v1 Lease as the election, the way
//! client-go's leader election uses one. The holder renews `renewTime`
//! every third of `leaseDurationSeconds`; another node takes the Lease
//! once it has seen it unchanged for the duration, raising
//! `leaseTransitions`, which is the epoch. As in client-go, that time is
//! measured on the observer's own monotonic clock from when it saw the
//! current resourceVersion, never by comparing `renewTime` (the holder's
//! wall clock) with its own: clock skew between nodes cannot cut a
//! holder's term short. Every write is a replace at the read `resourceVersion`, so
//! two candidates never both win. The holder's local lease is renewed from
//! the time of the read that preceded a successful renewal and lasts 2/3 of
//! the duration: a holder that cannot renew stops acting as primary before
//! another node may take the Lease.
//!
//! On shutdown the holder stops acting as primary, then clears
//! `holderIdentity`, so another node takes over at once instead of after
//! the duration (a rolling update of the DaemonSet restarts every node).
//!
//! The logic runs against the `LeaseStore` trait: `apiserver::ApiLeases`
//! talks to the API server; here it is tested with an in-memory store
//! (`tests::Memory`), and `tests/election_kubernetes.rs` runs it over HTTP
//! against a fake API server (no real one can run in the test environment).
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{decode, encode, Election, Leader, Leadership};
use crate::error::{Error, ErrorKind, Result};
use crate::registry::directory::Fence;

/// The fields of a Lease this election reads and writes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaseRecord {
    /// `spec.holderIdentity`: "name|peer_addr" of the primary.
    pub holder: String,
    /// `spec.leaseDurationSeconds`.
    pub duration_s: u64,
    /// `spec.acquireTime`, in Unix milliseconds: when the holder took it.
    pub acquire_ms: u64,
    /// `spec.renewTime`, in Unix milliseconds.
    pub renew_ms: u64,
    /// `spec.leaseTransitions`: the epoch.
    pub transitions: u64,
    /// `metadata.resourceVersion` (set by the store).
    pub version: String,
}

/// Where the Lease lives. `replace` must fail with ABORTED when the stored
/// version differs from `rec.version`, and `create` when it exists.
#[tonic::async_trait]
pub trait LeaseStore: Send + Sync + 'static {
    async fn get(&self) -> Result<Option<LeaseRecord>>;
    async fn create(&self, rec: LeaseRecord) -> Result<LeaseRecord>;
    async fn replace(&self, rec: LeaseRecord) -> Result<LeaseRecord>;
}

pub struct Kubernetes<S> {
    store: S,
    me: Leader,
    duration_s: u64,
    /// The Lease's version this node last saw, and when (its clock).
    seen: Mutex<Option<(String, Instant)>>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The Lease's duration for `lease_ms`: whole seconds, at least 2, the
/// same rounding as the local lease (`super::lease_window_ms`), which must
/// be shorter than it.
pub fn duration_s(lease_ms: u64) -> u64 {
    lease_ms.div_ceil(1000).max(2)
}

/// How often a candidate reads (and the holder renews) the Lease: every
/// third of the local lease (2/3 of the duration), so one lost round does
/// not lapse it.
pub fn renew_every(lease_ms: u64) -> Duration {
    Duration::from_millis(duration_s(lease_ms) * 1000 * 2 / 9)
}

/// The bound on one API call: shorter than the renew interval, so a round
/// that hangs still ends before the next one is due.
pub fn request_timeout(lease_ms: u64) -> Duration {
    renew_every(lease_ms) * 3 / 4
}

impl<S: LeaseStore> Kubernetes<S> {
    pub fn new(store: S, me: Leader, lease_ms: u64) -> Self {
        Self { store, me, duration_s: duration_s(lease_ms), seen: Mutex::new(None) }
    }

    /// Whether `cur` has stood unchanged for its duration, as of `at`. The
    /// holder's local lease began before the write of this version, and
    /// this node saw the version after that write, so the holder's local
    /// lease (2/3 of the duration) has lapsed by the time this is true.
    fn expired(&self, cur: &LeaseRecord, at: Instant) -> bool {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        match &*seen {
            Some((v, since)) if *v == cur.version => {
                at.saturating_duration_since(*since) >= Duration::from_secs(cur.duration_s)
            }
            _ => {
                *seen = Some((cur.version.clone(), at));
                false
            }
        }
    }

    /// One round at wall time `now` (written as renewTime) and monotonic
    /// time `at` (which times expiry): take, renew or observe the Lease.
    pub async fn step(&self, now: u64, at: Instant) -> Result<Leadership> {
        let me = encode(&self.me.name, &self.me.peer_addr);
        let mine =
            |rec: &LeaseRecord| Leadership { leader: Some(self.me.clone()), epoch: rec.transitions, i_lead: true };
        let Some(cur) = self.store.get().await? else {
            let rec = LeaseRecord {
                holder: me,
                duration_s: self.duration_s,
                acquire_ms: now,
                renew_ms: now,
                transitions: 1,
                ..Default::default()
            };
            return Ok(mine(&self.store.create(rec).await?));
        };
        let expired = self.expired(&cur, at);
        if cur.holder == me || expired || cur.holder.is_empty() {
            let (acquire_ms, transitions) =
                if cur.holder == me { (cur.acquire_ms, cur.transitions) } else { (now, cur.transitions + 1) };
            let rec =
                LeaseRecord { holder: me, duration_s: self.duration_s, acquire_ms, renew_ms: now, transitions, ..cur };
            return Ok(mine(&self.store.replace(rec).await?));
        }
        Ok(Leadership { leader: decode(&cur.holder), epoch: cur.transitions, i_lead: false })
    }

    /// Give the Lease up if this node holds it (at shutdown). Reports
    /// whether it did.
    pub async fn release(&self) -> Result<bool> {
        let me = encode(&self.me.name, &self.me.peer_addr);
        match self.store.get().await? {
            Some(cur) if cur.holder == me => {
                self.store.replace(LeaseRecord { holder: String::new(), ..cur }).await?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// At shutdown: stop acting as primary first, then let the Lease go.
    async fn step_down(&self, tx: &watch::Sender<Leadership>, lease: &Fence) {
        lease.expire();
        tx.send_if_modified(|cur| std::mem::replace(&mut cur.i_lead, false));
        match self.release().await {
            Ok(true) => tracing::warn!("released the Lease"),
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "could not release the Lease; it expires on its own"),
        }
    }
}

#[tonic::async_trait]
impl<S: LeaseStore> Election for Kubernetes<S> {
    fn backend(&self) -> &'static str {
        "kubernetes"
    }

    async fn run(self: Box<Self>, tx: watch::Sender<Leadership>, lease: Arc<Fence>, shutdown: CancellationToken) {
        let every = renew_every(self.duration_s * 1000);
        loop {
            let started = Instant::now();
            match self.step(now_ms(), started).await {
                Ok(l) => {
                    if l.i_lead {
                        lease.renew_at(started);
                        if !tx.borrow().i_lead {
                            metrics::counter!(crate::metric_names::CLUSTER_ELECTIONS_WON).increment(1);
                            tracing::warn!(epoch = l.epoch, "elected primary");
                        }
                    }
                    tx.send_if_modified(|cur| {
                        if *cur != l {
                            *cur = l;
                            true
                        } else {
                            false
                        }
                    });
                }
                Err(e) => tracing::warn!(error = %e, "election: cannot read or renew the Lease"),
            }
            // Self-fence: a holder that could not renew in time stops leading.
            if !lease.held() {
                tx.send_if_modified(|cur| std::mem::replace(&mut cur.i_lead, false));
            }
            tokio::select! {
                _ = shutdown.cancelled() => return self.step_down(&tx, &lease).await,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }
}

/// What a conflicting write returns.
pub fn conflict() -> Error {
    Error::new(ErrorKind::Aborted, "the Lease changed since it was read")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An in-memory Lease with resourceVersion checks, and a switch that
    /// makes every call fail (an API server out of reach).
    #[derive(Clone, Default)]
    pub struct Memory(Arc<Mutex<(Option<LeaseRecord>, u64, bool)>>);

    impl Memory {
        fn down(&self, down: bool) {
            self.0.lock().unwrap().2 = down;
        }
        fn peek(&self) -> LeaseRecord {
            self.0.lock().unwrap().0.clone().unwrap()
        }
    }

    #[tonic::async_trait]
    impl LeaseStore for Memory {
        async fn get(&self) -> Result<Option<LeaseRecord>> {
            let g = self.0.lock().unwrap();
            if g.2 {
                return Err(Error::new(ErrorKind::Unavailable, "api server down"));
            }
            Ok(g.0.clone())
        }
        async fn create(&self, mut rec: LeaseRecord) -> Result<LeaseRecord> {
            let mut g = self.0.lock().unwrap();
            if g.2 || g.0.is_some() {
                return Err(conflict());
            }
            g.1 += 1;
            rec.version = g.1.to_string();
            g.0 = Some(rec.clone());
            Ok(rec)
        }
        async fn replace(&self, mut rec: LeaseRecord) -> Result<LeaseRecord> {
            let mut g = self.0.lock().unwrap();
            if g.2 || g.0.as_ref().map(|r| &r.version) != Some(&rec.version) {
                return Err(conflict());
            }
            g.1 += 1;
            rec.version = g.1.to_string();
            g.0 = Some(rec.clone());
            Ok(rec)
        }
    }

    fn node(store: &Memory, name: &str) -> Kubernetes<Memory> {
        let me = Leader { name: name.into(), peer_addr: format!("{name}:50052") };
        Kubernetes::new(store.clone(), me, 3000)
    }

    /// A round at `ms` on both clocks (wall and monotonic, from `t0`).
    async fn step(k: &Kubernetes<Memory>, t0: Instant, ms: u64) -> Leadership {
        k.step(ms, t0 + Duration::from_millis(ms)).await.unwrap()
    }

    #[tokio::test]
    async fn the_first_candidate_leads_renews_and_the_others_follow_in_its_epoch() {
        let (s, t0) = (Memory::default(), Instant::now());
        let (a, b) = (node(&s, "a"), node(&s, "b"));
        let la = step(&a, t0, 1_000).await;
        assert!(la.i_lead && la.epoch == 1);
        let lb = step(&b, t0, 1_500).await;
        assert_eq!((lb.i_lead, lb.epoch, lb.leader.unwrap().name), (false, 1, "a".to_string()));
        // Renewals keep the epoch and move renewTime.
        assert_eq!(step(&a, t0, 2_000).await.epoch, 1);
        assert_eq!(s.peek().renew_ms, 2_000);
        // b saw the renewal only now: it follows for another 3 s.
        assert!(!step(&b, t0, 4_999).await.i_lead);
        assert!(!step(&b, t0, 7_998).await.i_lead);
    }

    #[tokio::test]
    async fn a_lease_not_renewed_for_its_duration_is_taken_with_a_higher_epoch() {
        let (s, t0) = (Memory::default(), Instant::now());
        let (a, b) = (node(&s, "a"), node(&s, "b"));
        step(&a, t0, 1_000).await;
        assert!(!step(&b, t0, 1_000).await.i_lead);
        let lb = step(&b, t0, 4_000).await;
        assert!(lb.i_lead && lb.epoch == 2, "{lb:?}");
        // The old holder comes back: it sees b, in the later epoch.
        let la = step(&a, t0, 4_100).await;
        assert_eq!((la.i_lead, la.epoch, la.leader.unwrap().name), (false, 2, "b".to_string()));
    }

    #[tokio::test]
    async fn two_candidates_racing_for_an_expired_lease_never_both_win() {
        let (s, t0) = (Memory::default(), Instant::now());
        let (a, b, c) = (node(&s, "a"), node(&s, "b"), node(&s, "c"));
        step(&a, t0, 0).await;
        step(&b, t0, 0).await;
        // b and c both read the expired Lease; only the first replace wins.
        let stale = s.get().await.unwrap().unwrap();
        let lb = step(&b, t0, 10_000).await;
        assert!(lb.i_lead);
        let me_c = encode("c", "c:50052");
        let lost = s.replace(LeaseRecord { holder: me_c, renew_ms: 10_000, transitions: 2, ..stale }).await;
        assert_eq!(lost.unwrap_err().kind(), ErrorKind::Aborted);
        assert!(!step(&c, t0, 10_001).await.i_lead);
        assert_eq!(s.peek().holder, encode("b", "b:50052"));
    }

    #[tokio::test]
    async fn expiry_is_timed_on_the_observer_s_clock_not_from_the_holder_s_renew_time() {
        let (s, t0) = (Memory::default(), Instant::now());
        let (a, b) = (node(&s, "a"), node(&s, "b"));
        // a's wall clock is 100 s behind b's: its renewTime looks ancient.
        step(&a, t0, 1_000).await;
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert!(!b.step(101_000, at(1_000)).await.unwrap().i_lead, "taken on a skewed renewTime");
        assert!(!b.step(103_999, at(3_999)).await.unwrap().i_lead);
        // Unchanged for the 3 s duration on b's own clock: b takes it.
        let lb = b.step(104_000, at(4_000)).await.unwrap();
        assert!(lb.i_lead && lb.epoch == 2, "{lb:?}");
    }

    #[tokio::test]
    async fn a_released_lease_is_taken_at_once_in_the_next_epoch() {
        let (s, t0) = (Memory::default(), Instant::now());
        let (a, b) = (node(&s, "a"), node(&s, "b"));
        step(&a, t0, 1_000).await;
        assert!(!b.release().await.unwrap(), "b holds nothing to release");
        assert!(a.release().await.unwrap());
        assert_eq!((s.peek().holder.as_str(), s.peek().transitions), ("", 1));
        let lb = step(&b, t0, 1_001).await;
        assert!(lb.i_lead && lb.epoch == 2, "{lb:?}");
    }

    #[tokio::test]
    async fn a_holder_that_cannot_renew_stops_leading_before_the_lease_can_pass_on() {
        let s = Memory::default();
        let a = Box::new(Kubernetes::new(s.clone(), Leader { name: "a".into(), peer_addr: "a:1".into() }, 1000));
        let (tx, mut rx) = watch::channel(Leadership::default());
        // The local lease lasts 2/3 of the 1 s duration.
        let lease = Arc::new(Fence::new(666));
        let stop = CancellationToken::new();
        let task = tokio::spawn(a.run(tx, lease.clone(), stop.clone()));
        rx.wait_for(|l| l.i_lead).await.unwrap();
        let renewed = s.peek().renew_ms;
        s.down(true);
        // The local lease (which the registry checks on every call) lapses
        // before anyone could take the Lease: 1 s after its last renewal.
        while lease.held() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(now_ms() < renewed + 1000, "the local lease outlived the Lease");
        rx.wait_for(|l| !l.i_lead).await.unwrap();
        assert!(!lease.held());
        stop.cancel();
        task.await.unwrap();
    }
}
