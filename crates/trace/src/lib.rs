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
//! handler does for a reserve batch). With admission (a policy named
//! `NAME+MODE`), the registry judges each store first, as the handler asks
//! it before placing anything, and a refused block is not written. Every
//! replay counts the blocks (and bytes) it wrote. Capacity is counted in blocks, a
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
use cxlkv::registry::{AdmissionConfig, AdmissionMode, Admit, LocalRegistry, Location, ReserveOpts, Session};

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

/// What a replay's policy names stand for: the policies' settings, which
/// one `default` is and the admission a sidecar runs — a config file's
/// (`cxlkv-trace replay --config`, so an operator can replay the settings
/// a sidecar would run with) or the built-in ones.
#[derive(Debug, Clone)]
pub struct Policies {
    pub settings: PolicySettings,
    pub default: PolicyKind,
    pub admission: AdmissionConfig,
}

impl Default for Policies {
    fn default() -> Self {
        Self {
            settings: PolicySettings::default(),
            default: PolicyKind::DEFAULT,
            admission: AdmissionConfig::default(),
        }
    }
}

/// A policy as replayed: eviction with its settings, and admission.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    pub policy: PolicyConfig,
    pub admission: AdmissionConfig,
}

impl Policies {
    pub fn of_config(c: &cxlkv::config::Config) -> Self {
        Self {
            settings: c.registry.eviction.clone(),
            default: c.registry.eviction_policy,
            admission: c.registry.admission(),
        }
    }

    /// The policy `NAME[+ADMISSION]` with these settings: `NAME` a policy
    /// or `default`; without `+`, no admission (every store written);
    /// `+admission` the admission a sidecar with these settings runs;
    /// `+off`, `+second_touch`, `+adaptive` that mode.
    pub fn get(&self, spec: &str) -> Result<Spec> {
        let (name, admission) = spec.split_once('+').unwrap_or((spec, "off"));
        let kind = if name.eq_ignore_ascii_case("default") { self.default } else { name.parse()? };
        let admission = match admission {
            "admission" => self.admission,
            mode => AdmissionConfig { mode: mode.parse::<AdmissionMode>()?, ..self.admission },
        };
        Ok(Spec { policy: self.settings.config(kind), admission })
    }
}

/// What a replay wrote into the cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Written {
    pub blocks: u64,
    pub bytes: u64,
}

/// Replay `reqs` through a `LocalRegistry` using `policy` with its built-in
/// settings, holding at most `capacity` blocks.
pub fn replay(reqs: &[Request], policy: &str, capacity: usize) -> Result<Hits> {
    replay_with(reqs, Policies::default().get(policy)?, capacity)
}

/// As `replay`, with the policy given whole.
pub fn replay_with(reqs: &[Request], spec: Spec, capacity: usize) -> Result<Hits> {
    Ok(replay_counted(reqs, spec, capacity)?.0)
}

/// As `replay_with`, with what it wrote.
pub fn replay_counted(reqs: &[Request], spec: Spec, capacity: usize) -> Result<(Hits, Written)> {
    // Fixed hashing: the same trace gives the same figures every run.
    let reg = LocalRegistry::with_policy(spec.policy, usize::MAX).with_admission(spec.admission).with_fixed_hashing();
    let capacity = capacity.max(1) as u64;
    let (mut stored, mut hits, mut written) = (0u64, Hits::default(), Written::default());
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
        // Store the misses (each once) that admission lets in, evicting
        // the shortfall first.
        let mut seen = hashbrown::HashSet::new();
        let misses: Vec<usize> = (0..keys.len()).filter(|&i| !found[i] && seen.insert(r.hash_ids[i])).collect();
        let misses = &misses[..misses.len().min(capacity as usize)];
        let judged: Vec<(&[u8], u64)> = misses.iter().map(|&i| (refs[i], r.block_bytes(i))).collect();
        let verdicts = reg.admit(&judged);
        let misses: Vec<usize> =
            misses.iter().zip(verdicts).filter(|(_, v)| *v == Admit::Admitted).map(|(&i, _)| i).collect();
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
        for loc in done.into_iter().flatten() {
            stored += 1;
            written.blocks += 1;
            written.bytes += loc.length;
        }
    }
    Ok((hits, written))
}

/// Belady's optimum for the same request semantics: a missed block is
/// stored only if it is needed again sooner than the cached block needed
/// farthest in the future (which it then replaces). With blocks of one size
/// this maximises block hits.
pub fn belady(reqs: &[Request], capacity: usize) -> Hits {
    belady_counted(reqs, capacity).0
}

/// As `belady`, with the blocks it stored (what it wrote: bytes as the
/// replay counts them).
pub fn belady_counted(reqs: &[Request], capacity: usize) -> (Hits, Written) {
    let mut written = Written::default();
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
            written.blocks += 1;
            written.bytes += r.block_bytes(i);
        }
    }
    (hits, written)
}

/// One cell of a replay table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cell {
    pub policy: String,
    pub capacity: f64,
    pub block_hit: f64,
    pub prefix_hit: f64,
    /// Blocks (and their bytes) stored into the cache.
    pub written_blocks: u64,
    pub written_bytes: u64,
}

/// Replay every policy (`belady` = the optimum, `default` = the default
/// policy, `+MODE` with admission; settings from `with`) at every capacity
/// fraction.
pub fn run(reqs: &[Request], policies: &[String], capacities: &[f64], with: &Policies) -> Result<Vec<Cell>> {
    let unique = unique_blocks(reqs);
    let mut out = vec![];
    for p in policies {
        for &c in capacities {
            if c.is_nan() || c <= 0.0 {
                return Err(Error::invalid(format!("capacity {c} is not a positive fraction")));
            }
            let blocks = ((unique as f64 * c).round() as usize).max(1);
            let (h, w) = if p.eq_ignore_ascii_case("belady") {
                belady_counted(reqs, blocks)
            } else {
                replay_counted(reqs, with.get(p)?, blocks)?
            };
            out.push(Cell {
                policy: p.clone(),
                capacity: c,
                block_hit: h.block_ratio(),
                prefix_hit: h.prefix_ratio(),
                written_blocks: w.blocks,
                written_bytes: w.bytes,
            });
        }
    }
    Ok(out)
}

/// A plain-text table: one row per capacity, block-hit (prefix-hit) % per
/// policy; then the blocks each wrote.
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
    let header = |s: &mut String| {
        *s += &format!("{:>9}", "capacity");
        for p in &policies {
            *s += &format!(" {:>15}", p);
        }
        *s += "\n";
    };
    let rows = |s: &mut String, cell: &dyn Fn(&Cell) -> String| {
        for &cap in &caps {
            *s += &format!("{:>8.1}%", cap * 100.0);
            for p in &policies {
                match cells.iter().find(|c| c.policy == *p && c.capacity == cap) {
                    Some(c) => *s += &format!(" {:>15}", cell(c)),
                    None => *s += &format!(" {:>15}", "-"),
                }
            }
            *s += "\n";
        }
    };
    let mut s = String::new();
    header(&mut s);
    rows(&mut s, &|c| format!("{:>6.2} ({:>6.2})", c.block_hit * 100.0, c.prefix_hit * 100.0));
    s += "block-hit % (prefix-hit %)\n\n";
    header(&mut s);
    rows(&mut s, &|c| c.written_blocks.to_string());
    s + "blocks written\n"
}

#[cfg(test)]
mod tests;
