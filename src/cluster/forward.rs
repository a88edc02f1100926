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
use crate::ids::NodeId;
use crate::peer_proto::{self as pp, op::Op as O, op_result::Result as R};
use crate::registry::convert::{error_of, lookup_result, status_of};
use crate::registry::ops::{bytes_of, envelope, looked, unexpected};
use crate::registry::{Admit, Directory, Freed, Location, Scope, Session};

pub struct Forwarded {
    batcher: Arc<Batcher>,
    client: super::epoch::Client,
    ident: Arc<Ident>,
    fence: Arc<Fence>,
    timeout: Duration,
    policy: std::sync::Mutex<String>,
    /// Node-held locks (`holds.rs`); None: every lookup goes to the primary.
    holds: Option<Arc<Holds>>,
    /// Lookups answered from the holds, and how many keys are held: metrics
    /// resolved once (every such lookup records them).
    held_lookups: metrics::Counter,
    held_keys: metrics::Gauge,
}

impl Forwarded {
    pub fn new(client: super::epoch::Client, ident: Arc<Ident>, fence: Arc<Fence>, timeout: Duration) -> Self {
        let batcher = Batcher::new(client.clone(), ident.clone());
        Self {
            batcher,
            client,
            ident,
            fence,
            timeout,
            policy: Default::default(),
            holds: None,
            held_lookups: metrics::counter!(crate::metric_names::CLUSTER_HELD_LOOKUPS),
            held_keys: metrics::gauge!(crate::metric_names::CLUSTER_HELD_KEYS),
        }
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
        self.held_keys.set(h.len() as f64);
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
        let mut req = tonic::Request::new(pp::NodesRequest {});
        req.set_timeout(self.timeout);
        let r = self.client.clone().nodes(req).await.map_err(|s| unavailable(s.message()))?.into_inner();
        Ok(r.nodes)
    }

    fn node(&self) -> u32 {
        self.ident.node.load(Ordering::Acquire) as u32
    }

    fn fenced() -> Error {
        Error::new(ErrorKind::Unavailable, "this node lost the cluster's primary: it does not write until it is back")
    }

    /// Send one operation to the primary; refused at once while this node
    /// is cut off from it.
    async fn send(&self, op: pp::Op) -> Result<R> {
        if !self.fence.held() {
            return Err(Self::fenced());
        }
        self.forward(op).await
    }

    /// Forward one operation to the primary (its session tagged with this
    /// node's id), within the client's deadline and `forward_timeout_ms`:
    /// coalesced with other clients' calls, or alone (`sent_alone`).
    async fn forward(&self, mut op: pp::Op) -> Result<R> {
        op.owner = Session(op.owner).on_node(self.node()).0;
        let budget = crate::wire::deadline::budget(self.timeout);
        if budget.is_zero() {
            return Err(Error::new(ErrorKind::DeadlineExceeded, "the client's deadline passed before forwarding"));
        }
        let alone = op.op.as_ref().is_some_and(sent_alone);
        let sent = if alone { self.batcher.alone(op, budget).await } else { self.batcher.call(op, budget).await };
        match sent? {
            R::Error(s) => Err(error_of(&s).unwrap_or_else(|| unavailable("empty error"))),
            r => Ok(r),
        }
    }
}

/// The reads of the pool a node makes (the key listing, the registry's
/// figures, which housekeeping reads every tick, and the removal log): not
/// a store's or a lookup's registry call, so each goes in a batch of its
/// own, outside the coalescing and the forwarded-call figures, and is asked
/// of the primary even while this node is cut off from it.
fn sent_alone(op: &O) -> bool {
    matches!(op, O::List(_) | O::Stats(_) | O::Removed(_))
}

/// This node's answer to `op` while it is cut off from the primary (its
/// lease ran out): lookups miss and nothing exists, at once; the reads
/// `sent_alone` are asked of the primary all the same (None); everything
/// else is refused, UNAVAILABLE.
fn cut_off(op: &O) -> Option<Result<R>> {
    Some(Ok(match op {
        O::Lookup(l) => {
            let unlocked: Vec<Result<()>> = l.unlock_first.iter().map(|_| Err(Forwarded::fenced())).collect();
            let hits: Vec<Result<Option<Location>>> = l.keys.iter().map(|_| Ok(None)).collect();
            R::Lookup(lookup_result(&unlocked, &hits, vec![]))
        }
        O::Exists(k) => R::Exists(pp::Bools { values: vec![false; k.keys.len()] }),
        op if sent_alone(op) => return None,
        _ => return Some(Err(Forwarded::fenced())),
    }))
}

