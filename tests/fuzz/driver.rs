//! The fuzz driver: a small, dependency-free mutation fuzzer that runs on the
//! stable toolchain. Each target takes arbitrary bytes (as a libFuzzer or AFL
//! target would) and returns a label for what happened; a panic is a crash.
//!
//! Inputs come from a corpus (the target's seeds, the saved regression inputs
//! and every input that produced a label not seen before) through stacked
//! byte-level mutations (bit flips, interesting values, insertions,
//! deletions, splices), plus some purely random inputs. There is no
//! coverage instrumentation (that needs a nightly compiler or an AFL build);
//! the outcome labels are the feedback, and the targets decode the bytes
//! structurally so mutations reach past the first checks.
//!
//! A panic saves the input under `target/tmp/fuzz-crashes/` and fails; a
//! run that makes no progress for `CXLKV_FUZZ_HANG_SECS` (default 20) saves
//! the input it is stuck on and aborts the process.
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub trait Target {
    fn name(&self) -> &'static str;
    /// Valid or near-valid inputs to start from.
    fn seeds(&self) -> Vec<Vec<u8>>;
    /// Longest input the mutator makes.
    fn max_len(&self) -> usize;
    /// Run one input and name its outcome. Panics are crashes.
    fn run(&mut self, data: &[u8]) -> String;
}

/// splitmix64: deterministic for a given seed, on every platform and version.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

/// Values that tend to sit on boundaries: sizes, counts, owner words, limits.
pub const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    16,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x3ff,
    0x400,
    0x401,
    0xfff,
    0x1000,
    0x1001,
    0x7fff,
    0x8000,
    0xffff,
    0x1_0000,
    0x1_0001,
    0x20_0000,
    0x20_0001,
    0x4000_0000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    0x1_0000_0001,
    0x1_0000_0002,
    0x1_ffff_ffff,
    1 << 40,
    1 << 62,
    i64::MAX as u64,
    1 << 63,
    u64::MAX - 1,
    u64::MAX,
];

/// Reads fields from fuzz input; past the end every field reads as zero.
pub struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }
    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let start = self.pos.min(self.data.len());
        let end = start.saturating_add(n).min(self.data.len());
        self.pos = end;
        &self.data[start..end]
    }
    pub fn rest(&mut self) -> &'a [u8] {
        self.bytes(usize::MAX)
    }
    fn word<const N: usize>(&mut self) -> [u8; N] {
        let mut w = [0u8; N];
        let b = self.bytes(N);
        w[..b.len()].copy_from_slice(b);
        w
    }
    pub fn u8(&mut self) -> u8 {
        self.word::<1>()[0]
    }
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.word())
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.word())
    }
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.word())
    }
}

/// An outcome label without the parts that vary per input (numbers).
pub fn norm(s: &str) -> String {
    let mut out = String::with_capacity(s.len().min(96));
    let mut digits = false;
    for ch in s.chars() {
        if ch.is_ascii_digit() {
            if !digits {
                out.push('#');
            }
            digits = true;
            continue;
        }
        digits = false;
        if out.len() >= 90 {
            break;
        }
        out.push(ch);
    }
    out
}

