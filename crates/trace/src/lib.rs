//! KV-cache request traces, the `cxlkv-trace` tool. `cxlkv-trace replay`
//! replays a trace (Mooncake's JSONL: `hash_ids` are prefix blocks of 512
//! tokens, a request's last block is partial) through the real
//! `LocalRegistry` and eviction policy, in process, and reports block-hit and
//! prefix-hit ratios at several capacities, with Belady's optimum for
//! reference (`svg.rs` draws them); `cxlkv-trace gen-trace` writes synthetic
//! traces of several workload shapes (`gen.rs`); `cxlkv-trace fluid-bound`
//! estimates what a policy that knows only per-block features could reach
//! (`fluid.rs`).
//!
//! Each request does what a serving engine's cache connector does: look up
//! (and lock) all its blocks, release the locks, then store the blocks that
//! missed, evicting the shortfall first when the cache is full (as the
//! handler does for a reserve batch). Capacity is counted in blocks, a
//! fraction of the trace's unique blocks; every block takes one page, and a
//! partial block's object is proportionally smaller, which is all the policy
//! sees of it.
//!
//! Built on the `cxlkv` library's public API only: `LocalRegistry` is the
//! registry the sidecar runs, with the same eviction policies and settings.
#![deny(unsafe_code)]
pub mod fluid;
pub mod gen;
pub mod svg;

use std::collections::{BinaryHeap, HashMap};
use std::path::Path;

use serde::{Deserialize, Serialize};

use cxlkv::error::{Error, Result};
use cxlkv::eviction::{PolicyConfig, PolicyKind, PolicySettings};
use cxlkv::ids::{NodeId, RegionId, ReservationId};
use cxlkv::registry::{LocalRegistry, Location, ReserveOpts, Session};

/// Tokens per block in Mooncake traces.
pub const BLOCK_TOKENS: u64 = 512;
/// Bytes per token of the replayed objects (a full block is one 64 KiB page).
const TOKEN_BYTES: u64 = 128;
const PAGE: u64 = BLOCK_TOKENS * TOKEN_BYTES;
const NODE: NodeId = NodeId(1);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    #[serde(default)]
    pub timestamp: u64,
    #[serde(default)]
    pub input_length: u64,
    #[serde(default)]
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
}

impl Request {
    /// Object size of block `i`: the last block holds what is left of the input.
    fn block_bytes(&self, i: usize) -> u64 {
        let full = (i as u64 + 1) * BLOCK_TOKENS;
        if i + 1 == self.hash_ids.len() && self.input_length > 0 && self.input_length < full {
            (self.input_length + BLOCK_TOKENS - full).max(1) * TOKEN_BYTES
        } else {
            PAGE
        }
    }
}

pub fn load(path: &Path) -> Result<Vec<Request>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(format!("read trace {}", path.display()), e))?;
    parse(&text).map_err(|e| Error::invalid(format!("trace {}: {}", path.display(), e.message())))
}

pub fn parse(text: &str) -> Result<Vec<Request>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| Error::invalid(format!("line {}: {e}", i + 1))))
        .collect()
}

pub fn unique_blocks(reqs: &[Request]) -> usize {
    let mut seen = hashbrown::HashSet::new();
    reqs.iter().flat_map(|r| &r.hash_ids).filter(|&&h| seen.insert(h)).count()
}

/// Hit counts of one replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hits {
    pub accesses: u64,
    /// Blocks found.
    pub blocks: u64,
    /// Blocks found before a request's first miss (what a prefix cache can use).
    pub prefix: u64,
}

impl Hits {
    fn add(&mut self, found: &[bool]) {
        self.accesses += found.len() as u64;
        self.blocks += found.iter().filter(|&&f| f).count() as u64;
        self.prefix += found.iter().take_while(|&&f| f).count() as u64;
    }
    pub fn block_ratio(&self) -> f64 {
        self.blocks as f64 / self.accesses.max(1) as f64
    }
    pub fn prefix_ratio(&self) -> f64 {
        self.prefix as f64 / self.accesses.max(1) as f64
    }
}

