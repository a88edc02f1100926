//! gRPC service: validates and translates requests, calls the handler, maps
//! errors to status codes, records metrics. No registry or pool logic here.
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

use crate::auth::scope_of;
use crate::conn::session_of;
use crate::error::{Error, ErrorKind, Result};
use crate::handler::Handler;
use crate::ids::ReservationId;
use crate::metrics::{KeyResult, Metrics};
use crate::proto::{self, cxlkv_server::Cxlkv};
use crate::registry::{Location, Scope, Session};
use crate::sessions::DurableSessions;

mod bulk;
mod inline;
mod replies;

use crate::registry::convert::{key_info_to_proto, removed_to_proto};
pub use crate::registry::convert::{key_status, tenant_usage, to_proto};

pub use crate::wire::INLINE_CHUNK;
use replies::event_source;
pub use replies::{pool_info, stats_reply};

/// Batches larger than this run on the blocking pool: their work (a few
/// milliseconds at most) must not hold a runtime worker, where it would
/// delay every other client's request queued behind it.
const BLOCKING_BATCH: usize = 256;

crate::metrics::label_enum! {
    /// The client API's RPC a request or key belongs to (the `op` label of
    /// its metrics, kept by position: `Metrics::new` is given `Op::ALL`'s
    /// labels).
    Op {
        PoolInfo => "pool_info",
        Reserve => "reserve",
        Commit => "commit",
        Abort => "abort",
        Lookup => "lookup_and_lock",
        Unlock => "unlock",
        Delete => "delete",
        Exists => "exists",
        ListKeys => "list_keys",
        Stats => "stats",
        InlinePut => "inline_put",
        InlineGet => "inline_get",
        Removed => "removed",
        WatchEvents => "watch_events",
    }
}

impl From<Op> for usize {
    fn from(op: Op) -> usize {
        op.index()
    }
}

#[derive(Clone)]
pub struct Service {
    handler: Arc<Handler>,
    metrics: Arc<Metrics>,
    role: Arc<crate::cluster::Role>,
    /// The election's backend and epoch this role was taken in.
    term: (&'static str, u64),
    /// InlineGet streams open at once (`[server] max_inline_streams`), and
    /// per connection.
    inline_streams: Arc<tokio::sync::Semaphore>,
    inline_per_conn: usize,
    /// This node's event stream, if `[events]` is on.
    events: Option<crate::events::Feed>,
    /// Sessions clients name, which outlive their connections.
    sessions: Arc<DurableSessions>,
    /// Token ids one Reserve item may carry (`[events] max_item_tokens`).
    max_item_tokens: usize,
    /// Where calls of more than `BLOCKING_BATCH` items run.
    bulk: Arc<bulk::BulkLane>,
}

impl Service {
    pub fn new(handler: Arc<Handler>, metrics: Arc<Metrics>) -> Self {
        // Unbounded until `with_inline_limits` (the server always sets them).
        Self {
            handler,
            metrics,
            role: Arc::new(crate::cluster::Role::Single),
            term: ("", 0),
            inline_streams: Arc::new(tokio::sync::Semaphore::new(tokio::sync::Semaphore::MAX_PERMITS)),
            inline_per_conn: usize::MAX,
            events: None,
            sessions: Arc::new(DurableSessions::new(1024, std::time::Duration::from_secs(600))),
            max_item_tokens: crate::events::config::EventsConfig::default().max_item_tokens,
            bulk: Arc::new(bulk::BulkLane::start(bulk::BULK_NICE).expect("start the bulk lane")),
        }
    }

    /// `[server] max_sessions` named sessions, each kept `linger` after its
    /// last connection closed.
    pub fn with_sessions(mut self, max: usize, linger: std::time::Duration) -> Self {
        self.sessions = Arc::new(DurableSessions::new(max, linger));
        self
    }

    pub fn sessions(&self) -> &Arc<DurableSessions> {
        &self.sessions
    }

    pub fn with_events(mut self, events: Option<crate::events::Feed>, max_item_tokens: usize) -> Self {
        self.events = events;
        self.max_item_tokens = max_item_tokens;
        self
    }

