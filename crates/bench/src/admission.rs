//! `cxlkv-bench admission`: what admission saves on a stream of one-hit
//! chunks (every key new, none read again), stored into a full pool through
//! two sidecars alike but for `[registry] admission`: one as configured (the
//! default, `adaptive`) and one `off`. The pool is in use: a hot set stored
//! first is read (looked up and unlocked) before every store call, as a
//! serving engine's shared prefixes are (a pool nobody reads gives
//! admission no evidence, and it admits everything). Each sidecar first
//! gets a warm-up that fills its pool and gives admission its evidence;
//! then store calls alternate between the two (one call each in turn, so
//! both see the same load). A store call is what a client does: Reserve a
//! batch, copy each admitted chunk into its pages, Commit what it copied
//! (nothing to commit: no Commit); it alone is timed.
use std::path::{Path, PathBuf};
use std::time::Instant;

use bytes::Bytes;
use cxlkv::proto;

use crate::data::Writer;
use crate::figures::{bench, pct};

/// Chunks of the hot set read before every store call.
const HOT: usize = 16;

pub struct Args {
    /// The sidecar with admission as configured.
    pub on: PathBuf,
    /// The sidecar with `admission = "off"`.
    pub off: PathBuf,
    pub object: usize,
    pub batch: usize,
    /// Store calls before measuring (fill the pool, then admission's evidence).
    pub warmup: usize,
    pub calls: usize,
}

struct Stream {
    w: Writer,
    batch: usize,
    seq: usize,
    /// Bytes copied into the pool, and offered.
    copied: u64,
    offered: u64,
    /// Seconds per measured call.
    calls: Vec<f64>,
    hot: Vec<Bytes>,
}

impl Stream {
    async fn open(socket: &Path, object: usize, batch: usize) -> Self {
        let w = Writer::open(socket, object, 5).await;
        let hot: Vec<Bytes> = (0..HOT).map(|i| Bytes::from(format!("hot-{i}"))).collect();
        let mut s = Self { w, batch, seq: 0, copied: 0, offered: 0, calls: vec![], hot };
        s.w.store(s.hot.clone()).await;
        s
    }

    /// Read the hot set (a lookup, then an unlock of what it found).
    async fn read_hot(&mut self) {
        let r = self
            .w
            .c
            .lookup_and_lock(proto::LookupRequest { keys: self.hot.clone(), ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        let found: Vec<Bytes> =
            self.hot.iter().zip(&r.results).filter(|(_, x)| x.found).map(|(k, _)| k.clone()).collect();
        self.w.c.unlock(proto::UnlockRequest { keys: found }).await.unwrap();
    }

    /// The hot set read, then one store call of `batch` new chunks;
    /// `measured` counts the store call.
    async fn call(&mut self, measured: bool) {
        self.read_hot().await;
        let keys = (0..self.batch).map(|j| Bytes::from(format!("one-hit-{}", self.seq + j))).collect();
        self.seq += self.batch;
        let t = Instant::now();
        let copied = self.w.store(keys).await.copied;
        if measured {
            self.calls.push(t.elapsed().as_secs_f64());
            self.copied += copied;
            self.offered += (self.batch * self.w.object) as u64;
        }
    }
}

pub async fn run(a: Args) {
    let mut on = Stream::open(&a.on, a.object, a.batch).await;
    let mut off = Stream::open(&a.off, a.object, a.batch).await;
    for _ in 0..a.warmup {
        on.call(false).await;
        off.call(false).await;
    }
    for _ in 0..a.calls {
        on.call(true).await;
        off.call(true).await;
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let (mut lat_on, mut lat_off) = (on.calls.clone(), off.calls.clone());
    bench("admission_one_hit_copied_ratio", on.copied as f64 / off.copied.max(1) as f64);
    bench("admission_one_hit_refused_share", 1.0 - on.copied as f64 / on.offered.max(1) as f64);
    bench("admission_one_hit_call_ratio", mean(&on.calls) / mean(&off.calls));
    bench("admission_one_hit_call_p50_ratio", pct(&mut lat_on, 0.5) / pct(&mut lat_off, 0.5));
    bench("admission_one_hit_call_us_on", mean(&on.calls) * 1e6);
    bench("admission_one_hit_call_us_off", mean(&off.calls) * 1e6);
}
