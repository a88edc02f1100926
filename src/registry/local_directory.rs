//! The registry in this process behind the `Directory` boundary: a single
//! node's, or a cluster primary's (for its own clients and, through the
//! peer service, every follower's). `call` is the one place each operation
//! is answered: its arm reads the `Op`, runs it on the registry in chunks
//! of `REGISTRY_CHUNK` keys with this process's clock, and writes the
//! result. What a cluster adds is hooked in here too: free notices to the
//! owners of freed pages, deleted records erased in the pool, the reserve
//! gate of phase 3, an elected primary's lease and a new primary's grace.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard};
use std::time::Instant;

use super::admission::Run;
use super::convert::{from_peer, status_of, to_peer};
use super::directory::{Directory, Eraser, FreedSink, Lease, ReserveGate, REGISTRY_CHUNK};
use super::ops::{answer, chunked, outlives_the_lease, Answerer, ReserveCall, Reserved};
use super::{Admit, Freed, LocalRegistry, Location, ReserveOpts, Scope, Session};
use crate::error::{Error, ErrorKind, Result};
use crate::ids::{NodeId, RegionId};
use crate::peer_proto::{self as pp, op::Op as O, op_result::Result as R};

/// The registry in this process, with its monotonic clock.
pub struct LocalDirectory {
    reg: Arc<LocalRegistry>,
    /// An elected primary's lease: once it lapses every call is refused, so
    /// a primary that was paused or cut off never answers from a registry a
    /// newer primary has replaced.
    lease: Option<Arc<dyn Lease>>,
    epoch: Instant,
    /// In a cluster: every location the registry lets go of is also sent
    /// here, so its owner frees it even when the call came from elsewhere.
    sink: Option<Arc<dyn FreedSink>>,
    /// In a cluster: erases deleted objects' records in the pool at once.
    eraser: Option<Arc<dyn Eraser>>,
    /// A cluster's primary: the gate every reserve passes (phase 3).
    gate: OnceLock<Arc<dyn ReserveGate>>,
    /// A restarted node's or a new primary's first moments (registry ms):
    /// views taken before (the pool's view-lock mark) and, in a cluster,
    /// holds the previous primary granted may still be read, so nothing
    /// committed is removed (deleted, evicted, taken back) before then.
    grace_until: AtomicU64,
    /// A cluster primary's followers, node bits → the instance each joined
    /// with. An op made under an instance applies only while it is the
    /// node's current one, and a node's burial (`release_node`) waits for
    /// ops being applied: so none checked before the burial takes a lock or
    /// a reservation after it (nothing would ever give it back), and none
    /// made before a rejoin gives back a lock of the new registration.
    registrations: RwLock<HashMap<u32, u64>>,
}

impl LocalDirectory {
    pub fn new(reg: Arc<LocalRegistry>) -> Self {
        Self {
            reg,
            lease: None,
            epoch: Instant::now(),
            sink: None,
            eraser: None,
            gate: OnceLock::new(),
            grace_until: AtomicU64::new(0),
            registrations: RwLock::default(),
        }
    }

    pub fn with_sink(reg: Arc<LocalRegistry>, sink: Arc<dyn FreedSink>) -> Self {
        Self { sink: Some(sink), ..Self::new(reg) }
    }

    pub fn with_eraser(mut self, eraser: Arc<dyn Eraser>) -> Self {
        self.eraser = Some(eraser);
        self
    }

    pub fn with_lease(mut self, lease: Arc<dyn Lease>) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Every reserve passes `gate` from now on (set once).
    pub fn set_gate(&self, gate: Arc<dyn ReserveGate>) {
        let _ = self.gate.set(gate);
    }

    /// Remove nothing committed for `ms` from now (see `grace_until`).
    pub fn with_grace(self, ms: u64) -> Self {
        self.set_grace(ms);
        self
    }

    /// As `with_grace`, on a directory already shared.
    pub fn set_grace(&self, ms: u64) {
        self.grace_until.store(self.now_ms() + ms, Ordering::Relaxed);
    }

    /// Milliseconds of grace left (0: none).
    pub fn grace_left_ms(&self) -> u64 {
        self.grace_until.load(Ordering::Relaxed).saturating_sub(self.now_ms())
    }

    /// End the grace period now (the rebuild found nothing committed: no
    /// follower can hold anything of it).
    pub fn end_grace(&self) {
        self.grace_until.store(0, Ordering::Relaxed);
    }

