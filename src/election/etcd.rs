//! `etcd`: every node campaigns on one election name with a lease of
//! `lease_ms` (rounded up to whole seconds, at least 2: etcd's floor);
//! the winner is the primary until its lease lapses. The epoch is the
//! create revision of the leader's key, which etcd makes larger for every
//! later candidate. The local lease is renewed from the *send* time of each
//! acknowledged keepalive and lasts 2/3 of etcd's TTL, so the primary stops
//! acting as one before etcd can expire its key and elect another.
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use super::{decode, encode, Election, Leader, Leadership};
use crate::cluster::config::ClusterConfig;
use crate::error::{Error, ErrorKind, Result};
use crate::etcd_proto::etcdserverpb::{lease_client::LeaseClient, *};
use crate::etcd_proto::v3electionpb::{election_client::ElectionClient, *};
use crate::registry::directory::Fence;

pub struct Etcd {
    endpoints: Vec<String>,
    name: String,
    me: Leader,
    ttl_s: i64,
}

impl Etcd {
    pub fn new(c: &ClusterConfig) -> Result<Self> {
        if c.etcd_endpoints.is_empty() {
            return Err(Error::invalid("cluster.election = \"etcd\" needs cluster.etcd_endpoints"));
        }
        Ok(Self {
            endpoints: c.etcd_endpoints.clone(),
            name: c.election_name.clone(),
            me: Leader { name: c.node_name.clone(), peer_addr: c.peer_addr.clone() },
            ttl_s: (c.lease_ms.div_ceil(1000) as i64).max(2),
        })
    }

    /// The first endpoint that answers.
    async fn connect(&self) -> Result<Channel> {
        let mut last = String::new();
        for e in &self.endpoints {
            let url = if e.contains("://") { e.clone() } else { format!("http://{e}") };
            let ep = Endpoint::from_shared(url)
                .map_err(|err| Error::invalid(format!("bad etcd endpoint {e:?}: {err}")))?
                .connect_timeout(Duration::from_secs(2))
                // etcd refuses pings more often than every 5 s; the lease's
                // own keepalives show a dead connection sooner anyway.
                .tcp_nodelay(true);
            match ep.connect().await {
                Ok(c) => return Ok(c),
                Err(err) => last = format!("{e}: {err}"),
            }
        }
        Err(Error::new(ErrorKind::Unavailable, format!("no etcd endpoint answers ({last})")))
    }

    /// One lease: campaign, observe, keep alive, until an error or shutdown.
    async fn term(&self, tx: &watch::Sender<Leadership>, lease: &Fence, shutdown: &CancellationToken) -> Result<()> {
        let channel = self.connect().await?;
        let ec = ElectionClient::new(channel.clone());
        let (mut ka, mut acks) = Keepalive::grant(channel, self.ttl_s).await?;
        let (mut observed, _stop_observer) = observe(ec.clone(), self.name.clone());
        let mut cc = ec;
        let req = CampaignRequest {
            name: self.name.clone().into(),
            lease: ka.id,
            value: encode(&self.me.name, &self.me.peer_addr).into(),
        };
        let mut campaign = Box::pin(async move { cc.campaign(req).await });
        let mut won = false;
        let mut tick = tokio::time::interval(Duration::from_millis(self.ttl_s as u64 * 1000 / 4));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => {
                    // Step down at once rather than at the lease's end.
                    ka.revoke().await;
                    return Ok(());
                }
                r = &mut campaign, if !won => {
                    let epoch = r.map_err(unavailable)?.into_inner().leader.map_or(0, |l| l.rev) as u64;
                    won = true;
                    lease.renew_at(ka.last_sent());
                    self.elected(tx, epoch);
                }
                _ = tick.tick() => ka.send().await?,
                m = acks.message() => {
                    let at = ka.acked(m.map_err(unavailable)?)?;
                    if let (true, Some(at)) = (won, at) {
                        lease.renew_at(at);
                    }
                }
                o = observed.recv() => {
                    let o = o.ok_or_else(|| Error::new(ErrorKind::Unavailable, "etcd: observe stream ended"))??;
                    self.observed(tx, won, o);
                }
            }
            if won && !lease.held() {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    "the etcd lease was not renewed in time: standing down",
                ));
            }
        }
    }

    fn elected(&self, tx: &watch::Sender<Leadership>, epoch: u64) {
        metrics::counter!(crate::metric_names::CLUSTER_ELECTIONS_WON).increment(1);
        tracing::warn!(epoch, "elected primary");
        tx.send_replace(Leadership { leader: Some(self.me.clone()), epoch, i_lead: true });
    }

    /// The election's leader key as etcd reports it (it may be another
    /// node's, or this node's own once its campaign returned).
    fn observed(&self, tx: &watch::Sender<Leadership>, won: bool, o: LeaderResponse) {
        if let Some(kv) = o.kv {
            let leader = std::str::from_utf8(&kv.value).ok().and_then(decode);
            let i_lead = won && leader.as_ref() == Some(&self.me);
            let l = Leadership { leader, epoch: kv.create_revision as u64, i_lead };
            tx.send_if_modified(|cur| {
                if *cur != l {
                    *cur = l;
                    true
                } else {
                    false
                }
            });
        }
    }
}

