//! A follower's registry: every call goes to the primary, coalesced with
//! concurrent clients' calls into batches (`batcher`), so one client RPC
//! costs at most one forwarded RPC and a busy node sends few. Every
//! forwarded call is bounded by `forward_timeout_ms`; a node whose lease
//! ran out (no heartbeat answered) answers at once: stores fail with
//! UNAVAILABLE, lookups miss.
use std::sync::atomic::Ordering;

pub use super::epoch::Ident;
pub use crate::registry::directory::Fence;
use std::sync::Arc;
use std::time::Duration;

use super::batcher::Batcher;
use super::epoch::unavailable;
use super::holds::{Holds, Release};
use crate::error::{Error, ErrorKind, Result};
use crate::ids::{NodeId, ReservationId};
use crate::peer_proto::{self as pp, op::Op as O, op_result::Result as R};
use crate::registry::convert::{error_of, ids_to_peer, loc_results, result_of};
use crate::registry::directory::{bytes_of, envelope, looked, unexpected, Looked};
use crate::registry::{Admit, Directory, Freed, KeyInfo, Listed, Location, RegistryStats, Removed, Scope, Session};

pub struct Forwarded {
    batcher: Arc<Batcher>,
    client: super::epoch::Client,
    ident: Arc<Ident>,
    fence: Arc<Fence>,
    timeout: Duration,
    policy: std::sync::Mutex<String>,
    /// Node-held locks (`holds.rs`); None: every lookup goes to the primary.
    holds: Option<Arc<Holds>>,
}

impl Forwarded {
    pub fn new(client: super::epoch::Client, ident: Arc<Ident>, fence: Arc<Fence>, timeout: Duration) -> Self {
        let batcher = Batcher::new(client.clone(), ident.clone());
        Self { batcher, client, ident, fence, timeout, policy: Default::default(), holds: None }
    }

    /// Answer lookups of keys this node holds without a hop to the primary
    /// (`holds.rs`); a hold is given back after `idle_ms` without readers.
    pub fn with_holds(mut self, idle_ms: u64, pin_limit: u64) -> Self {
        let holds = Holds::new(idle_ms, self.timeout.as_millis() as u64).with_pin_limit(pin_limit);
        holds.registered(self.ident.instance.load(Ordering::Acquire));
        self.holds = Some(Arc::new(holds));
        self
    }

    pub fn holds(&self) -> Option<&Arc<Holds>> {
        self.holds.as_ref()
    }

    /// Give back holds that went idle (called periodically).
    pub async fn sweep_holds(&self) -> Result<()> {
        let Some(h) = &self.holds else { return Ok(()) };
        let out = h.sweep(h.now_ms());
        metrics::gauge!(crate::metric_names::CLUSTER_HELD_KEYS).set(h.len() as f64);
        self.release(out).await
    }

    /// One forwarded `Release` for these holds (nothing when empty).
    /// Those that did not reach the primary before go along; these go back
    /// to be sent again if this one does not arrive either.
    async fn release(&self, mut holds: Vec<Release>) -> Result<()> {
        let Some(h) = &self.holds else { return Ok(()) };
        holds.extend(h.resend(h.now_ms()));
        // Locks of an earlier registration went with it at the primary;
        // the op names this one, so the primary refuses it if it ends first.
        let registration = h.registration();
        holds.retain(|r| r.registration == registration);
        if holds.is_empty() {
            return Ok(());
        }
        let mut keys = vec![];
        let mut uses = vec![];
        for r in &holds {
            for i in 0..r.locks {
                keys.push(bytes::Bytes::from(r.key.clone()));
                uses.push(if i == 0 { r.uses } else { 0 });
            }
        }
        let mut op = envelope(Session::HOLD, None, O::Release(pp::Release { keys, uses }));
        op.instance = registration;
        match self.send(op).await {
            Ok(R::Unlock(_)) => Ok(()),
            Ok(_) => Err(unexpected()),
            Err(e) => {
                h.unsent(holds);
                Err(e)
            }
        }
    }

    pub fn set_policy(&self, p: &str) {
        *self.policy.lock().unwrap() = p.to_owned();
    }

    /// Median latency of recent forwarded batches, in µs.
    pub fn p50_us(&self) -> u64 {
        self.batcher.p50_us()
    }

    /// Batches and ops forwarded to the primary so far.
    pub fn sent(&self) -> (u64, u64) {
        self.batcher.sent()
    }

