//! When a follower stops waiting for a forwarded batch, in the primary's
//! clock: a batch that reaches the primary after that (the primary was
//! stopped, or starved, while the batch sat in its socket) is applied to
//! nobody's benefit, and a lookup in it would leave the node a lock its
//! holds table never learns of, in force for its whole TTL. So the primary
//! refuses each op of a batch past that moment, applying nothing.
//!
//! Hosts' clocks are not compared: each heartbeat carries the follower's
//! monotonic clock, and the primary keeps the smallest difference between
//! its own clock at arrival and that reading over recent heartbeats. That
//! difference is the clocks' offset plus the fastest heartbeat's transit,
//! never less than the offset, so the moment computed from it is never
//! earlier than the follower's own: a batch the follower still waits for is
//! never refused. (Drift between the clocks over the window, ~100 ppm of a
//! few seconds, is far below the margin a call's timeout leaves.)
use std::collections::VecDeque;
use std::sync::OnceLock;
use std::time::Instant;

/// Heartbeats whose readings are kept: a few seconds' worth.
const SAMPLES: usize = 32;

/// This process's monotonic clock in ms (the same reading for heartbeats,
/// forwarded batches and the primary's checks).
pub fn local_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    // Starts at 1: 0 on the wire means "no reading" (an older follower).
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// What the primary knows of one follower's clock.
#[derive(Debug, Clone, Default)]
pub struct PeerClock {
    /// Primary clock at arrival minus the follower's reading, per heartbeat.
    samples: VecDeque<i64>,
}

impl PeerClock {
    /// A heartbeat that left the follower at `theirs` (its clock) arrived
    /// at `ours` (this process's). A reading of 0 is none.
    pub fn heard(&mut self, theirs: u64, ours: u64) {
        if theirs == 0 {
            return;
        }
        if self.samples.len() == SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back(ours as i64 - theirs as i64);
    }

    /// The moment, in this process's clock, after which the follower no
    /// longer waits for a batch it sent at `sent` (its clock) and waits
    /// `wait_ms` for; None while nothing is known (no heartbeat yet since
    /// it joined, or a batch without a reading): such a batch is applied.
    pub fn gives_up_at(&self, sent: u64, wait_ms: u64) -> Option<u64> {
        let offset = *self.samples.iter().min()?;
        if sent == 0 || wait_ms == 0 {
            return None;
        }
        Some((sent as i64 + offset).max(0) as u64 + wait_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_moment_a_follower_gives_up_is_never_earlier_than_its_own() {
        // The follower's clock reads 1,000 when the primary's reads 51,000.
        let offset = 50_000;
        let mut c = PeerClock::default();
        assert_eq!(c.gives_up_at(2_000, 1_000), None, "no heartbeat yet: applied");
        // Heartbeats in transit 7, 3 and 12 ms: the fastest bounds the offset.
        for (sent, transit) in [(1_000, 7), (1_100, 3), (1_200, 12)] {
            c.heard(sent, sent + offset + transit);
        }
        let at = c.gives_up_at(2_000, 1_000).unwrap();
        assert_eq!(at, 2_000 + offset + 3 + 1_000);
        assert!(at >= 2_000 + offset + 1_000, "never before the follower itself gives up");
        assert_eq!(c.gives_up_at(0, 1_000), None, "a batch without a reading is applied");
        c.heard(0, 99_999);
        assert_eq!(c.gives_up_at(2_000, 1_000), Some(at), "a heartbeat without a reading changes nothing");
    }

    #[test]
    fn only_recent_heartbeats_count() {
        let mut c = PeerClock::default();
        c.heard(1_000, 1_000); // offset 0, then SAMPLES readings at offset 10
        for i in 0..SAMPLES as u64 {
            c.heard(2_000 + i, 2_010 + i);
        }
        assert_eq!(c.gives_up_at(5_000, 100), Some(5_110));
    }
}