    /// A WatchEvents stream for a client of `scope` (its tenants' events).
    fn watch(
        &self,
        r: proto::WatchEventsRequest,
        scope: Scope,
        conn: Option<&crate::conn::ConnInfo>,
    ) -> Result<crate::events::watch::EventStream> {
        use crate::events::watch;
        let feed = self.events.as_ref().ok_or_else(|| {
            Error::new(ErrorKind::FailedPrecondition, "this node keeps no event stream ([events] enabled = false)")
        })?;
        let since = watch::start(&feed.log, r.epoch, r.since)?;
        let slot = feed.grpc.slot(conn.map(|c| c.state.event_streams.clone()))?;
        let keep = move |e: &crate::events::Event| e.tenant().is_none_or(|t| scope.allows(t));
        Ok(watch::stream(&feed.log, &feed.grpc, slot, since, keep, "grpc"))
    }

    /// `[server] max_inline_streams` and `max_inline_streams_per_connection`.
    pub fn with_inline_limits(mut self, total: usize, per_connection: usize) -> Self {
        self.inline_streams = Arc::new(tokio::sync::Semaphore::new(total));
        self.inline_per_conn = per_connection;
        self
    }

    /// A place for one more InlineGet stream of `conn`, or RESOURCE_EXHAUSTED.
    fn inline_slot(&self, conn: Option<&crate::conn::ConnInfo>) -> Result<inline::StreamSlot> {
        let busy = |what: String| Error::new(ErrorKind::ResourceExhausted, what);
        let permit = self.inline_streams.clone().try_acquire_owned().map_err(|_| {
            busy("too many InlineGet streams open on this sidecar (server.max_inline_streams); retry".into())
        })?;
        let conn = conn.map(|c| c.state.clone());
        if let Some(c) = &conn {
            if c.inline_streams.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= self.inline_per_conn {
                c.inline_streams.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                return Err(busy(format!(
                    "this connection has {} InlineGet streams open (server.max_inline_streams_per_connection): \
                     read them first",
                    self.inline_per_conn
                )));
            }
        }
        Ok(inline::StreamSlot { _permit: permit, conn })
    }

    /// The session a request acts for: the durable one it names, else its
    /// connection's.
    fn session<T>(&self, req: &Request<T>, scope: &Scope) -> Result<Session> {
        Ok(self.sessions.of_request(req, scope)?.unwrap_or_else(|| session_of(req)))
    }

    /// This node's place in a cluster (for Stats).
    pub fn with_term(mut self, backend: &'static str, epoch: u64) -> Self {
        self.term = (backend, epoch);
        self
    }

    pub fn with_role(mut self, role: Arc<crate::cluster::Role>) -> Self {
        self.role = role;
        self
    }

    /// Run `f` (in the bulk lane for a batch of more than `BLOCKING_BATCH`
    /// items), record the outcome, map the error to a status.
    async fn run<T, F, Fut>(
        &self,
        op: Op,
        items: usize,
        deadline: Option<std::time::Instant>,
        f: F,
    ) -> std::result::Result<Response<T>, Status>
    where
        T: Send + 'static,
        F: FnOnce(Service) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T>> + Send + 'static,
    {
        let t = Instant::now();
        let svc = self.clone();
        // Calls forwarded to a cluster's primary carry the client's deadline.
        let fut = crate::wire::deadline::DEADLINE.scope(deadline, f(svc));
        let r = if items > BLOCKING_BATCH { self.bulk.run(fut).await } else { fut.await };
        self.metrics.request(op, r.as_ref().map(|_| ()), t.elapsed().as_secs_f64());
        r.map(Response::new).map_err(Status::from)
    }

    /// Statuses of committed ids, counted; committed bytes counted.
    fn committed(&self, out: &[Result<Location>]) -> Vec<proto::KeyStatus> {
        let stored: u64 = out.iter().filter_map(|r| r.as_ref().ok()).map(|l| l.length).sum();
        self.metrics.bytes_committed.increment(stored);
        self.statuses(Op::Commit, out)
    }

