//! A follower's copy of the pool's event stream: one peer `WatchEvents`
//! stream from the primary, its batches added to this node's relay log as
//! the primary numbered them, so a subscriber of any node follows the whole
//! pool. A broken stream resumes after the last batch held; one the primary
//! no longer holds (or of an epoch that ended) starts again from the
//! primary's oldest, and this node's subscribers see the jump.
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::epoch::Client;
use crate::error::{Error, ErrorKind, Result};
use crate::events::{watch, EventLog};
use crate::proto::WatchEventsRequest;

/// Relay the primary's stream into `log` until `shutdown` (then its
/// subscribers' streams end).
pub fn spawn(client: Client, log: Arc<EventLog>, shutdown: CancellationToken) {
    tokio::spawn(async move {
        let mut from_oldest = true;
        loop {
            let req = if from_oldest {
                WatchEventsRequest::default()
            } else {
                WatchEventsRequest { epoch: log.epoch(), since: log.next_seq() }
            };
            let r = tokio::select! {
                _ = shutdown.cancelled() => break,
                r = relay(client.clone(), &log, req) => r,
            };
            // Only a stream that cannot resume starts from the oldest again.
            from_oldest = matches!(&r, Err(e) if e.kind() == ErrorKind::OutOfRange);
            if let Err(e) = r {
                tracing::debug!(error = %e, "the primary's event stream broke; subscribing again");
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
        log.close();
    });
}

/// Add the batches of one peer stream to `log`, until it ends.
async fn relay(mut client: Client, log: &EventLog, req: WatchEventsRequest) -> Result<()> {
    let mut stream = client.watch_events(req).await.map_err(Error::from)?.into_inner();
    while let Some(b) = stream.message().await.map_err(Error::from)? {
        let events = b.events.into_iter().map(watch::event_from_proto).collect::<Result<Vec<_>>>()?;
        log.accept(b.epoch, b.seq, b.ts_unix_ms, events);
    }
    Ok(())
}
