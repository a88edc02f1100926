//! `static`: the primary is the node the config names (development, tests,
//! bare metal). Epoch 0 for ever: nothing is ever refused by epoch, and a
//! primary that dies stays the primary until it is back.
use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{Election, Leader, Leadership};
use crate::cluster::forward::Fence;
use crate::config::ClusterConfig;

pub struct Fixed(Leadership);

impl Fixed {
    pub fn new(c: &ClusterConfig) -> Self {
        let i_lead = c.is_primary();
        let peer_addr = if i_lead { c.peer_addr.clone() } else { c.primary_addr.clone() };
        Self(Leadership { leader: Some(Leader { name: c.primary.clone(), peer_addr }), epoch: 0, i_lead })
    }
}

#[tonic::async_trait]
impl Election for Fixed {
    fn backend(&self) -> &'static str {
        "static"
    }

    async fn run(self: Box<Self>, tx: watch::Sender<Leadership>, lease: Arc<Fence>, shutdown: CancellationToken) {
        let _ = tx.send(self.0);
        // Nobody can take the role away: the lease never runs out.
        loop {
            lease.renew();
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
            }
        }
    }
}