    /// Per item, or with `runs` each stretch of items refused alike as one
    /// entry (`Reservation.repeat`); counted by outcome either way.
    fn reserve_reply(
        &self,
        rr: crate::handler::ReserveResult,
        expires_unix_ms: u64,
        runs: bool,
    ) -> proto::ReserveReply {
        let mut reservations = Vec::with_capacity(if runs { 1 } else { rr.results.len() });
        let mut results = rr.results.iter().peekable();
        while let Some(r) = results.next() {
            match r {
                Ok((id, loc)) => {
                    self.metrics.key(Op::Reserve, KeyResult::Ok, 1);
                    let (reservation_id, location) = (id.0, Some(to_proto(loc)));
                    reservations.push(proto::Reservation {
                        status: Some(Default::default()),
                        reservation_id,
                        location,
                        repeat: 0,
                    });
                }
                Err(e) => {
                    let mut repeat = 0u32;
                    while runs && results.next_if(|n| n.as_ref().is_err_and(|f| same_refusal(e, f))).is_some() {
                        repeat += 1;
                    }
                    self.metrics.key(Op::Reserve, KeyResult::of_error(e), 1 + repeat as u64);
                    reservations.push(proto::Reservation { status: Some(key_status(e)), repeat, ..Default::default() });
                }
            }
        }
        proto::ReserveReply { reservations, evicted: rr.evicted, expires_unix_ms, ..Default::default() }
    }

    /// Per-key statuses, counted by outcome.
    fn statuses<T>(&self, op: Op, out: &[Result<T>]) -> Vec<proto::KeyStatus> {
        out.iter()
            .map(|r| {
                let (kr, s) = match r {
                    Ok(_) => (KeyResult::Ok, proto::KeyStatus::default()),
                    Err(e) => (KeyResult::of_error(e), key_status(e)),
                };
                self.metrics.key(op, kr, 1);
                s
            })
            .collect()
    }
}

/// Refuse work the client stopped waiting for (see LookupRequest.deadline_unix_ms).
fn check_deadline(deadline_unix_ms: u64) -> Result<()> {
    if deadline_unix_ms != 0 && crate::platform::now_unix_ms() > deadline_unix_ms {
        return Err(Error::new(ErrorKind::DeadlineExceeded, "the client's deadline passed before processing"));
    }
    Ok(())
}

/// PermissionDenied unless `scope` covers `tenant` (a request-level tenant).
fn check_tenant(scope: &Scope, tenant: &str) -> Result<()> {
    if scope.allows(tenant) {
        return Ok(());
    }
    Err(Scope::denied(format_args!("tenant {tenant:?}")))
}

fn lookup_result(h: &Result<Option<Location>>) -> proto::LookupResult {
    match h {
        Ok(h) => proto::LookupResult { found: h.is_some(), location: h.as_ref().map(to_proto), status: None },
        Err(e) => proto::LookupResult { found: false, location: None, status: Some(key_status(e)) },
    }
}

/// The token ids a Reserve's items came with (none when no item has any):
/// INVALID_ARGUMENT past `max` ids for one item, or a parent key without ids.
fn token_hints(items: &[proto::ReserveItem], max: usize) -> Result<Vec<crate::peer_proto::TokenHint>> {
    if items.iter().all(|i| i.token_ids.is_empty() && i.parent_key.is_empty()) {
        return Ok(vec![]);
    }
    items
        .iter()
        .map(|i| {
            if i.token_ids.len() > max {
                return Err(Error::invalid(format!(
                    "an item carries {} token ids; at most {max} (events.max_item_tokens)",
                    i.token_ids.len()
                )));
            }
            if i.token_ids.is_empty() && !i.parent_key.is_empty() {
                return Err(Error::invalid("an item names a parent_key but carries no token ids"));
            }
            Ok(crate::peer_proto::TokenHint { token_ids: i.token_ids.clone(), parent_key: i.parent_key.clone() })
        })
        .collect()
}

/// A Reserve's items, from `items` or from the packed fields (the keys
/// sliced out of `packed_keys`, sharing its buffer; the caller checked
/// their count before any is made).
fn reserve_items(req: &mut proto::ReserveRequest) -> Result<Vec<(Bytes, u64)>> {
    let packed = !req.packed_keys.is_empty() || !req.key_lengths.is_empty() || !req.sizes.is_empty();
    if !packed {
        return Ok(std::mem::take(&mut req.items).into_iter().map(|i| (i.key, i.size)).collect());
    }
    let (n, keys, sizes) = (req.key_lengths.len(), &req.packed_keys, &req.sizes);
    if !req.items.is_empty() {
        return Err(Error::invalid("a Reserve carries items or packed keys, not both"));
    }
    if sizes.len() != 1 && sizes.len() != n {
        return Err(Error::invalid(format!("{} sizes for {n} packed keys: one per key, or one for all", sizes.len())));
    }
    let total: u64 = req.key_lengths.iter().map(|&l| u64::from(l)).sum();
    if total != keys.len() as u64 {
        return Err(Error::invalid(format!("key lengths add up to {total} bytes, packed_keys has {}", keys.len())));
    }
    let mut at = 0usize;
    Ok(req
        .key_lengths
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            let key = keys.slice(at..at + l as usize);
            at += l as usize;
            (key, sizes[if sizes.len() == 1 { 0 } else { i }])
        })
        .collect())
}