fn key(h: u64) -> Vec<u8> {
    h.to_le_bytes().to_vec()
}

/// What a replay's policy names stand for: the policies' settings and which
/// one `default` is — a config file's (`cxlkv-trace replay --config`, so an
/// operator can replay the settings a sidecar would run with) or the
/// built-in ones.
#[derive(Debug, Clone)]
pub struct Policies {
    pub settings: PolicySettings,
    pub default: PolicyKind,
}

impl Default for Policies {
    fn default() -> Self {
        Self { settings: PolicySettings::default(), default: PolicyKind::DEFAULT }
    }
}

impl Policies {
    pub fn of_config(c: &cxlkv::config::Config) -> Self {
        Self { settings: c.registry.eviction.clone(), default: c.registry.eviction_policy }
    }

    /// The policy `name` (or `default`) with these settings.
    pub fn get(&self, name: &str) -> Result<PolicyConfig> {
        let kind = if name.eq_ignore_ascii_case("default") { self.default } else { name.parse()? };
        Ok(self.settings.config(kind))
    }
}

/// Replay `reqs` through a `LocalRegistry` using `policy` with its built-in
/// settings, holding at most `capacity` blocks.
pub fn replay(reqs: &[Request], policy: &str, capacity: usize) -> Result<Hits> {
    replay_with(reqs, Policies::default().get(policy)?, capacity)
}

/// As `replay`, with the policy given whole.
pub fn replay_with(reqs: &[Request], policy: PolicyConfig, capacity: usize) -> Result<Hits> {
    // Fixed hashing: the same trace gives the same figures every run.
    let reg = LocalRegistry::with_policy(policy, usize::MAX).with_fixed_hashing();
    let capacity = capacity.max(1) as u64;
    let (mut stored, mut hits) = (0u64, Hits::default());
    let mut now = 0u64;
    for r in reqs {
        // Timestamps only order locks; keep them increasing.
        now = now.max(r.timestamp) + 1;
        let keys: Vec<Vec<u8>> = r.hash_ids.iter().map(|&h| key(h)).collect();
        let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
        let found = reg.lookup_and_lock(&refs, 60_000, now);
        let found: Vec<bool> = found.iter().map(|f| f.is_some()).collect();
        hits.add(&found);
        let locked: Vec<&[u8]> = refs.iter().zip(&found).filter(|(_, &f)| f).map(|(k, _)| *k).collect();
        // A block id twice in one request was locked twice.
        let unlocked = reg.unlock(&locked, now);
        debug_assert!(unlocked.iter().all(|u| u.is_ok()));
        // Store the misses (each once), evicting the shortfall first.
        let mut seen = hashbrown::HashSet::new();
        let misses: Vec<usize> = (0..keys.len()).filter(|&i| !found[i] && seen.insert(r.hash_ids[i])).collect();
        let misses = &misses[..misses.len().min(capacity as usize)];
        let need = misses.len() as u64;
        if stored + need > capacity {
            let freed = reg.evict(NODE, stored + need - capacity, PAGE, now);
            stored -= freed.len() as u64;
        }
        let items: Vec<(Vec<u8>, Location)> = misses
            .iter()
            .map(|&i| {
                let loc = Location {
                    node: NODE,
                    region: RegionId(0),
                    offset: 0,
                    length: r.block_bytes(i),
                    generation: 1,
                    version: 0,
                };
                (keys[i].clone(), loc)
            })
            .collect();
        let res: Vec<ReservationId> =
            reg.reserve("replay", items, ReserveOpts::local(u64::MAX)).into_iter().collect::<Result<_>>()?;
        let (done, _) = reg.commit(&res, Session::LOCAL, &mut |_, _| {});
        stored += done.into_iter().filter(|d| d.is_ok()).count() as u64;
    }
    Ok(hits)
}

