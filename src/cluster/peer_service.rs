//! The peer service the primary serves (`proto/peer.proto`): each RPC
//! handed to `Primary`, forwarded batches op by op.
use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::clock::local_ms;
use super::primary::Primary;
use crate::handler::Handler;
use crate::peer_proto::{self as pp, op_result::Result as R, peer_server::Peer};

type S<T> = std::result::Result<Response<T>, Status>;

/// The peer service the primary serves.
pub struct PeerService {
    primary: Arc<Primary>,
    /// The primary's own handler (its regions, in the node list).
    handler: Arc<Handler>,
    /// The primary's node name.
    name: String,
    /// The pool's event stream, for followers to relay (none: `[events]` off).
    events: Option<Arc<crate::events::EventLog>>,
}

impl PeerService {
    pub fn new(
        primary: Arc<Primary>,
        handler: Arc<Handler>,
        name: String,
        events: Option<Arc<crate::events::EventLog>>,
    ) -> Self {
        Self { primary, handler, name, events }
    }

    /// The primary's node id.
    pub fn node(&self) -> crate::pool::NodeId {
        self.handler.node()
    }
}

#[tonic::async_trait]
impl Peer for PeerService {
    async fn join(&self, req: Request<pp::JoinRequest>) -> S<pp::JoinReply> {
        self.primary.join(req.into_inner()).map(Response::new).map_err(Status::from)
    }

    async fn heartbeat(&self, req: Request<pp::HeartbeatRequest>) -> S<pp::HeartbeatReply> {
        self.primary.heartbeat(req.into_inner()).map(Response::new).map_err(Status::from)
    }

    async fn claim_region(&self, req: Request<pp::ClaimRegionRequest>) -> S<pp::ClaimRegionReply> {
        self.primary.claim(req.into_inner()).await.map(Response::new).map_err(Status::from)
    }

    async fn batch(&self, req: Request<pp::BatchRequest>) -> S<pp::BatchReply> {
        let r = req.into_inner();
        self.primary.check(r.node, r.instance)?;
        let gives_up_at = self.primary.gives_up_at(r.node, r.sent_ms, r.wait_ms);
        let mut results = Vec::with_capacity(r.ops.len());
        for mut op in r.ops {
            // Applied only while the registration it was made under stands,
            // and only while the follower still waits for the answer.
            if op.instance == 0 {
                op.instance = r.instance;
            }
            let now = local_ms();
            let out = match gives_up_at.filter(|&at| now > at) {
                Some(at) => Err(stale(now - at)),
                None => self.primary.op(r.node, op).await,
            };
            let out = out.unwrap_or_else(|e| R::Error(crate::registry::convert::key_status(&e)));
            results.push(pp::OpResult { result: Some(out) });
        }
        Ok(Response::new(pp::BatchReply { results }))
    }

    async fn nodes(&self, _: Request<pp::NodesRequest>) -> S<pp::NodesReply> {
        Ok(Response::new(pp::NodesReply { nodes: self.primary.cluster_nodes(self.handler.regions(), &self.name) }))
    }

    type WatchEventsStream = crate::events::watch::EventStream;

    async fn watch_events(&self, req: Request<crate::proto::WatchEventsRequest>) -> S<Self::WatchEventsStream> {
        use crate::events::watch;
        let r = req.into_inner();
        let log =
            self.events.as_ref().ok_or_else(|| Status::failed_precondition("the primary keeps no event stream"))?;
        let since = watch::start(log, r.epoch, r.since)?;
        let streams = watch::Streams::unbounded(log.limits().batch_bytes);
        let slot = streams.slot(None)?;
        Ok(Response::new(watch::stream(log, &streams, slot, since, |_| true, "relay")))
    }
}

/// An op that reached the primary after its follower stopped waiting.
fn stale(late_ms: u64) -> crate::error::Error {
    metrics::counter!(crate::metric_names::CLUSTER_STALE_OPS).increment(1);
    crate::error::Error::new(
        crate::error::ErrorKind::DeadlineExceeded,
        format!("not applied: it reached the primary {late_ms} ms after the follower stopped waiting for it"),
    )
}