/// Two refusals a run may carry as one: the same code and message.
fn same_refusal(a: &Error, b: &Error) -> bool {
    a.kind() == b.kind() && a.message() == b.message()
}

/// Reservation ids are plain `u64`s on the wire and typed from here in.
fn reservation_ids(wire: &[u64]) -> Vec<ReservationId> {
    wire.iter().copied().map(ReservationId).collect()
}

type S<T> = std::result::Result<Response<T>, Status>;

#[tonic::async_trait]
impl Cxlkv for Service {
    async fn pool_info(&self, _: Request<proto::PoolInfoRequest>) -> S<proto::PoolInfoReply> {
        self.run(Op::PoolInfo, 0, None, |s| async move { Ok(pool_info(&s.handler)) }).await
    }

    async fn reserve(&self, req: Request<proto::ReserveRequest>) -> S<proto::ReserveReply> {
        let dl = crate::wire::deadline::of(&req);
        let scope = scope_of(&req);
        let session = self.session(&req, &scope);
        let judged = !crate::wire::admission_exempt(&req);
        let mut req = req.into_inner();
        let n_items = req.items.len().max(req.key_lengths.len());
        self.run(Op::Reserve, n_items + req.commit_first.len(), dl, move |s| async move {
            let session = session?;
            check_tenant(&scope, &req.tenant)?;
            check_deadline(req.deadline_unix_ms)?;
            let how = crate::handler::How { judged, evict: !req.no_evict };
            let hints = token_hints(&req.items, s.max_item_tokens)?;
            s.handler.check_batch(req.key_lengths.len())?;
            let items = reserve_items(&mut req)?;
            // Read before reserving: the registry's deadline is a little later.
            let expires_unix_ms = crate::platform::now_unix_ms() + s.handler.limits().reservation_timeout_ms;
            if req.commit_first.is_empty() {
                let rr = s.handler.reserve_with(&req.tenant, items, &hints, session, false, how).await?;
                return Ok(s.reserve_reply(rr, expires_unix_ms, req.runs));
            }
            let (ids, crcs) = (reservation_ids(&req.commit_first), &req.commit_first_crc32);
            let both = s.handler.commit_then_reserve((&ids, crcs), &req.tenant, items, &hints, session, how).await?;
            let (committed, removed_seq) = both.committed;
            let commit_statuses = s.committed(&committed);
            let mut reply = match both.reserved {
                Ok(rr) => s.reserve_reply(rr, expires_unix_ms, req.runs),
                // The commits are applied: their statuses must reach the client,
                // so the reserve's failure becomes every item's status.
                Err(e) => {
                    let results = (0..n_items).map(|_| Err(e.clone())).collect();
                    s.reserve_reply(crate::handler::ReserveResult { results, evicted: 0 }, 0, req.runs)
                }
            };
            reply.commit_statuses = commit_statuses;
            reply.commit_removed_seq = removed_seq;
            Ok(reply)
        })
        .await
    }

    async fn commit(&self, req: Request<proto::CommitRequest>) -> S<proto::CommitReply> {
        let dl = crate::wire::deadline::of(&req);
        let session = self.session(&req, &scope_of(&req));
        let req = req.into_inner();
        self.run(Op::Commit, req.reservation_ids.len(), dl, move |s| async move {
            let session = session?;
            let ids = reservation_ids(&req.reservation_ids);
            let (out, removed_seq) = s.handler.commit_keyed(&ids, &req.crc32, &req.keys, session).await?;
            Ok(proto::CommitReply { statuses: s.committed(&out), removed_seq })
        })
        .await
    }