fn unavailable(e: tonic::Status) -> Error {
    Error::new(ErrorKind::Unavailable, format!("etcd: {}", e.message()))
}

/// A term's etcd lease and the sending half of its keepalive stream.
struct Keepalive {
    client: LeaseClient<Channel>,
    id: i64,
    keeper: mpsc::Sender<LeaseKeepAliveRequest>,
    /// Send times of the keepalives not yet acknowledged, oldest first: an
    /// acknowledgement renews the local lease from when its request left.
    sent: VecDeque<Instant>,
}

impl Keepalive {
    /// Grant a lease of `ttl_s` and open its keepalive stream (returned
    /// apart, so a `select!` can wait on it while keepalives are sent).
    async fn grant(channel: Channel, ttl_s: i64) -> Result<(Self, tonic::Streaming<LeaseKeepAliveResponse>)> {
        let mut client = LeaseClient::new(channel);
        let id = client.lease_grant(bounded(LeaseGrantRequest { ttl: ttl_s, id: 0 })).await.map_err(unavailable)?;
        let id = id.into_inner().id;
        // etcd answers a stream's headers with its first message: the first
        // keepalive goes in before the call.
        let (keeper, rx) = mpsc::channel(4);
        keeper.send(LeaseKeepAliveRequest { id }).await.expect("receiver held");
        let acks = client.lease_keep_alive(ReceiverStream::new(rx)).await.map_err(unavailable)?.into_inner();
        Ok((Self { client, id, keeper, sent: VecDeque::from([Instant::now()]) }, acks))
    }

    async fn send(&mut self) -> Result<()> {
        self.sent.push_back(Instant::now());
        self.keeper
            .send(LeaseKeepAliveRequest { id: self.id })
            .await
            .map_err(|_| Error::new(ErrorKind::Unavailable, "etcd: keepalive stream closed"))
    }

    fn last_sent(&self) -> Instant {
        self.sent.back().copied().unwrap_or_else(Instant::now)
    }

    /// An acknowledgement arrived: the send time of the keepalive it
    /// answers. A lease etcd reports expired ends the term.
    fn acked(&mut self, m: Option<LeaseKeepAliveResponse>) -> Result<Option<Instant>> {
        let m = m.ok_or_else(|| Error::new(ErrorKind::Unavailable, "etcd: keepalive stream ended"))?;
        let at = self.sent.pop_front();
        if m.ttl <= 0 {
            return Err(Error::new(ErrorKind::Unavailable, "etcd: the lease expired"));
        }
        Ok(at)
    }

    async fn revoke(&mut self) {
        let _ = self.client.lease_revoke(bounded(LeaseRevokeRequest { id: self.id })).await;
    }
}

/// Watch the election's leader on a task of its own (etcd's observe waits
/// for a leader before it answers at all); stopped when the guard drops.
fn observe(mut ec: ElectionClient<Channel>, name: String) -> (mpsc::Receiver<Result<LeaderResponse>>, AbortOnDrop) {
    let (otx, observed) = mpsc::channel(4);
    let task = tokio::spawn(async move {
        let r = async {
            let mut s = ec.observe(LeaderRequest { name: name.into() }).await?.into_inner();
            while let Some(m) = s.message().await? {
                if otx.send(Ok(m)).await.is_err() {
                    return Ok(());
                }
            }
            Err(tonic::Status::unavailable("observe stream ended"))
        };
        if let Err(e) = r.await {
            let _ = otx.send(Err(unavailable(e))).await;
        }
    });
    (observed, AbortOnDrop(task))
}

#[tonic::async_trait]
impl Election for Etcd {
    fn backend(&self) -> &'static str {
        "etcd"
    }

    async fn run(self: Box<Self>, tx: watch::Sender<Leadership>, lease: Arc<Fence>, shutdown: CancellationToken) {
        loop {
            if let Err(e) = self.term(&tx, &lease, &shutdown).await {
                tracing::warn!(error = %e, "election: lost or could not reach etcd");
            }
            // Whatever happened, this node does not lead any more.
            lease.expire();
            tx.send_if_modified(|cur| std::mem::replace(&mut cur.i_lead, false));
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(300)) => {}
            }
        }
    }
}

/// A unary etcd call that must not wait for ever.
fn bounded<T>(m: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(m);
    r.set_timeout(Duration::from_secs(2));
    r
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
