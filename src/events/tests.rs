use std::time::Duration;

use super::*;

fn limits(ring: usize, buffer: usize) -> Limits {
    Limits {
        batch_events: 2,
        batch_bytes: 1 << 20,
        batch_delay: Duration::from_millis(5),
        buffer_events: buffer,
        buffer_bytes: 1 << 30,
        ring_batches: ring,
        ring_bytes: 1 << 30,
        staged_bytes: 1 << 20,
        per_model: false,
    }
}

fn log(ring: usize, buffer: usize) -> Arc<EventLog> {
    EventLog::new(limits(ring, buffer))
}

fn stored(k: &str) -> Event {
    Event::Stored {
        key: k.as_bytes().into(),
        tenant: "t".into(),
        size: 1,
        node: NodeId(1),
        commit_seq: 1,
        hash: hash::block_hash(k.as_bytes()),
        announce: None,
        tokens: None,
    }
}

fn removed(k: &str) -> Event {
    let hash = hash::block_hash(k.as_bytes());
    Event::Removed {
        key: k.as_bytes().into(),
        tenant: "t".into(),
        size: 1,
        reason: Reason::Deleted,
        hash,
        announce: None,
    }
}

/// What the sink makes of an event: the first key of its hash announces it.
fn announced(e: Event, n: Option<u32>) -> Event {
    match e {
        Event::Stored { key, tenant, size, node, commit_seq, hash, tokens, .. } => {
            Event::Stored { key, tenant, size, node, commit_seq, hash, announce: n, tokens }
        }
        Event::Removed { key, tenant, size, reason, hash, .. } => {
            Event::Removed { key, tenant, size, reason, hash, announce: n }
        }
        e => e,
    }
}

fn seqs(b: &[Arc<Batch>]) -> Vec<u64> {
    b.iter().map(|b| b.seq).collect()
}

const ALL: usize = usize::MAX;

#[test]
fn events_are_batched_by_count_in_order_with_sequences_from_zero() {
    let l = log(16, 100);
    for k in ["a", "b", "c"] {
        l.sink().push(stored(k));
    }
    l.cut();
    let (b, oldest) = l.read(0, ALL);
    assert_eq!((seqs(&b), oldest), (vec![0, 1, 2], 0), "vLLM numbers a publisher's batches from 0");
    // A source starts with "all cleared", then the events in push order.
    assert_eq!(b[0].events, vec![Event::AllCleared]);
    assert_eq!(b[1].events, vec![announced(stored("a"), Some(0)), announced(stored("b"), Some(0))]);
    assert_eq!(b[2].events, vec![announced(stored("c"), Some(0))]);
    assert!(b.iter().all(|b| b.epoch == l.epoch()));
    assert_eq!(l.next_seq(), 3);
}

#[test]
fn a_new_sources_all_cleared_is_in_the_ring_before_any_batching() {
    let l = log(16, 100);
    let (b, oldest) = l.read(0, ALL);
    assert_eq!(b.len(), 1);
    assert_eq!((b[0].events.clone(), b[0].seq, oldest), (vec![Event::AllCleared], 0, 0));
    assert_eq!(l.next_seq(), 1);
}

#[test]
fn an_overflowing_buffer_drops_events_and_the_sequence_shows_the_gap() {
    let l = log(16, 3);
    for k in ["a", "b", "c", "d"] {
        l.sink().push(stored(k));
    }
    l.cut();
    let (b, _) = l.read(1, ALL);
    assert_eq!(seqs(&b), vec![2, 3], "sequence 1 skipped: a subscriber sees the loss");
    assert_eq!(b.iter().map(|b| b.events.len()).sum::<usize>(), 3);
}

