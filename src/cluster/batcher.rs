//! How a follower's registry calls reach the primary: coalesced into
//! batches, at most `MAX_IN_FLIGHT` of them on the wire at once.
//!
//! A call that finds a free slot sends its own one-op batch from its own
//! task (an idle node needs no queue and no sender task). A call that finds
//! every slot taken queues; whoever frees a slot takes the whole queue (up
//! to `MAX_OPS`) as the next batch and sends it from a spawned task, so a
//! busy node still sends at most one forwarded RPC per client RPC, and
//! usually far fewer.
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::epoch::unavailable;
use super::epoch::Ident;
use crate::error::Result;
use crate::peer_proto::{self as pp, op_result::Result as R};

/// Batches on the wire at once; more calls wait and are coalesced.
const MAX_IN_FLIGHT: usize = 2;
/// Most ops in one batch.
const MAX_OPS: usize = 512;
/// Forwarded batches whose latency `p50_us` looks at.
const LATENCY_WINDOW: usize = 256;

struct Job {
    op: pp::Op,
    reply: oneshot::Sender<Result<R>>,
    /// How long its caller waits (the client's deadline, capped).
    budget: Duration,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Batches on the wire. Jobs queue only while this is `MAX_IN_FLIGHT`,
    /// and a batch that ends takes the queue along, so no job waits behind
    /// a free slot.
    in_flight: usize,
}

pub struct Batcher {
    client: super::epoch::Client,
    ident: Arc<Ident>,
    queue: Mutex<Queue>,
    /// Microseconds of recent forwarded batches (for the p50 in status).
    latency: Mutex<VecDeque<u64>>,
    /// Batches and ops sent so far.
    sent: [AtomicU64; 2],
    /// Their metrics, resolved once (every forwarded batch records them).
    calls: metrics::Counter,
    ops: metrics::Counter,
    seconds: metrics::Histogram,
}

impl Batcher {
    pub fn new(client: super::epoch::Client, ident: Arc<Ident>) -> Arc<Self> {
        use crate::metric_names as n;
        Arc::new(Self {
            client,
            ident,
            queue: Mutex::default(),
            latency: Mutex::default(),
            sent: Default::default(),
            calls: metrics::counter!(n::CLUSTER_FORWARDED_CALLS),
            ops: metrics::counter!(n::CLUSTER_FORWARDED_OPS),
            seconds: metrics::histogram!(n::CLUSTER_FORWARDED_SECONDS),
        })
    }

    /// Forward one op and wait at most `budget` for its result.
    pub async fn call(self: &Arc<Self>, op: pp::Op, budget: Duration) -> Result<R> {
        let queued = {
            let mut q = self.queue.lock().unwrap();
            if q.in_flight < MAX_IN_FLIGHT {
                q.in_flight += 1;
                Err(op)
            } else {
                let (reply, rx) = oneshot::channel();
                q.jobs.push_back(Job { op, reply, budget });
                Ok(rx)
            }
        };
        match queued {
            Ok(rx) => tokio::time::timeout(budget, rx)
                .await
                .map_err(|_| unavailable("timed out"))?
                .map_err(|_| unavailable("the forwarder stopped"))?,
            Err(op) => {
                // A free slot: send it from here. The slot comes back (and
                // the queue moves on) however this ends, the caller giving
                // up included.
                let _slot = Slot(self.clone());
                let sent = tokio::time::timeout(budget, self.send(vec![op], budget)).await;
                sent.map_err(|_| unavailable("timed out"))?.pop().unwrap_or_else(|| Err(unavailable("no result")))
            }
        }
    }