    /// Still within a grace period: nothing committed may go.
    pub fn in_grace(&self) -> bool {
        self.now_ms() < self.grace_until.load(Ordering::Relaxed)
    }

    fn grace_refusal(&self) -> Error {
        Error::new(
            ErrorKind::Unavailable,
            format!(
                "this node started moments ago: nothing is deleted for another {} ms, until locks and holds \
                 granted before it started have lapsed; retry",
                self.grace_left_ms()
            ),
        )
    }

    fn gate(&self) -> Result<()> {
        match &self.lease {
            Some(l) if !l.held() => {
                Err(Error::new(ErrorKind::Unavailable, "this primary's election lease lapsed: it stands down"))
            }
            _ => Ok(()),
        }
    }

    pub fn registry(&self) -> &LocalRegistry {
        &self.reg
    }

    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn notify(&self, locs: &[Location]) {
        if let (Some(s), false) = (&self.sink, locs.is_empty()) {
            s.freed(locs);
        }
    }

    fn notify_ok(&self, out: &[Result<Location>]) {
        self.notify(&out.iter().filter_map(|r| r.as_ref().ok().copied()).collect::<Vec<_>>());
    }

    /// The registry's dead-node cleanup, with notices for the freed pages.
    /// Returns the locks released and, for each reservation dropped, its
    /// location and deadline (registry ms): its writer may still copy into
    /// it until then.
    /// The node's registration ends with it.
    pub fn release_node(&self, node_bits: u32) -> (u64, Vec<(Location, u64)>) {
        let mut registered = self.registrations.write().unwrap();
        registered.remove(&node_bits);
        let (locks, dropped) = self.reg.release_node(node_bits);
        drop(registered);
        self.notify(&dropped.iter().map(|d| d.0).collect::<Vec<_>>());
        (locks, dropped)
    }

    /// Node `node_bits` joined with `instance`: ops made under it apply.
    pub fn register_node(&self, node_bits: u32, instance: u64) {
        self.registrations.write().unwrap().insert(node_bits, instance);
    }