/// What a follower adds to the operations on its own: lookups answered
/// from this node's holds (`holds.rs`) where it can.
impl Forwarded {
    /// A client's lookup (`op`) with holds: answered from this node's
    /// holds where it can; the rest in one forwarded lookup that takes
    /// holds on its hits (and renews holds that would end before the
    /// client's lock).
    async fn lookup_held(&self, h: &Holds, registration: u64, mut op: pp::Op) -> Result<R> {
        let owner = Session(op.owner);
        let scope = if op.scoped { Scope::tenants(op.scope_tenants.iter().cloned()) } else { Scope::All };
        let Some(O::Lookup(l)) = op.op.take() else { return Err(unexpected()) };
        let (unlock, k, ttl_ms) = (slices(&l.unlock_first), slices(&l.keys), l.ttl_ms);
        let now = h.now_ms();
        let unlocked: Vec<Result<()>> = unlock.iter().map(|k| h.unlock(k, owner, now)).collect();
        let mut hits: Vec<Option<Result<Option<Location>>>> =
            k.iter().map(|k| h.lock(k, owner, ttl_ms, &scope, now).map(|r| r.map(Some))).collect();
        let local = hits.iter().filter(|x| x.is_some()).count();
        self.held_lookups.increment(local as u64);
        let missing: Vec<usize> = (0..k.len()).filter(|&i| hits[i].is_none()).collect();
        if !missing.is_empty() {
            let ask: Vec<&[u8]> = missing.iter().map(|&i| k[i]).collect();
            // Each key once: a second unlock could leave it unlocked for a moment.
            let mut renewing: hashbrown::HashSet<&[u8]> = ask.iter().copied().filter(|k| h.renewable(k, now)).collect();
            let renew: Vec<&[u8]> = renewing.iter().copied().collect();
            let (sent, hold_ttl) = (h.now_ms(), h.hold_ttl_ms(ttl_ms));
            let lookup =
                pp::Lookup { unlock_first: bytes_of(&renew), keys: bytes_of(&ask), ttl_ms: hold_ttl, hold: true };
            // Taken under this registration: the primary refuses it if it ends first.
            let held = pp::Op { owner: Session::HOLD.0, op: Some(O::Lookup(lookup)), instance: registration, ..op };
            let R::Lookup(r) = self.send(held).await? else { return Err(unexpected()) };
            let ((_, got), tenants) = looked(ask.len(), renew.len(), &r)?;
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
        let hits: Vec<_> = hits.into_iter().map(|x| x.unwrap_or(Ok(None))).collect();
        Ok(R::Lookup(lookup_result(&unlocked, &hits, vec![])))
    }

    /// A client's unlock (`op`) with holds: this node's clients lock only
    /// held keys, here. A key not held here is asked of the primary, so the
    /// answer is the one the primary gives (NOT_FOUND for an unknown key,
    /// for instance).
    async fn unlock_held(&self, h: &Holds, mut op: pp::Op) -> Result<R> {
        let owner = Session(op.owner);
        let Some(O::Unlock(keys)) = op.op.take() else { return Err(unexpected()) };
        let now = h.now_ms();
        let mut out: Vec<Option<crate::proto::KeyStatus>> =
            keys.keys.iter().map(|k| h.knows(k).then(|| status_of(&h.unlock(k, owner, now)))).collect();
        let ask: Vec<bytes::Bytes> =
            keys.keys.into_iter().zip(&out).filter(|(_, r)| r.is_none()).map(|(k, _)| k).collect();
        if !ask.is_empty() {
            let n = ask.len();
            let R::Unlock(r) = self.send(pp::Op { op: Some(O::Unlock(pp::Keys { keys: ask })), ..op }).await? else {
                return Err(unexpected());
            };
            if r.statuses.len() != n {
                return Err(unexpected());
            }
            let mut answers = r.statuses.into_iter();
            for slot in out.iter_mut().filter(|r| r.is_none()) {
                *slot = answers.next();
            }
        }
        Ok(R::Unlock(pp::Statuses { statuses: out.into_iter().map(|r| r.expect("every key answered")).collect() }))
    }
}

fn slices(keys: &[bytes::Bytes]) -> Vec<&[u8]> {
    keys.iter().map(|k| &k[..]).collect()
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
        let owner = Session(op.owner);
        // A durable session's locks are its own at the primary, never the
        // node's (they must outlive this node's registration, and mark the
        // pool's view-lock mark there).
        let holds = self.holds.as_ref().filter(|_| !owner.is_durable());
        match (&op.op, holds) {
            (Some(O::Commit(ids)), _) if ids.ids.is_empty() => Ok(R::Commit(pp::CommitResult::default())),
            // Between a rejoin's start and end (no registration): no holds.
            (Some(O::Lookup(_)), Some(h)) if self.fence.held() => match h.registration() {
                0 => self.send(op).await,
                registration => self.lookup_held(h, registration, op).await,
            },
            (Some(O::Unlock(_)), Some(h)) => self.unlock_held(h, op).await,
            (Some(O::ReleaseSession(_)), Some(h)) => {
                let (n, idle) = h.release_session(owner, h.now_ms());
                self.release(idle).await?;
                Ok(R::Released(n))
            }
            (Some(O::Delete(k)), _) => {
                if let Some(h) = &self.holds {
                    // This node's own hold must not keep its client from
                    // deleting; a key some client still reads stays locked.
                    self.release(h.take(k.keys.iter().map(|k| &k[..]), h.now_ms())).await?;
                }
                self.send(op).await
            }
            _ => match op.op.as_ref().filter(|_| !self.fence.held()).and_then(cut_off) {
                Some(answer) => answer,
                None => self.forward(op).await,
            },
        }
    }

    async fn present(&self, keys: &[&[u8]]) -> Result<Vec<bool>> {
        // The primary answers this inside the reserve itself.
        Ok(vec![false; keys.len()])
    }

    async fn admit(&self, items: &[(&[u8], u64)]) -> Result<Vec<Admit>> {
        // The primary judges inside the reserve itself (`ReserveCall::judge`).
        Ok(vec![Admit::Admitted; items.len()])
    }

    async fn evict(&self, _node: NodeId, _pages: u64, _page_size: u64) -> Result<Freed> {
        // Eviction for a follower happens inside its forwarded reserve.
        Ok(vec![])
    }

    async fn expire(&self) -> Result<Freed> {
        // The primary expires reservations; their pages come back as notices.
        Ok(vec![])
    }
}