    async fn abort(&self, req: Request<proto::AbortRequest>) -> S<proto::AbortReply> {
        let dl = crate::wire::deadline::of(&req);
        let session = self.session(&req, &scope_of(&req));
        let req = req.into_inner();
        self.run(Op::Abort, req.reservation_ids.len(), dl, move |s| async move {
            let session = session?;
            let out = s.handler.abort(&reservation_ids(&req.reservation_ids), session).await?;
            Ok(proto::AbortReply { statuses: s.statuses(Op::Abort, &out) })
        })
        .await
    }

    async fn lookup_and_lock(&self, req: Request<proto::LookupRequest>) -> S<proto::LookupReply> {
        let dl = crate::wire::deadline::of(&req);
        let scope = scope_of(&req);
        let session = self.session(&req, &scope);
        let req = req.into_inner();
        self.run(Op::Lookup, req.keys.len() + req.unlock_first.len(), dl, move |s| async move {
            let session = session?;
            check_deadline(req.deadline_unix_ms)?;
            let ttl_ms = req.lock_ttl_ms as u64;
            let (unlocked, hits, ttl) =
                s.handler.unlock_then_lookup(&req.unlock_first, &req.keys, ttl_ms, session, &scope).await?;
            let unlock_statuses = s.statuses(Op::Unlock, &unlocked);
            let n_hit = hits.iter().filter(|h| matches!(h, Ok(Some(_)))).count() as u64;
            let n_denied = hits.iter().filter(|h| h.is_err()).count() as u64;
            s.metrics.key(Op::Lookup, KeyResult::Hit, n_hit);
            s.metrics.key(Op::Lookup, KeyResult::Denied, n_denied);
            s.metrics.key(Op::Lookup, KeyResult::Miss, hits.len() as u64 - n_hit - n_denied);
            s.metrics.bytes_loaded.increment(hits.iter().flatten().flatten().map(|l| l.length).sum());
            let node = s.handler.node();
            let foreign = hits.iter().flatten().flatten().filter(|l| l.node != node).count() as u64;
            if foreign > 0 {
                s.metrics.cross_node_hits(foreign);
            }
            let results = hits.iter().map(lookup_result).collect();
            Ok(proto::LookupReply {
                results,
                lock_expires_unix_ms: crate::platform::now_unix_ms() + ttl,
                unlock_statuses,
                instance_id: s.handler.instance_id(),
            })
        })
        .await
    }

    async fn unlock(&self, req: Request<proto::UnlockRequest>) -> S<proto::UnlockReply> {
        let dl = crate::wire::deadline::of(&req);
        let session = self.session(&req, &scope_of(&req));
        let req = req.into_inner();
        self.run(Op::Unlock, req.keys.len(), dl, move |s| async move {
            let session = session?;
            let out = s.handler.unlock(&req.keys, session).await?;
            Ok(proto::UnlockReply { statuses: s.statuses(Op::Unlock, &out) })
        })
        .await
    }

    async fn delete(&self, req: Request<proto::DeleteRequest>) -> S<proto::DeleteReply> {
        let dl = crate::wire::deadline::of(&req);
        let scope = scope_of(&req);
        let req = req.into_inner();
        self.run(Op::Delete, req.keys.len(), dl, move |s| async move {
            let out = s.handler.delete_in(&req.keys, &scope).await?;
            let sizes = out.iter().map(|r| r.as_ref().map(|l| l.length).unwrap_or(0)).collect();
            Ok(proto::DeleteReply { statuses: s.statuses(Op::Delete, &out), sizes })
        })
        .await
    }

    async fn exists(&self, req: Request<proto::ExistsRequest>) -> S<proto::ExistsReply> {
        let dl = crate::wire::deadline::of(&req);
        let scope = scope_of(&req);
        let req = req.into_inner();
        self.run(Op::Exists, req.keys.len(), dl, move |s| async move {
            let exists = s.handler.exists(&req.keys, &scope).await?;
            let hits = exists.iter().filter(|e| **e).count() as u64;
            s.metrics.key(Op::Exists, KeyResult::Hit, hits);
            s.metrics.key(Op::Exists, KeyResult::Miss, exists.len() as u64 - hits);
            Ok(proto::ExistsReply { exists })
        })
        .await
    }

