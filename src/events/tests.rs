use std::time::Duration;

use super::*;

fn log(ring: usize, buffer: usize) -> Arc<EventLog> {
    EventLog::new(Limits {
        batch_events: 2,
        batch_delay: Duration::from_millis(5),
        buffer_events: buffer,
        ring_batches: ring,
    })
}

fn stored(k: &str) -> Event {
    Event::Stored { key: k.as_bytes().into(), tenant: "t".into(), size: 1, node: NodeId(1), commit_seq: 1 }
}

fn seqs(b: &[Arc<Batch>]) -> Vec<u64> {
    b.iter().map(|b| b.seq).collect()
}

#[test]
fn events_are_batched_by_count_in_order_with_consecutive_sequences() {
    let l = log(16, 100);
    for k in ["a", "b", "c"] {
        l.sink().push(stored(k));
    }
    l.cut();
    let (b, oldest) = l.read(0, 10);
    let first = b[0].seq;
    assert_eq!((seqs(&b), oldest), (vec![first, first + 1, first + 2], first));
    // A source starts with "all cleared", then the events in push order.
    assert_eq!(b[0].events, vec![Event::AllCleared]);
    assert_eq!(b[1].events, vec![stored("a"), stored("b")]);
    assert_eq!(b[2].events, vec![stored("c")]);
    assert!(b.iter().all(|b| b.epoch == l.epoch()));
    assert_eq!(l.next_seq(), first + 3);
}

#[test]
fn a_new_sources_all_cleared_is_in_the_ring_before_any_batching() {
    // No cut, no batching task: a subscriber's replay from 0 right after
    // the node starts finds "all cleared" whatever ran first.
    let l = log(16, 100);
    let (b, oldest) = l.read(0, 10);
    assert_eq!(b.len(), 1);
    assert_eq!((b[0].events.clone(), b[0].seq, oldest), (vec![Event::AllCleared], oldest, oldest));
    assert_eq!(l.next_seq(), oldest + 1);
}

#[test]
fn an_overflowing_buffer_drops_events_and_the_sequence_shows_the_gap() {
    let l = log(16, 3); // three fit ("all cleared" is already a batch)
    let first = l.next_seq();
    for k in ["a", "b", "c", "d"] {
        l.sink().push(stored(k));
    }
    l.cut();
    let (b, _) = l.read(first, 10);
    assert_eq!(seqs(&b), vec![first + 1, first + 2], "the first sequence skipped: a subscriber sees the loss");
    assert_eq!(b.iter().map(|b| b.events.len()).sum::<usize>(), 3);
}

#[tokio::test]
async fn a_subscriber_that_falls_behind_the_ring_skips_ahead_and_sees_the_jump() {
    let l = log(2, 100);
    let f = l.next_seq();
    let mut s = l.subscribe(f, "test");
    for k in ["a", "b", "c", "d", "e", "f", "g"] {
        l.sink().push(stored(k));
    }
    l.cut(); // batches f..=f+3; the ring keeps f+2 and f+3
    let got = s.next(10).await.unwrap();
    assert_eq!(seqs(&got), vec![f + 2, f + 3]);
    // Then it waits for the next batch, and gets it.
    let wait = tokio::spawn(async move { s.next(10).await.map(|b| seqs(&b)) });
    tokio::time::sleep(Duration::from_millis(20)).await;
    l.sink().push(stored("h"));
    l.cut();
    assert_eq!(wait.await.unwrap(), Some(vec![f + 4]));
}

#[tokio::test]
async fn a_stalled_subscriber_holds_no_more_than_the_ring() {
    let l = log(8, 1_000);
    let _stalled = l.subscribe(0, "test");
    for i in 0..10_000 {
        l.sink().push(stored(&format!("k{i}")));
        if i % 100 == 0 {
            l.cut();
        }
    }
    l.cut();
    assert_eq!(l.read(0, usize::MAX).0.len(), 8, "the ring is bounded whoever reads it");
    assert_eq!(l.subscribers(), 1);
}

#[test]
fn every_source_has_its_own_epoch_and_numbers_after_earlier_ones() {
    let (a, b) = (log(1, 1), log(1, 1));
    assert_ne!(a.epoch(), b.epoch());
    assert!(a.next_seq() >= first_seq(crate::platform::now_unix_ms() - 1_000));
    assert!(first_seq(1_001) > first_seq(1_000) + 1_000, "a millisecond later: room for a thousand batches");
    // Exact as a float64 (a Prometheus sample) for centuries to come.
    let year_2200_ms = 7_258_118_400_000;
    assert!(first_seq(year_2200_ms) < 1 << 53);
}

#[tokio::test]
async fn a_relay_holds_its_sources_batches_and_starts_again_when_the_source_changes() {
    let r = EventLog::relay(Limits {
        batch_events: 2,
        batch_delay: Duration::from_millis(5),
        buffer_events: 10,
        ring_batches: 4,
    });
    let mut s = r.subscribe(0, "test");
    r.accept(7, 100, 1, vec![Event::AllCleared]);
    r.accept(7, 101, 1, vec![stored("a")]);
    r.accept(7, 101, 1, vec![stored("a")]); // a resumed stream's repeat
    assert_eq!(seqs(&s.next(10).await.unwrap()), vec![100, 101]);
    assert_eq!((s.epoch(), r.epoch(), r.next_seq()), (7, 7, 102));
    // A new primary: its batches from its first, whatever the old sequences.
    r.accept(9, 50, 2, vec![Event::AllCleared, stored("b")]);
    let got = s.next(10).await.unwrap();
    assert_eq!((seqs(&got), s.epoch()), (vec![50], 9));
    assert_eq!(got[0].events, vec![Event::AllCleared, stored("b")]);
    assert_eq!(r.read(0, 10).0.len(), 1, "the old source's batches are gone");
}