#[test]
fn a_dropped_event_changes_the_hash_set_after_the_events_buffered_before_it() {
    // The batcher keeps the set; an event the buffer has no room for is
    // accounted at once, so what is buffered before it must be first: "b"
    // stored (buffered) then removed (dropped) leaves no "b" in the set,
    // and its next store announces it again.
    let l = log(16, 2);
    l.sink().push(stored("a"));
    l.sink().push(stored("b"));
    l.sink().push(removed("b")); // no room: dropped
    l.cut();
    l.sink().push(stored("b"));
    l.cut();
    let (b, _) = l.read(1, ALL);
    let events: Vec<Event> = b.iter().flat_map(|b| b.events.clone()).collect();
    assert_eq!(
        events,
        vec![announced(stored("a"), Some(0)), announced(stored("b"), Some(0)), announced(stored("b"), Some(0))]
    );
}

#[test]
fn the_buffer_the_batches_and_the_ring_are_bounded_in_bytes() {
    let key = "k".repeat(1000);
    let one = stored(&format!("{key}00")).bytes();
    let mut lim = limits(1 << 20, 1 << 20);
    (lim.buffer_bytes, lim.batch_events, lim.batch_bytes, lim.ring_bytes) = (10 * one, 1000, 3 * one, 6 * one + 512);
    let l = EventLog::new(lim);
    for i in 0..20 {
        l.sink().push(stored(&format!("{key}{i:02}")));
    }
    l.cut();
    let (b, _) = l.read(0, ALL);
    let events: usize = b.iter().map(|b| b.events.len()).sum();
    assert!(events <= 6, "the ring holds 6 keys' worth of bytes, not {events}");
    assert!(b.iter().all(|b| b.events.len() <= 3), "a batch holds batch_bytes");
    assert!(l.held().1 <= 6 * one + 512);
    // The buffer kept 10 of the 20; the sequence shows the 10 dropped.
    assert_eq!(l.next_seq(), 1 + 1 + 4, "all cleared, the gap, then 10 keys in batches of 3");
}

#[test]
fn a_hash_is_announced_by_its_first_live_key_and_removed_by_its_last() {
    let l = log(16, 100);
    let k = |worker: u8| {
        // Two TP ranks' in-process keys over one chunk: one hash.
        let mut k = vec![0x02, 0, 1, b'm', 0, 0, 0, 2, 0, 0, 0, worker, 1, 1, 9];
        k.extend_from_slice(b"\x00");
        String::from_utf8(k).unwrap()
    };
    l.sink().push(stored(&k(0)));
    l.sink().push(stored(&k(1)));
    l.sink().push(removed(&k(0)));
    l.sink().push(removed(&k(1)));
    l.cut();
    let (b, _) = l.read(1, ALL);
    let events: Vec<Event> = b.iter().flat_map(|b| b.events.clone()).collect();
    assert_eq!(
        events,
        vec![
            announced(stored(&k(0)), Some(0)),
            announced(stored(&k(1)), None),
            announced(removed(&k(0)), None),
            announced(removed(&k(1)), Some(0)),
        ]
    );
}