/// Belady's optimum for the same request semantics: a missed block is
/// stored only if it is needed again sooner than the cached block needed
/// farthest in the future (which it then replaces). With blocks of one size
/// this maximises block hits.
pub fn belady(reqs: &[Request], capacity: usize) -> Hits {
    // Next use of each access (request index), computed backwards.
    const NEVER: usize = usize::MAX;
    let mut next_of: Vec<Vec<usize>> = Vec::with_capacity(reqs.len());
    let mut last: HashMap<u64, usize> = HashMap::new();
    for (ri, r) in reqs.iter().enumerate().rev() {
        next_of.push(r.hash_ids.iter().map(|h| last.get(h).copied().unwrap_or(NEVER)).collect());
        for &h in &r.hash_ids {
            last.insert(h, ri);
        }
    }
    next_of.reverse();
    let mut cache: HashMap<u64, usize> = HashMap::new(); // block -> next use
    let mut far: BinaryHeap<(usize, u64)> = BinaryHeap::new(); // lazily deleted
    let mut hits = Hits::default();
    for (ri, r) in reqs.iter().enumerate() {
        let found: Vec<bool> = r.hash_ids.iter().map(|h| cache.contains_key(h)).collect();
        hits.add(&found);
        for (i, &h) in r.hash_ids.iter().enumerate() {
            let nu = next_of[ri][i];
            if found[i] || cache.contains_key(&h) {
                cache.insert(h, nu);
                far.push((nu, h));
                continue;
            }
            if nu == NEVER {
                continue;
            }
            if cache.len() >= capacity {
                // The cached block needed farthest ahead (skipping stale heap rows).
                let top = loop {
                    let &(n, b) = far.peek().expect("a full cache has heap rows");
                    if cache.get(&b) == Some(&n) {
                        break (n, b);
                    }
                    far.pop();
                };
                if top.0 <= nu {
                    continue;
                }
                far.pop();
                cache.remove(&top.1);
            }
            cache.insert(h, nu);
            far.push((nu, h));
        }
    }
    hits
}

/// One cell of a replay table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cell {
    pub policy: String,
    pub capacity: f64,
    pub block_hit: f64,
    pub prefix_hit: f64,
}

/// Replay every policy (`belady` = the optimum, `default` = the default
/// policy; settings from `with`) at every capacity fraction.
pub fn run(reqs: &[Request], policies: &[String], capacities: &[f64], with: &Policies) -> Result<Vec<Cell>> {
    let unique = unique_blocks(reqs);
    let mut out = vec![];
    for p in policies {
        for &c in capacities {
            if c.is_nan() || c <= 0.0 {
                return Err(Error::invalid(format!("capacity {c} is not a positive fraction")));
            }
            let blocks = ((unique as f64 * c).round() as usize).max(1);
            let h = if p.eq_ignore_ascii_case("belady") {
                belady(reqs, blocks)
            } else {
                replay_with(reqs, with.get(p)?, blocks)?
            };
            out.push(Cell { policy: p.clone(), capacity: c, block_hit: h.block_ratio(), prefix_hit: h.prefix_ratio() });
        }
    }
    Ok(out)
}

/// A plain-text table: one row per capacity, block-hit (prefix-hit) % per policy.
pub fn table(cells: &[Cell]) -> String {
    let mut policies: Vec<&str> = vec![];
    let mut caps: Vec<f64> = vec![];
    for c in cells {
        if !policies.contains(&c.policy.as_str()) {
            policies.push(&c.policy);
        }
        if !caps.contains(&c.capacity) {
            caps.push(c.capacity);
        }
    }
    let mut s = format!("{:>9}", "capacity");
    for p in &policies {
        s += &format!(" {:>15}", p);
    }
    s += "\n";
    for cap in caps {
        s += &format!("{:>8.1}%", cap * 100.0);
        for p in &policies {
            match cells.iter().find(|c| c.policy == *p && c.capacity == cap) {
                Some(c) => s += &format!(" {:>6.2} ({:>6.2})", c.block_hit * 100.0, c.prefix_hit * 100.0),
                None => s += &format!(" {:>15}", "-"),
            }
        }
        s += "\n";
    }
    s + "block-hit % (prefix-hit %)\n"
}

#[cfg(test)]
mod tests;