    /// The cluster's nodes as the primary sees them.
    pub async fn cluster_nodes(&self) -> Result<Vec<crate::proto::ClusterNode>> {
        let mut req = tonic::Request::new(pp::PeerStatsRequest {});
        req.set_timeout(self.timeout);
        let r = self.client.clone().stats(req).await.map_err(|s| unavailable(s.message()))?.into_inner();
        Ok(r.nodes
            .into_iter()
            .map(|n| crate::proto::ClusterNode {
                node: n.node,
                name: n.name,
                role: if n.primary { "primary" } else { "follower" }.into(),
                alive: n.alive,
                silent_ms: n.silent_ms,
                regions: n.regions,
                pages_total: n.pages_total,
                pages_free: n.pages_free,
                forwarded_p50_us: n.forwarded_p50_us,
                held_keys: n.held_keys,
            })
            .collect())
    }

    fn node(&self) -> u32 {
        self.ident.node.load(Ordering::Acquire) as u32
    }

    fn fenced() -> Error {
        Error::new(ErrorKind::Unavailable, "this node lost the cluster's primary: it does not write until it is back")
    }

    /// Send one operation to the primary (its session tagged with this
    /// node's id), within the client's deadline and `forward_timeout_ms`.
    async fn send(&self, mut op: pp::Op) -> Result<R> {
        if !self.fence.held() {
            return Err(Self::fenced());
        }
        op.owner = Session(op.owner).on_node(self.node()).0;
        let budget = crate::wire::deadline::budget(self.timeout);
        if budget.is_zero() {
            return Err(Error::new(ErrorKind::DeadlineExceeded, "the client's deadline passed before forwarding"));
        }
        match self.batcher.call(op, budget).await? {
            R::Error(s) => Err(error_of(&s).unwrap_or_else(|| unavailable("empty error"))),
            r => Ok(r),
        }
    }
}

impl Forwarded {
    /// One forwarded lookup `l` for `owner`; with `l.hold`, each hit is
    /// locked for this node (`owner` must be `Session::HOLD`) and comes with
    /// its tenant.
    /// `registration`: the one its holds are taken under (0: the batch's).
    async fn lookup_forwarded(
        &self,
        l: pp::Lookup,
        owner: Session,
        scope: &Scope,
        registration: u64,
    ) -> Result<(Looked, Vec<String>)> {
        let (keys, unlocks) = (l.keys.len(), l.unlock_first.len());
        let mut op = envelope(owner, Some(scope), O::Lookup(l));
        op.instance = registration;
        let R::Lookup(r) = self.send(op).await? else {
            return Err(unexpected());
        };
        let (looked, tenants) = looked(keys, unlocks, &r)?;
        Ok((looked, tenants.to_vec()))
    }
}

#[tonic::async_trait]
impl Directory for Forwarded {
    fn policy_name(&self) -> String {
        self.policy.lock().unwrap().clone()
    }

    fn is_local(&self) -> bool {
        false
    }

    fn may_write(&self) -> bool {
        self.fence.held()
    }

    async fn call(&self, op: pp::Op) -> Result<R> {
        self.send(op).await
    }

    async fn present(&self, keys: &[&[u8]]) -> Result<Vec<bool>> {
        // The primary answers this inside the reserve itself.
        Ok(vec![false; keys.len()])
    }

    async fn admit(&self, items: &[(&[u8], u64)]) -> Result<Vec<Admit>> {
        // The primary judges inside the reserve itself (`ReserveCall::judge`).
        Ok(vec![Admit::Admitted; items.len()])
    }

    async fn commit(&self, ids: &[ReservationId], owner: Session) -> Result<(Vec<Result<Location>>, u64)> {
        if ids.is_empty() {
            return Ok((vec![], 0));
        }
        let R::Commit(r) = self.send(envelope(owner, None, O::Commit(ids_to_peer(ids)))).await? else {
            return Err(unexpected());
        };
        let l = r.results.unwrap_or_default();
        Ok((loc_results(&l.statuses, &l.locations)?, r.removed_seq))
    }