fn mutate(rng: &mut Rng, v: &mut Vec<u8>, corpus: &[Vec<u8>], max_len: usize) {
    let stack = 1 << rng.below(4);
    for _ in 0..stack {
        let len = v.len();
        match rng.below(12) {
            0 if len > 0 => {
                let i = rng.below(len);
                v[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                v[i] = rng.next() as u8;
            }
            2 if len > 0 => {
                let i = rng.below(len);
                v[i] = INTERESTING[rng.below(INTERESTING.len())] as u8;
            }
            3 if len > 0 => {
                // An interesting value of 2, 4 or 8 bytes, little-endian.
                let width = 2 << rng.below(3);
                let val = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
                let i = rng.below(len);
                let n = width.min(len - i);
                v[i..i + n].copy_from_slice(&val[..n]);
            }
            4 if len > 0 => {
                let i = rng.below(len);
                let d = rng.below(35) as u8;
                v[i] = if rng.below(2) == 0 { v[i].wrapping_add(d) } else { v[i].wrapping_sub(d) };
            }
            5 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(16));
                v.drain(i..i + n);
            }
            6 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                v.splice(i..i, bytes);
            }
            7 if len > 0 => {
                // Repeat a chunk of the input somewhere else in it.
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                let chunk = v[i..i + n].to_vec();
                let at = rng.below(len + 1);
                v.splice(at..at, chunk);
            }
            8 if !corpus.is_empty() => {
                // Splice: our head, another input's tail.
                let other = &corpus[rng.below(corpus.len())];
                let at = rng.below(len + 1);
                let from = rng.below(other.len() + 1);
                v.truncate(at);
                v.extend_from_slice(&other[from..]);
            }
            9 if !corpus.is_empty() && len > 0 => {
                // Overwrite a range with the same range of another input.
                let other = &corpus[rng.below(corpus.len())];
                let i = rng.below(len);
                let n = (1 + rng.below(32)).min(len - i).min(other.len().saturating_sub(i));
                if n > 0 {
                    v[i..i + n].copy_from_slice(&other[i..i + n]);
                }
            }
            10 if len > 0 => v.truncate(rng.below(len)),
            _ => {
                let i = rng.below(len + 1);
                let val = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
                v.splice(i..i, val[..1 << rng.below(4)].iter().copied());
            }
        }
    }
    v.truncate(max_len);
}

pub struct Settings {
    pub inputs: u64,
    pub seed: u64,
    pub hang: Duration,
    pub progress: Option<Duration>,
}

impl Settings {
    /// `CXLKV_FUZZ_INPUTS` (default: `smoke`), `CXLKV_FUZZ_SEED`,
    /// `CXLKV_FUZZ_HANG_SECS`, `CXLKV_FUZZ_PROGRESS_SECS` (0 = quiet).
    pub fn from_env(smoke: u64) -> Self {
        let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
        Self {
            inputs: var("CXLKV_FUZZ_INPUTS").unwrap_or(smoke),
            seed: var("CXLKV_FUZZ_SEED").unwrap_or(0x00c0_ffee),
            hang: Duration::from_secs(var("CXLKV_FUZZ_HANG_SECS").unwrap_or(20)),
            progress: var("CXLKV_FUZZ_PROGRESS_SECS").filter(|&s| s > 0).map(Duration::from_secs),
        }
    }
}

pub struct Report {
    pub inputs: u64,
    pub elapsed: Duration,
    pub outcomes: BTreeMap<String, u64>,
    pub corpus: usize,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.elapsed.as_secs_f64();
        writeln!(
            f,
            "{} inputs in {:.1} s ({:.0}/s), 0 crashes, 0 hangs, {} distinct outcomes, corpus {}",
            self.inputs,
            s,
            self.inputs as f64 / s.max(1e-9),
            self.outcomes.len(),
            self.corpus
        )?;
        for (label, n) in &self.outcomes {
            writeln!(f, "  {n:>11}  {label}")?;
        }
        Ok(())
    }
}

fn crash_dir() -> PathBuf {
    std::env::var_os("CXLKV_FUZZ_CRASH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-crashes"))
}

fn save(name: &str, what: &str, data: &[u8]) -> PathBuf {
    let dir = crash_dir();
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("{name}-{what}-{:016x}.bin", crc64ish(data)));
    let _ = std::fs::write(&path, data);
    path
}