#[test]
fn staged_tokens_ride_on_their_keys_commit_and_are_bounded_in_bytes() {
    let mut lim = limits(16, 100);
    lim.staged_bytes = 200 + 64 + 1;
    let l = EventLog::new(lim);
    let t = Arc::new(Tokens { ids: vec![1; 50].into(), parent: None });
    let later = std::time::Instant::now() + Duration::from_secs(60);
    l.sink().stage(b"a", t.clone(), later);
    l.sink().stage(b"b", t.clone(), later); // over the bound: dropped
    l.sink().push(stored("a"));
    l.sink().push(stored("b"));
    l.cut();
    let (b, _) = l.read(1, ALL);
    let tokens: Vec<Option<usize>> = b[0]
        .events
        .iter()
        .map(|e| match e {
            Event::Stored { tokens, announce, .. } => {
                assert_eq!(*announce, Some(tokens.as_ref().map_or(0, |t| t.ids.len() as u32)));
                tokens.as_ref().map(|t| t.ids.len())
            }
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(tokens, vec![Some(50), None]);
    assert_eq!(l.sink().held_bytes().1, 0, "a commit takes its staged tokens");
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
    let got = s.next(ALL).await.unwrap();
    assert_eq!(seqs(&got), vec![f + 2, f + 3]);
    let wait = tokio::spawn(async move { s.next(ALL).await.map(|b| seqs(&b)) });
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
    assert_eq!(l.read(0, ALL).0.len(), 8, "the ring is bounded whoever reads it");
    assert_eq!(l.subscribers(), 1);
}

#[test]
fn every_source_has_its_own_epoch() {
    let (a, b) = (log(1, 1), log(1, 1));
    assert_ne!(a.epoch(), b.epoch());
}

#[tokio::test]
async fn a_relay_holds_its_sources_batches_and_starts_again_when_the_source_changes() {
    let r = EventLog::relay(limits(4, 10));
    let mut s = r.subscribe(0, "test");
    r.accept(7, 0, 1, vec![Event::AllCleared]);
    r.accept(7, 1, 1, vec![stored("a")]);
    r.accept(7, 1, 1, vec![stored("a")]); // a resumed stream's repeat
    assert_eq!(seqs(&s.next(ALL).await.unwrap()), vec![0, 1]);
    assert_eq!((s.epoch(), r.epoch(), r.next_seq()), (7, 7, 2));
    // A new primary: its batches from its first.
    r.accept(9, 0, 2, vec![Event::AllCleared, stored("b")]);
    let got = s.next(ALL).await.unwrap();
    assert_eq!((seqs(&got), s.epoch()), (vec![0], 9));
    assert_eq!(got[0].events, vec![Event::AllCleared, stored("b")]);
    assert_eq!(r.read(0, ALL).0.len(), 1, "the old source's batches are gone");
}

/// The nice values of this process's threads named `name`.
fn nice_of_threads(name: &str) -> Vec<i64> {
    let mut out = vec![];
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim() == name {
            let stat = std::fs::read_to_string(t.path().join("stat")).unwrap();
            let fields: Vec<&str> = stat.rsplit_once(") ").unwrap().1.split(' ').collect();
            out.push(fields[16].parse().unwrap()); // field 19 of stat(5): nice
        }
    }
    out
}

#[tokio::test]
async fn the_batcher_is_a_thread_below_the_request_paths_priority_and_ends_with_the_source() {
    let l = log(16, 100);
    let stop = tokio_util::sync::CancellationToken::new();
    l.start(stop.clone());
    let mut s = l.subscribe(1, "test");
    l.sink().push(stored("a"));
    // Batched by the thread (nothing here cuts): within its time bound.
    let got = tokio::time::timeout(Duration::from_secs(5), s.next(ALL)).await.expect("batched").unwrap();
    assert_eq!(got[0].events, vec![announced(stored("a"), Some(0))]);
    // Relative to where the process runs (a niced test run goes lower still).
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let base: i64 = stat.rsplit_once(") ").unwrap().1.split(' ').nth(16).unwrap().parse().unwrap();
    assert_eq!(nice_of_threads("cxlkv-events"), vec![(base + i64::from(super::BATCHER_NICE)).min(19)]);
    stop.cancel();
    let end = tokio::time::timeout(Duration::from_secs(5), s.next(ALL)).await.expect("the subscription ends");
    assert!(end.is_none());
}

#[test]
fn accepts_come_in_a_burst_then_at_the_paced_rate_and_idle_time_earns_the_burst_back() {
    use std::time::Instant;
    let (every, t0) = (Duration::from_millis(5), Instant::now());
    let mut p = peers::Pace::new(16, every, t0);
    for _ in 0..16 {
        assert!(p.ready_at() <= t0, "a burst of 16 at once");
        p.took(t0);
    }
    assert_eq!(p.ready_at(), t0 + every, "the 17th waits one step");
    // A flood: every accept as soon as allowed, for one second.
    let (mut now, mut n) = (p.ready_at(), 0);
    while now < t0 + Duration::from_secs(1) {
        p.took(now);
        n += 1;
        now = p.ready_at().max(now);
    }
    assert_eq!(n, 199, "200 a second under a flood");
    let idle = now + Duration::from_secs(1);
    assert!(p.ready_at() <= idle);
    for _ in 0..16 {
        assert!(p.ready_at() <= idle, "the burst is back after a second idle");
        p.took(idle);
    }
    assert!(p.ready_at() > idle);
}
