//! Synthetic KV-cache request traces in Mooncake's JSONL format, so policies
//! are judged on more than one workload shape. Block ids follow prefix
//! hashing: a block's id is determined by its content and the id of the
//! block before it (ids are numbered in order of first appearance, as in
//! Mooncake's traces), and a request's last, partial block gets an id of its
//! own (its content differs once the block fills up).
//!
//! - `chat`: multi-turn conversations behind one shared system prompt; each
//!   turn resends the whole history plus the previous answer and a new
//!   message; many conversations end after one turn; turns come minutes apart.
//! - `agent`: a few agents with long shared prefixes (tool definitions,
//!   instructions), popularity skewed; each session runs many short steps
//!   seconds apart, each appending a tool result.
//! - `rag`: a short system prompt, then retrieved documents from a corpus
//!   with skewed popularity (block-aligned), then a question; some follow-ups.
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::{Request, BLOCK_TOKENS};

pub const SHAPES: &[&str] = &["chat", "agent", "rag"];

/// splitmix64: small, seedable, good enough for workload shapes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
    fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        let (u, v) = (1.0 - self.unit(), self.unit());
        let z = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
        median * (sigma * z).exp()
    }
    fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }
    /// Index in 0..n with probability proportional to 1/(i+1)^s.
    fn zipf(&mut self, cdf: &[f64]) -> usize {
        let u = self.unit() * cdf.last().copied().unwrap_or(1.0);
        cdf.partition_point(|&c| c < u).min(cdf.len() - 1)
    }
}

fn zipf_cdf(n: usize, s: f64) -> Vec<f64> {
    let mut acc = 0.0;
    (0..n)
        .map(|i| {
            acc += 1.0 / ((i + 1) as f64).powf(s);
            acc
        })
        .collect()
}

/// Prefix-hash ids: (previous block id, content) -> id, in order of first use.
#[derive(Default)]
struct Ids {
    map: HashMap<(u64, u64), u64>,
    fresh: u64,
}

impl Ids {
    fn id(&mut self, parent: u64, content: u64) -> u64 {
        let n = self.map.len() as u64 + self.fresh;
        *self.map.entry((parent, content)).or_insert(n)
    }
    /// A block no other request will ever have.
    fn unique(&mut self) -> u64 {
        let n = self.map.len() as u64 + self.fresh;
        self.fresh += 1;
        n
    }
}

/// A session: its context so far as block contents plus a tail of tokens
/// that do not fill a block yet.
struct Session {
    blocks: Vec<u64>,
    tail_tokens: u64,
    turns_left: u32,
    /// Mean think time before the next turn, in seconds.
    gap_s: f64,
    tag: u64,
}

impl Session {
    /// Append `tokens` of new content; the partial tail grows into blocks.
    fn append(&mut self, tokens: u64) {
        let total = self.tail_tokens + tokens;
        for _ in 0..total / BLOCK_TOKENS {
            let j = self.blocks.len() as u64;
            self.blocks.push(self.tag << 20 | j);
        }
        self.tail_tokens = total % BLOCK_TOKENS;
    }

    fn request(&self, ids: &mut Ids, t_ms: u64, output: u64) -> Request {
        let mut parent = u64::MAX;
        let mut hash_ids: Vec<u64> = self
            .blocks
            .iter()
            .map(|&c| {
                parent = ids.id(parent, c);
                parent
            })
            .collect();
        if self.tail_tokens > 0 {
            hash_ids.push(ids.unique());
        }
        let input_length = self.blocks.len() as u64 * BLOCK_TOKENS + self.tail_tokens;
        Request { timestamp: t_ms, input_length, output_length: output, hash_ids }
    }
}

/// Generate `n` requests of `shape` (see `SHAPES`).
pub fn generate(shape: &str, n: usize, seed: u64) -> Option<Vec<Request>> {
    let mut rng = Rng(seed ^ 0x5EED);
    let mut ids = Ids::default();
    let mut out = Vec::with_capacity(n);
    let mut events: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
    let mut sessions: HashMap<u64, Session> = HashMap::new();
    let agents_cdf = zipf_cdf(12, 1.1);
    let agent_prefix: Vec<u64> = (0..12).map(|_| rng.lognormal(12_000.0, 0.6) as u64 + 2_000).collect();
    let docs_cdf = zipf_cdf(20_000, 0.9);
    let doc_blocks: Vec<u64> = (0..20_000).map(|_| 1 + rng.lognormal(2.0, 0.7) as u64).collect();
    // New sessions arrive as a Poisson process; the rate is set so traces
    // span about an hour at ~3 requests/s like Mooncake's conversation trace.
    let session_gap_ms = match shape {
        "chat" => 550.0,
        "agent" => 3_000.0,
        "rag" => 400.0,
        _ => return None,
    };
    let mut next_tag = 1u64;
    let mut t_new = 0.0f64;
    events.push(Reverse((0, 0)));
    while out.len() < n {
        let Reverse((t, sid)) = events.pop().expect("the arrival event is always queued");
        if sid == 0 {
            // A new session arrives.
            let tag = next_tag;
            next_tag += 1;
            let mut s = Session { blocks: vec![], tail_tokens: 0, turns_left: 0, gap_s: 0.0, tag };
            match shape {
                "chat" => {
                    s.blocks.push(0); // the shared system prompt
                    s.turns_left = 1 + rng.lognormal(0.4, 1.4) as u32;
                    s.gap_s = rng.lognormal(400.0, 1.0);
                    s.append((rng.lognormal(6_000.0, 1.1) as u64).min(120_000));
                }
                "agent" => {
                    let a = rng.zipf(&agents_cdf);
                    for j in 0..agent_prefix[a] / BLOCK_TOKENS {
                        s.blocks.push(1 << 40 | (a as u64) << 20 | j);
                    }
                    s.turns_left = 1 + rng.exp(8.0) as u32;
                    s.gap_s = rng.lognormal(6.0, 0.8);
                    s.append(rng.lognormal(400.0, 0.8) as u64);
                }
                _ => {
                    s.blocks.push(0);
                    for _ in 0..3 + rng.next() % 3 {
                        let d = rng.zipf(&docs_cdf) as u64;
                        for j in 0..doc_blocks[d as usize] {
                            s.blocks.push(2 << 40 | d << 8 | j);
                        }
                    }
                    s.turns_left = if rng.chance(0.25) { 2 + rng.exp(1.0) as u32 } else { 1 };
                    s.gap_s = rng.lognormal(60.0, 0.8);
                    s.append(rng.lognormal(150.0, 0.6) as u64 + 20);
                }
            }
            sessions.insert(tag, s);
            events.push(Reverse((t, tag)));
            t_new += rng.exp(session_gap_ms);
            events.push(Reverse((t_new as u64, 0)));
            continue;
        }
        let Some(s) = sessions.get_mut(&sid) else { continue };
        let output = (rng.lognormal(350.0, 0.6) as u64).max(1);
        out.push(s.request(&mut ids, t, output));
        s.turns_left -= 1;
        if s.turns_left == 0 {
            sessions.remove(&sid);
            continue;
        }
        // The answer and the next message join the context.
        s.append(output);
        let more = match shape {
            "chat" => rng.lognormal(500.0, 1.0),
            "agent" => rng.lognormal(900.0, 0.9),
            _ => rng.lognormal(120.0, 0.6),
        };
        s.append(more as u64 + 1);
        let gap = rng.exp(s.gap_s) * 1000.0;
        events.push(Reverse((t + gap as u64 + 1, sid)));
    }
    Some(out)
}