    async fn lookup(
        &self,
        unlock: &[&[u8]],
        k: &[&[u8]],
        ttl_ms: u64,
        owner: Session,
        scope: &Scope,
    ) -> Result<Looked> {
        if !self.fence.held() {
            // No primary: every key is a miss, at once.
            return Ok((unlock.iter().map(|_| Err(Self::fenced())).collect(), k.iter().map(|_| Ok(None)).collect()));
        }
        // Between a rejoin's start and end (no registration): no holds. A
        // durable session's locks are its own at the primary, never the
        // node's (they must outlive this node's registration, and mark the
        // pool's view-lock mark there).
        let holds = self.holds.as_ref().filter(|_| !owner.is_durable());
        let Some((h, registration)) = holds.map(|h| (h, h.registration())).filter(|x| x.1 != 0) else {
            let l = pp::Lookup { unlock_first: bytes_of(unlock), keys: bytes_of(k), ttl_ms, hold: false };
            return self.lookup_forwarded(l, owner, scope, 0).await.map(|x| x.0);
        };
        // Answered from this node's holds where it can; the rest in one
        // forwarded lookup that takes holds on its hits (and renews holds
        // that would end before the client's lock).
        let now = h.now_ms();
        let unlocked = unlock.iter().map(|k| h.unlock(k, owner, now)).collect();
        let mut hits: Vec<Option<Result<Option<Location>>>> =
            k.iter().map(|k| h.lock(k, owner, ttl_ms, scope, now).map(|r| r.map(Some))).collect();
        let local = hits.iter().filter(|x| x.is_some()).count();
        metrics::counter!(crate::metric_names::CLUSTER_HELD_LOOKUPS).increment(local as u64);
        let missing: Vec<usize> = (0..k.len()).filter(|&i| hits[i].is_none()).collect();
        if !missing.is_empty() {
            let ask: Vec<&[u8]> = missing.iter().map(|&i| k[i]).collect();
            // Each key once: a second unlock could leave it unlocked for a moment.
            let mut renewing: hashbrown::HashSet<&[u8]> = ask.iter().copied().filter(|k| h.renewable(k, now)).collect();
            let renew: Vec<&[u8]> = renewing.iter().copied().collect();
            let (sent, hold_ttl) = (h.now_ms(), h.hold_ttl_ms(ttl_ms));
            let lookup =
                pp::Lookup { unlock_first: bytes_of(&renew), keys: bytes_of(&ask), ttl_ms: hold_ttl, hold: true };
            let ((_, got), tenants) = self.lookup_forwarded(lookup, Session::HOLD, scope, registration).await?;
            let mut refused: Vec<&[u8]> = vec![];
            for (j, (&i, r)) in missing.iter().zip(got).enumerate() {
                let renewal = renewing.remove(k[i]);
                match (&r, tenants.get(j)) {
                    (Ok(Some(loc)), Some(t)) => {
                        let adopted =
                            h.adopt(registration, k[i], *loc, t, sent + hold_ttl, owner, sent + ttl_ms, renewal);
                        if let Err(e) = adopted {
                            if e.kind() == ErrorKind::Aborted {
                                // Granted under a registration that ended:
                                // not this node's lock any more. A miss.
                                hits[i] = Some(Ok(None));
                                continue;
                            }
                            // Over the client's bound: nobody reads it here,
                            // so the node's lock goes back at once.
                            refused.push(k[i]);
                            hits[i] = Some(Err(e));
                            continue;
                        }
                    }
                    // A primary too old to name tenants takes no holds: its
                    // locks on the node's behalf lapse on their own.
                    (Ok(Some(_)), None) => {}
                    // A miss although held: the primary forgot the node's locks.
                    (Ok(None), _) => h.forget(k[i]),
                    // A renewal's unlock went through but no lock: the count here
                    // is off, so let what is left lapse rather than over-release.
                    (Err(_), _) if renewal => h.forget(k[i]),
                    (Err(_), _) => {}
                }
                hits[i] = Some(r);
            }
            if !refused.is_empty() {
                self.release(h.take(refused, h.now_ms())).await?;
            }
        }
        Ok((unlocked, hits.into_iter().map(|x| x.unwrap_or(Ok(None))).collect()))
    }

    async fn unlock(&self, k: &[&[u8]], owner: Session) -> Result<Vec<Result<()>>> {
        let Some(h) = self.holds.as_ref().filter(|_| !owner.is_durable()) else {
            let R::Unlock(r) = self.send(envelope(owner, None, O::Unlock(pp::Keys { keys: bytes_of(k) }))).await?
            else {
                return Err(unexpected());
            };
            return Ok(r.statuses.iter().map(result_of).collect());
        };
        // This node's clients lock only held keys, here. A key not held
        // here is asked of the primary, so the answer is the one the
        // primary gives (NOT_FOUND for an unknown key, for instance).
        let now = h.now_ms();
        let mut out: Vec<Option<Result<()>>> = k.iter().map(|k| h.knows(k).then(|| h.unlock(k, owner, now))).collect();
        let ask: Vec<&[u8]> = k.iter().zip(&out).filter(|(_, r)| r.is_none()).map(|(k, _)| *k).collect();
        if !ask.is_empty() {
            let R::Unlock(r) = self.send(envelope(owner, None, O::Unlock(pp::Keys { keys: bytes_of(&ask) }))).await?
            else {
                return Err(unexpected());
            };
            if r.statuses.len() != ask.len() {
                return Err(unexpected());
            }
            let mut answers = r.statuses.iter().map(result_of);
            for slot in out.iter_mut().filter(|r| r.is_none()) {
                *slot = answers.next();
            }
        }
        Ok(out.into_iter().map(|r| r.expect("every key answered")).collect())
    }

