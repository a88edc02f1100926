//! The one interface every event transport implements: started with the
//! node's log and `[events]`, it serves subscribers until shutdown, each
//! reading the log at its own pace within its own byte bounds, and says
//! where it serves (for `cxlkv status`). gRPC (`watch.rs`, served by the
//! client API's `WatchEvents`) and ZMQ in vLLM's format (`zmq.rs`) are the
//! two; a third is one new file implementing `Transport` and one line in
//! `TRANSPORTS` (`mod.rs`).
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::config::EventsConfig;
use super::EventLog;
use crate::error::Result;

#[tonic::async_trait]
pub trait Transport: Send + Sync {
    /// Its name (metrics' `transport` label, status).
    fn name(&self) -> &'static str;
    /// Serve `log` until `shutdown` if `cfg` turns it on (an error if it
    /// cannot start, e.g. an endpoint that cannot be bound); where it
    /// serves, empty when it is off.
    async fn start(&self, log: Arc<EventLog>, cfg: &EventsConfig, shutdown: CancellationToken) -> Result<Vec<String>>;
}

/// Start every transport on `log`: where each serves.
pub async fn start_all(log: &Arc<EventLog>, cfg: &EventsConfig, shutdown: &CancellationToken) -> Result<Vec<String>> {
    let mut on = vec![];
    for t in super::TRANSPORTS {
        on.extend(t.start(log.clone(), cfg, shutdown.clone()).await?.into_iter().map(|w| format!("{}: {w}", t.name())));
    }
    Ok(on)
}