    /// An op of `owner` made under `instance` may apply while the guard
    /// lives (`registrations`); instance 0: not a follower's (the
    /// primary's own sessions, a single node).
    fn registered(&self, owner: Session, instance: u64) -> Result<Option<RwLockReadGuard<'_, HashMap<u32, u64>>>> {
        if instance == 0 {
            return Ok(None);
        }
        let g = self.registrations.read().unwrap();
        match g.get(&owner.node_bits()) {
            Some(&i) if i == instance => Ok(Some(g)),
            // As for a batch of a node that must join again: the client may
            // retry once its node has.
            _ => Err(Error::new(
                ErrorKind::Unavailable,
                "the node's registration this op was made under has ended (declared dead, or joined again)",
            )),
        }
    }

    /// A reserve through the gate, if any: items in a region being (or
    /// already) taken back fail alone, the rest are recorded while the
    /// gate's guard is held.
    /// `instance`: the registration the reserve was made under, checked
    /// after the gate's wait, right before the reservations are recorded.
    async fn reserve_gated(&self, call: ReserveCall<'_>, instance: u64, judge: bool) -> Result<Reserved> {
        let reserve = |call| if judge { self.reserve_judged(call) } else { self.reserve_now(call) };
        let Some(gate) = self.gate.get() else {
            let _registered = self.registered(call.owner, instance)?;
            return Ok(reserve(call));
        };
        let locs: Vec<Location> = call.items.iter().map(|(_, l)| *l).collect();
        let (_guard, verdicts) = gate.admit(call.node, &locs).await?;
        let _registered = self.registered(call.owner, instance)?;
        if verdicts.iter().all(Option::is_none) {
            return Ok(reserve(call));
        }
        let mut call = call;
        let items = std::mem::take(&mut call.items);
        call.items = items.into_iter().zip(&verdicts).filter(|(_, v)| v.is_none()).map(|(i, _)| i).collect();
        let out = reserve(call);
        let (mut ids, mut seqs) = (out.ids.into_iter(), out.seqs.into_iter());
        let mut merged = Reserved { freed: out.freed, ..Reserved::default() };
        for v in verdicts {
            let (id, seq) = match v {
                Some(e) => (Err(e), 0),
                None => (ids.next().expect("one result per admitted item"), seqs.next().unwrap_or(0)),
            };
            merged.ids.push(id);
            merged.seqs.push(seq);
        }
        Ok(merged)
    }

    /// Hold the token ids a reserve's items came with for their commits'
    /// events, until the reservations' deadline (`events/sink.rs`).
    fn stage_tokens(&self, r: &pp::Reserve, ids: &[Result<crate::ids::ReservationId>]) {
        if r.hints.len() != r.keys.len() {
            return;
        }
        let Some(sink) = self.reg.events() else { return };
        let until = std::time::Instant::now() + std::time::Duration::from_millis(r.timeout_ms);
        for ((key, hint), id) in r.keys.iter().zip(&r.hints).zip(ids) {
            if id.is_ok() && !hint.token_ids.is_empty() {
                let parent = (!hint.parent_key.is_empty()).then(|| crate::events::hash::block_hash(&hint.parent_key));
                let tokens = crate::events::Tokens { ids: hint.token_ids.clone().into_boxed_slice(), parent };
                sink.stage(key, std::sync::Arc::new(tokens), until);
            }
        }
    }

    /// A reserve whose items admission judges first (a follower's): those
    /// present or declined fail alone, before anything is recorded or
    /// evicted for them.
    fn reserve_judged(&self, mut call: ReserveCall<'_>) -> Reserved {
        let mut run = Run::default();
        let verdicts: Vec<Admit> = call
            .items
            .chunks(REGISTRY_CHUNK)
            .flat_map(|c| {
                let judged: Vec<(&[u8], u64)> = c.iter().map(|(k, l)| (k.as_slice(), l.length)).collect();
                self.reg.admit_run(&judged, &mut run)
            })
            .collect();
        if verdicts.iter().all(|v| *v == Admit::Admitted) {
            return self.reserve_now(call);
        }
        let items = std::mem::take(&mut call.items);
        call.items = items.into_iter().zip(&verdicts).filter(|(_, v)| **v == Admit::Admitted).map(|(i, _)| i).collect();
        let out = self.reserve_now(call);
        let (mut ids, mut seqs) = (out.ids.into_iter(), out.seqs.into_iter());
        let mut merged = Reserved { freed: out.freed, ..Reserved::default() };
        for v in verdicts {
            let (id, seq) = match v {
                Admit::Admitted => (ids.next().expect("one result per admitted item"), seqs.next().unwrap_or(0)),
                Admit::Present => {
                    (Err(Error::new(ErrorKind::AlreadyExists, "key is already stored or being written")), 0)
                }
                Admit::Refused => (Err(Error::not_admitted()), 0),
            };
            merged.ids.push(id);
            merged.seqs.push(seq);
        }
        merged
    }

    fn reserve_now(&self, call: ReserveCall<'_>) -> Reserved {
        let now = self.now_ms();
        let opts =
            ReserveOpts { deadline: now + call.timeout_ms, owner: call.owner, server_writes: call.server_writes };
        // A tenant at its quota makes room among its own entries first
        // (nothing committed goes during a new primary's grace period).
        let bytes = call.items.iter().map(|i| i.1.length).sum();
        let grace = self.in_grace();
        let mut freed = if grace { vec![] } else { self.reg.make_room(call.tenant, bytes, now) };
        let (mut ids, mut seqs) = (Vec::with_capacity(call.items.len()), Vec::with_capacity(call.items.len()));
        let mut items = call.items.into_iter().peekable();
        while items.peek().is_some() {
            let chunk: Vec<_> = items.by_ref().take(REGISTRY_CHUNK).collect();
            for r in self.reg.reserve_seq(call.tenant, chunk, opts) {
                seqs.push(r.as_ref().map_or(0, |x| x.1));
                ids.push(r.map(|x| x.0));
            }
        }
        if call.shortfall_pages > 0 && !grace {
            let (t, node, pages, size) = (Some(call.tenant), call.node, call.shortfall_pages, call.page_size);
            freed.extend(self.reg.evict_for_owner(t, node, pages, size, now, Some(call.owner)));
        }
        self.notify(&freed);
        Reserved { ids, seqs, freed }
    }

    fn delete_now(&self, keys: &[&[u8]], scope: &Scope) -> Result<Vec<Result<Location>>> {
        if self.in_grace() {
            return Err(self.grace_refusal());
        }
        let erase = |l: &Location| {
            if let Some(e) = &self.eraser {
                e.erase(l);
            }
        };
        let out = chunked(keys, |c| self.reg.delete_with(c, self.now_ms(), scope, &mut { erase }));
        self.notify_ok(&out);
        Ok(out)
    }
}