    /// A slot was freed: hand it to the queued jobs, if any, as one batch.
    fn next(self: &Arc<Self>) {
        let mut q = self.queue.lock().unwrap();
        if q.jobs.is_empty() {
            q.in_flight -= 1;
            return;
        }
        // At most MAX_OPS ops and MAX_MESSAGE bytes: a batch the primary
        // accepts (one call alone may be a client's largest, and goes alone).
        let mut bytes = 0;
        let n = q
            .jobs
            .iter()
            .take(MAX_OPS)
            .position(|j| {
                bytes += prost::Message::encoded_len(&j.op);
                bytes > crate::wire::MAX_MESSAGE
            })
            .unwrap_or(q.jobs.len().min(MAX_OPS))
            .max(1);
        let jobs: Vec<Job> = q.jobs.drain(..n).collect();
        drop(q);
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return; // the runtime is gone: the callers were dropped with it
        };
        let me = self.clone();
        rt.spawn(async move {
            let _slot = Slot(me.clone());
            // The batch waits as long as its most patient caller; each caller
            // gives up at its own deadline.
            let timeout = jobs.iter().map(|j| j.budget).max().unwrap_or_default();
            let (replies, ops): (Vec<_>, Vec<_>) = jobs.into_iter().map(|j| (j.reply, j.op)).unzip();
            let results = match tokio::time::timeout(timeout, me.send(ops, timeout)).await {
                Ok(r) => r,
                Err(_) => replies.iter().map(|_| Err(unavailable("timed out"))).collect(),
            };
            for (reply, r) in replies.into_iter().zip(results) {
                let _ = reply.send(r);
            }
        });
    }

    /// One op in a batch of its own, at once: outside the queue, the
    /// forwarded-call figures and the latency `p50_us` reports (a node's
    /// reads of the pool's listing, figures or removal log, not a client's
    /// store or lookup).
    pub async fn alone(&self, op: pp::Op, timeout: Duration) -> Result<R> {
        let rep = self.request(vec![op], timeout).await.map_err(|s| unavailable(s.message()))?;
        match rep.into_inner().results.pop() {
            Some(pp::OpResult { result: Some(r) }) => Ok(r),
            _ => Err(unavailable("empty result")),
        }
    }

    async fn request(
        &self,
        ops: Vec<pp::Op>,
        timeout: Duration,
    ) -> std::result::Result<tonic::Response<pp::BatchReply>, tonic::Status> {
        let mut req = tonic::Request::new(pp::BatchRequest {
            node: self.ident.node.load(Ordering::Acquire) as u32,
            instance: self.ident.instance.load(Ordering::Acquire),
            ops,
            sent_ms: super::clock::local_ms(),
            wait_ms: timeout.as_millis() as u64,
        });
        req.set_timeout(timeout);
        self.client.clone().batch(req).await
    }

    /// One forwarded batch: a result per op, in order.
    async fn send(&self, ops: Vec<pp::Op>, timeout: Duration) -> Vec<Result<R>> {
        let n = ops.len();
        let t = Instant::now();
        let out = self.request(ops, timeout).await;
        self.sent[0].fetch_add(1, Ordering::Relaxed);
        self.sent[1].fetch_add(n as u64, Ordering::Relaxed);
        self.calls.increment(1);
        self.ops.increment(n as u64);
        match out {
            Ok(rep) if rep.get_ref().results.len() == n => {
                self.record(t.elapsed());
                rep.into_inner()
                    .results
                    .into_iter()
                    .map(|r| r.result.ok_or_else(|| unavailable("empty result")))
                    .collect()
            }
            Ok(_) => (0..n).map(|_| Err(unavailable("the primary answered a different number of ops"))).collect(),
            Err(s) => (0..n).map(|_| Err(unavailable(s.message()))).collect(),
        }
    }

    fn record(&self, took: Duration) {
        let us = took.as_micros() as u64;
        let mut l = self.latency.lock().unwrap();
        if l.len() >= LATENCY_WINDOW {
            l.pop_front();
        }
        l.push_back(us);
        self.seconds.record(us as f64 / 1e6);
    }

    /// Batches and ops forwarded so far.
    pub fn sent(&self) -> (u64, u64) {
        (self.sent[0].load(Ordering::Relaxed), self.sent[1].load(Ordering::Relaxed))
    }

    /// Median latency of recent forwarded batches, in µs.
    pub fn p50_us(&self) -> u64 {
        let mut v: Vec<u64> = self.latency.lock().unwrap().iter().copied().collect();
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    }
}

/// A batch's place on the wire, given back when dropped.
struct Slot(Arc<Batcher>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.next();
    }
}