    async fn release_session(&self, owner: Session) -> Result<u64> {
        if let Some(h) = self.holds.as_ref().filter(|_| !owner.is_durable()) {
            let (n, idle) = h.release_session(owner, h.now_ms());
            self.release(idle).await?;
            return Ok(n);
        }
        let R::Released(n) = self.send(envelope(owner, None, O::ReleaseSession(true))).await? else {
            return Err(unexpected());
        };
        Ok(n)
    }

    async fn delete(&self, k: &[&[u8]], scope: &Scope) -> Result<Vec<Result<Location>>> {
        if let Some(h) = &self.holds {
            // This node's own hold must not keep its client from deleting;
            // a key some client still reads stays locked.
            self.release(h.take(k.iter().copied(), h.now_ms())).await?;
        }
        let op = O::Delete(pp::Keys { keys: bytes_of(k) });
        let R::Delete(l) = self.send(envelope(Session::LOCAL, Some(scope), op)).await? else {
            return Err(unexpected());
        };
        loc_results(&l.statuses, &l.locations)
    }

    async fn exists(&self, k: &[&[u8]], scope: &Scope) -> Result<Vec<bool>> {
        if !self.fence.held() {
            return Ok(vec![false; k.len()]);
        }
        let op = O::Exists(pp::Keys { keys: bytes_of(k) });
        let R::Exists(b) = self.send(envelope(Session::LOCAL, Some(scope), op)).await? else {
            return Err(unexpected());
        };
        Ok(b.values)
    }

    async fn evict(&self, _node: NodeId, _pages: u64, _page_size: u64) -> Result<Freed> {
        // Eviction for a follower happens inside its forwarded reserve.
        Ok(vec![])
    }

    async fn expire(&self) -> Result<Freed> {
        // The primary expires reservations; their pages come back as notices.
        Ok(vec![])
    }

    async fn list(&self, cursor: u64, limit: usize, tenant: Option<&str>, scope: &Scope) -> Result<Listed> {
        let (scoped, scope_tenants) = match scope {
            Scope::Tenants(t) => (true, t.iter().cloned().collect()),
            Scope::All => (false, vec![]),
        };
        let mut req = tonic::Request::new(pp::ListRequest {
            cursor,
            limit: limit as u32,
            tenant: tenant.unwrap_or_default().to_owned(),
            all_tenants: tenant.is_none(),
            scoped,
            scope_tenants,
        });
        req.set_timeout(self.timeout);
        let r = self.client.clone().list(req).await.map_err(|s| unavailable(s.message()))?.into_inner();
        let keys =
            r.keys.into_iter().map(|k| KeyInfo { key: k.key.to_vec(), tenant: k.tenant, size: k.size }).collect();
        Ok((keys, r.next_cursor))
    }

    async fn stats(&self) -> Result<RegistryStats> {
        let mut req = tonic::Request::new(pp::PeerStatsRequest {});
        req.set_timeout(self.timeout);
        let r = self.client.clone().stats(req).await.map_err(|s| unavailable(s.message()))?.into_inner();
        Ok(RegistryStats {
            keys: r.keys,
            reserved: r.reserved,
            bytes_stored: r.bytes_stored,
            locked_keys: r.locked_keys,
            evictions: r.evictions,
            reservations_expired: r.reservations_expired,
            locks_expired: r.locks_expired,
            eviction_visits: r.eviction_visits,
            quota_evictions: r.quota_evictions,
            admission: r.admission.as_ref().map(crate::registry::convert::admission_from_proto).unwrap_or_default(),
            tenants: r
                .tenants
                .into_iter()
                .map(|t| crate::registry::TenantUsage {
                    tenant: t.tenant,
                    bytes: t.bytes,
                    keys: t.keys,
                    reserving_bytes: t.reserving_bytes,
                    quota_bytes: t.quota_bytes,
                    guaranteed_bytes: t.guaranteed_bytes,
                })
                .collect(),
        })
    }

    async fn removed_since(&self, since: u64, max: usize) -> Result<(Vec<Removed>, u64, bool)> {
        let mut req = tonic::Request::new(pp::RemovedRequest { since, max: max as u32 });
        req.set_timeout(self.timeout);
        let r = self.client.clone().removed(req).await.map_err(|s| unavailable(s.message()))?.into_inner();
        let out = r
            .keys
            .into_iter()
            .map(|k| Removed {
                seq: k.seq,
                key: k.key.to_vec(),
                tenant: k.tenant,
                size: k.size,
                reason: crate::registry::Removal::parse(&k.reason),
            })
            .collect();
        Ok((out, r.next, r.truncated))
    }
}