impl Answerer for LocalDirectory {
    fn reg(&self) -> &LocalRegistry {
        &self.reg
    }
    fn now_ms(&self) -> u64 {
        LocalDirectory::now_ms(self)
    }
    fn freed(&self, out: &[Result<Location>]) {
        self.notify_ok(out);
    }
    fn delete(&self, keys: &[&[u8]], scope: &Scope) -> Result<Vec<Result<Location>>> {
        self.delete_now(keys, scope)
    }
    fn evict_region(&self, owner: Session, e: &pp::EvictRegion) -> Freed {
        // A new primary's grace removes nothing committed; a follower's
        // request empties only its own regions (a client of this node's
        // carries no node bits).
        let from = owner.node_bits();
        if self.in_grace() || (from != 0 && from != e.node) {
            return vec![];
        }
        let regions: Vec<RegionId> = e.regions.iter().map(|&r| RegionId(r)).collect();
        let (t, node) = (Some(e.tenant.as_str()), NodeId(e.node));
        let freed = self.reg.evict_region(t, node, &regions, e.bytes, self.now_ms(), owner);
        self.notify(&freed);
        freed
    }
}

#[tonic::async_trait]
impl Directory for LocalDirectory {
    fn policy_name(&self) -> String {
        self.reg.policy_name().into()
    }

    fn is_local(&self) -> bool {
        true
    }
    fn rebinds(&self) -> bool {
        self.sink.is_none()
    }

    fn may_write(&self) -> bool {
        self.gate().is_ok()
    }

    async fn call(&self, op: pp::Op) -> Result<R> {
        let (owner, instance) = (Session(op.owner), op.instance);
        let scope = if op.scoped { Scope::tenants(op.scope_tenants) } else { Scope::All };
        let op = op.op.ok_or_else(|| Error::invalid("empty registry operation"))?;
        if !outlives_the_lease(&op) {
            self.gate()?;
        }
        let O::Reserve(r) = op else {
            // Applied whole while the registration stands (`registrations`).
            let _registered = self.registered(owner, instance)?;
            return answer(self, op, owner, &scope);
        };
        if r.keys.len() != r.locations.len() {
            return Err(Error::invalid("reserve: one location per key"));
        }
        let items = r.keys.iter().zip(&r.locations).map(|(k, l)| (k.to_vec(), from_peer(l))).collect();
        let call = ReserveCall {
            node: NodeId(r.node),
            tenant: &r.tenant,
            items,
            owner,
            server_writes: r.server_writes,
            timeout_ms: r.timeout_ms,
            shortfall_pages: r.shortfall_pages,
            page_size: r.page_size.max(1),
            hints: vec![],
        };
        let out = self.reserve_gated(call, instance, r.judge).await?;
        self.stage_tokens(&r, &out.ids);
        Ok(R::Reserve(pp::ReserveResult {
            statuses: out.ids.iter().map(status_of).collect(),
            ids: out.ids.iter().map(|r| r.as_ref().map_or(0, |id| id.0)).collect(),
            freed: out.freed.iter().map(to_peer).collect(),
            seqs: out.seqs,
        }))
    }

    async fn present(&self, keys: &[&[u8]]) -> Result<Vec<bool>> {
        self.gate()?;
        Ok(chunked(keys, |c| self.reg.present(c)))
    }

    async fn admit(&self, items: &[(&[u8], u64)]) -> Result<Vec<Admit>> {
        self.gate()?;
        let mut run = Run::default();
        Ok(items.chunks(REGISTRY_CHUNK).flat_map(|c| self.reg.admit_run(c, &mut run)).collect())
    }

    async fn evict(&self, node: NodeId, pages: u64, page_size: u64) -> Result<Freed> {
        self.gate()?;
        if self.in_grace() {
            return Ok(vec![]);
        }
        let freed = self.reg.evict(node, pages, page_size, self.now_ms());
        self.notify(&freed);
        Ok(freed)
    }

    async fn expire(&self) -> Result<Freed> {
        let freed = self.reg.expire(self.now_ms());
        self.notify(&freed);
        Ok(freed)
    }
}
