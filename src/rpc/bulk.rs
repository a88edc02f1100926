//! The lane for large batches: a call of more than `BLOCKING_BATCH` items
//! runs on threads of its own, a few nice steps below the runtime that
//! serves every other call. A client sending batches of thousands of keys
//! (a storm of Reserves that cannot be placed, a bulk Delete) then takes
//! the CPU a small call needs only when nothing else wants it: where every
//! CPU is busy, the scheduler runs the small call first.
//!
//! The threads are a second runtime's blocking pool (grown on demand, as
//! the main one's, so a large call that waits — forwarded to a cluster's
//! primary — never holds up the next); the call's future still runs with
//! the main runtime's handle, where its timers, sockets and channels live.

use std::future::Future;

use crate::error::{Error, ErrorKind, Result};

/// Nice steps below the process: as the event batcher's (docs/EVENTS.md,
/// "Memory and CPU"): low enough that a small call waking on a busy CPU
/// runs first, high enough that the large ones still get about a quarter of
/// a CPU that small calls keep busy.
pub const BULK_NICE: i32 = 5;

pub struct BulkLane {
    rt: Option<tokio::runtime::Runtime>,
}

impl BulkLane {
    /// The lane's runtime; its threads lower their own priority by `nice`
    /// steps when they start (failing that, they run at the process's).
    pub fn start(nice: i32) -> std::io::Result<Self> {
        // At most as many threads as the main runtime's blocking pool had
        // for the same calls (tokio's default); each large call holds one
        // while it runs, and the connections and streams that may carry
        // such calls are bounded before they get here.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(512)
            .thread_name("cxlkv-bulk")
            .on_thread_start(move || {
                let _ = crate::platform::lower_thread_priority(nice);
            })
            .build()?;
        Ok(Self { rt: Some(rt) })
    }

    /// Run `fut` to its end on one of the lane's threads.
    pub async fn run<T, Fut>(&self, fut: Fut) -> Result<T>
    where
        T: Send + 'static,
        Fut: Future<Output = Result<T>> + Send + 'static,
    {
        let main = tokio::runtime::Handle::current();
        let rt = self.rt.as_ref().expect("the lane runs until dropped");
        rt.spawn_blocking(move || main.block_on(fut))
            .await
            .unwrap_or_else(|e| Err(Error::new(ErrorKind::Internal, format!("request task failed: {e}"))))
    }
}

impl Drop for BulkLane {
    /// Dropped from inside the main runtime: a runtime may not be dropped
    /// there in the ordinary way, which waits for its threads.
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nice_of_this_thread() -> i64 {
        // Field 19 of /proc/thread-self/stat, after the command's ")".
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        rest.split(' ').nth(16).unwrap().parse().unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_on_the_lane_runs_below_the_runtimes_priority_with_the_main_runtimes_handle() {
        let lane = BulkLane::start(BULK_NICE).unwrap();
        let here = nice_of_this_thread();
        let (there, name, timer) = lane
            .run(async {
                // A timer of the main runtime: its handle is the one entered.
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                let name = std::thread::current().name().map(str::to_owned);
                Ok((nice_of_this_thread(), name, true))
            })
            .await
            .unwrap();
        assert_eq!(there, (here + BULK_NICE as i64).min(19), "the lane's thread is {BULK_NICE} steps below");
        assert_eq!(name.as_deref(), Some("cxlkv-bulk"));
        assert!(timer);
        assert_eq!(nice_of_this_thread(), here, "the caller's thread keeps its priority");
        drop(lane); // inside a runtime: must not panic
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_that_waits_does_not_hold_up_the_next() {
        let lane = std::sync::Arc::new(BulkLane::start(BULK_NICE).unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let l = lane.clone();
        let waiting =
            tokio::spawn(async move { l.run(async move { rx.await.map_err(|_| Error::invalid("gone")) }).await });
        // The lane's first thread is waiting on `rx`: another call still ends.
        let n = tokio::time::timeout(std::time::Duration::from_secs(10), lane.run(async { Ok(7) })).await;
        assert_eq!(n.expect("a second call ran while the first waited").unwrap(), 7);
        tx.send(()).unwrap();
        waiting.await.unwrap().unwrap();
    }
}