fn crc64ish(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Saved inputs of earlier crashes, replayed before anything else.
fn regressions(name: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz/regressions").join(name);
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(dir).map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default();
    files.sort();
    files.iter().filter_map(|p| std::fs::read(p).ok()).collect()
}

struct Watch {
    count: AtomicU64,
    done: AtomicBool,
    current: Mutex<Vec<u8>>,
}

/// Run `t` on `s.inputs` inputs; panics (after saving the input) on a crash.
/// `CXLKV_FUZZ_REPLAY=<file>` runs that one input instead.
pub fn run(t: &mut dyn Target, s: &Settings) -> Report {
    let name = t.name();
    if let Some(path) = std::env::var_os("CXLKV_FUZZ_REPLAY") {
        let data = std::fs::read(&path).expect("read the input to replay");
        let label = t.run(&data);
        eprintln!("fuzz {name}: replayed {}: {label}", Path::new(&path).display());
        return Report { inputs: 1, elapsed: Duration::ZERO, outcomes: [(label, 1)].into(), corpus: 0 };
    }
    let max_len = t.max_len();
    let mut corpus: Vec<Vec<u8>> = regressions(name);
    let replayed = corpus.len();
    corpus.extend(t.seeds());
    const MAX_CORPUS: usize = 2048;
    let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
    let mut rng = Rng::new(s.seed);

    let watch = Arc::new(Watch { count: AtomicU64::new(0), done: AtomicBool::new(false), current: Mutex::new(vec![]) });
    let dog = {
        let (w, hang) = (watch.clone(), s.hang);
        std::thread::spawn(move || {
            let (mut last, mut since) = (u64::MAX, Instant::now());
            while !w.done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let c = w.count.load(Ordering::Relaxed);
                if c != last {
                    (last, since) = (c, Instant::now());
                } else if since.elapsed() > hang {
                    let data = w.current.lock().map(|d| d.clone()).unwrap_or_default();
                    let path = save(name, "hang", &data);
                    eprintln!("fuzz {name}: input #{c} made no progress for {hang:?}; saved to {}", path.display());
                    std::process::abort();
                }
            }
        })
    };

    let start = Instant::now();
    let mut next_progress = s.progress.map(|p| start + p);
    let mut input = Vec::with_capacity(max_len);
    let initial = corpus.len();
    for i in 0..s.inputs {
        input.clear();
        let i_usize = i as usize;
        if i_usize < initial {
            input.extend_from_slice(&corpus[i_usize]); // every seed as is, once
        } else if rng.below(16) == 0 {
            let cap = [8, 64, 512, max_len][rng.below(4)].min(max_len);
            let n = rng.below(cap + 1);
            input.extend((0..n).map(|_| rng.next() as u8));
        } else {
            input.extend_from_slice(&corpus[rng.below(corpus.len())]);
            mutate(&mut rng, &mut input, &corpus, max_len);
        }
        watch.current.lock().unwrap().clone_from(&input);
        match catch_unwind(AssertUnwindSafe(|| t.run(&input))) {
            Ok(label) => {
                let n = outcomes.entry(label).or_insert(0);
                *n += 1;
                if *n == 1 && corpus.len() < MAX_CORPUS && i_usize >= initial {
                    corpus.push(input.clone());
                }
            }
            Err(e) => {
                watch.done.store(true, Ordering::Relaxed);
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                let path = save(name, "crash", &input);
                panic!(
                    "fuzz {name}: input #{i} panicked: {msg}\n  saved to {p}\n  replay: CXLKV_FUZZ_REPLAY={p} \
                     cargo test --test fuzz {name} -- --nocapture",
                    p = path.display()
                );
            }
        }
        watch.count.store(i + 1, Ordering::Relaxed);
        if let Some(at) = next_progress {
            if Instant::now() >= at {
                let secs = start.elapsed().as_secs_f64();
                eprintln!(
                    "fuzz {name}: {} inputs, {secs:.0} s, {:.0}/s, {} outcomes, corpus {}",
                    i + 1,
                    (i + 1) as f64 / secs,
                    outcomes.len(),
                    corpus.len()
                );
                next_progress = Some(at + s.progress.unwrap());
            }
        }
    }
    watch.done.store(true, Ordering::Relaxed);
    let _ = dog.join();
    let report = Report { inputs: s.inputs, elapsed: start.elapsed(), outcomes, corpus: corpus.len() };
    eprintln!("fuzz {name} (seed {:#x}, {replayed} regression inputs): {report}", s.seed);
    report
}