    async fn list_keys(&self, req: Request<proto::ListKeysRequest>) -> S<proto::ListKeysReply> {
        let dl = crate::wire::deadline::of(&req);
        let scope = scope_of(&req);
        let req = req.into_inner();
        self.run(Op::ListKeys, req.page_size as usize, dl, move |s| async move {
            let tenant = (!req.tenant.is_empty()).then_some(req.tenant.as_str());
            let (keys, next_cursor) = s.handler.list(req.cursor, req.page_size, tenant, &scope).await?;
            let keys = keys.into_iter().map(key_info_to_proto).collect();
            Ok(proto::ListKeysReply { keys, next_cursor })
        })
        .await
    }

    async fn stats(&self, req: Request<proto::StatsRequest>) -> S<proto::StatsReply> {
        let dl = crate::wire::deadline::of(&req);
        let scope = scope_of(&req);
        self.run(Op::Stats, 0, dl, move |s| async move {
            let mut r = stats_reply(&s.handler, &scope).await?;
            r.cluster_role = s.role.name().into();
            if !matches!(*s.role, crate::cluster::Role::Single) {
                (r.election, r.epoch) = (s.term.0.into(), s.term.1);
            }
            r.cluster_nodes = s.role.nodes(&s.handler).await;
            r.events = s.events.as_ref().map(event_source);
            Ok(r)
        })
        .await
    }

    async fn removed(&self, req: Request<proto::RemovedRequest>) -> S<proto::RemovedReply> {
        let dl = crate::wire::deadline::of(&req);
        let scope = scope_of(&req);
        let req = req.into_inner();
        self.run(Op::Removed, req.max as usize, dl, move |s| async move {
            let (events, next, truncated) = s.handler.removed_since(req.since, req.max).await?;
            // Another tenant's removals are left out; `next` still moves past them.
            let keys = events.into_iter().filter(|e| scope.allows(&e.tenant)).map(removed_to_proto).collect();
            Ok(proto::RemovedReply { keys, next, truncated, instance_id: s.handler.instance_id() })
        })
        .await
    }

    async fn inline_put(&self, req: Request<Streaming<proto::InlinePutChunk>>) -> S<proto::InlinePutReply> {
        let t = Instant::now();
        let scope = scope_of(&req);
        let r = self.inline_put_inner(req.into_inner(), &scope).await;
        self.metrics.request(Op::InlinePut, r.as_ref().map(|_| ()), t.elapsed().as_secs_f64());
        r.map(Response::new).map_err(Status::from)
    }

    type InlineGetStream = inline::GetStream;

    async fn inline_get(&self, req: Request<proto::InlineGetRequest>) -> S<Self::InlineGetStream> {
        let scope = scope_of(&req);
        let t = Instant::now();
        let slot = self
            .inline_slot(crate::conn::conn_of(&req))
            .inspect_err(|e| self.metrics.request(Op::InlineGet, Err(e), t.elapsed().as_secs_f64()))?;
        let key = req.into_inner().key;
        // One chunk waits here at most: a reader that does not read costs a
        // few chunks, not the whole object.
        let (tx, rx) = mpsc::channel(1);
        // A key of a tenant outside the client's scope: PERMISSION_DENIED, nothing locked.
        let hit = self
            .handler
            .unlock_then_lookup(&[], &[&key], 0, Session::LOCAL, &scope)
            .await
            .and_then(|(_, mut hits, _)| hits.remove(0))
            .inspect_err(|e| self.metrics.request(Op::InlineGet, Err(e), t.elapsed().as_secs_f64()))?;
        tokio::spawn(inline::serve_get(self.handler.clone(), self.metrics.clone(), tx, key, hit, t));
        Ok(Response::new(inline::GetStream::new(rx, slot)))
    }

    type WatchEventsStream = crate::events::watch::EventStream;

    async fn watch_events(&self, req: Request<proto::WatchEventsRequest>) -> S<Self::WatchEventsStream> {
        let (t, scope) = (Instant::now(), scope_of(&req));
        let conn = crate::conn::conn_of(&req).cloned();
        let opened = self.watch(req.into_inner(), scope, conn.as_ref());
        self.metrics.request(Op::WatchEvents, opened.as_ref().map(|_| ()), t.elapsed().as_secs_f64());
        Ok(Response::new(opened?))
    }
}

#[cfg(test)]
mod tests {
    use super::Op;

    #[test]
    fn op_labels_are_the_client_apis_rpcs_by_position() {
        assert_eq!(Op::ALL.len(), 14);
        for (i, op) in Op::ALL.into_iter().enumerate() {
            assert_eq!(usize::from(op), i);
        }
    }
}
