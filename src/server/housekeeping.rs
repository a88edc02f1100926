//! The periodic tick of a node being served: claim the next region before
//! the owned ones run out, reclaim expired reservations and locks (and, on
//! a follower, drop regions the table no longer gives it), and refresh the
//! gauges.
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Prometheus;
use crate::handler::Handler;
use crate::metrics::Metrics;

/// Every `every_ms` (at least 10) until `shutdown`.
pub(super) fn spawn(h: Arc<Handler>, m: Arc<Metrics>, p: Prometheus, every_ms: u64, shutdown: CancellationToken) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(every_ms.max(10)));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => {}
            }
            if let Err(e) = h.claim_ahead().await {
                tracing::warn!(error = %e, "claiming a region ahead of need failed");
            }
            match h.reap().await {
                Ok(0) => {}
                Ok(n) => tracing::info!(reclaimed = n, "expired reservations reclaimed"),
                Err(e) => tracing::debug!(error = %e, "housekeeping could not reach the registry"),
            }
            if let Ok(s) = h.stats().await {
                m.refresh(&s);
            }
            if let Some(p) = &p {
                p.run_upkeep();
            }
        }
    });
}
