//! `cxlkv-trace fluid-bound`: what an eviction policy that knows only
//! per-block features could reach on a trace (the issue-16 experiment that
//! asked why `gd` closes no more of the gap to Belady at 5 %;
//! docs/benchmark-findings.md, "Eviction quality").
//!
//! Each access of a full block (a request's last, partial block is left
//! out) starts a "life" whose class is a tuple of features the policy could
//! know: with [`Classes::Count`] the block's prior accesses (capped at 4);
//! `Iv` adds log4 of the gap since its last access; `Turn` adds the
//! conversation turn (prior accesses of the request's second block); `All`
//! has all three; `Pos` adds the block's position in its request instead;
//! `None` puts every life in one class. A policy that sees only the class
//! and the age can only choose, per class, how long to keep a block after
//! an access; relaxing the capacity to a time average (a Lagrangian over
//! the lives' costs in block-requests) gives the most hits any such policy
//! could make. It is an estimate, not a bound on real policies: it ignores
//! prefix structure (a block held past its predecessor counts), and with one
//! class it lands a little below the replay's LRU.
use std::collections::HashMap;

use crate::Request;

/// Which features a life's class holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Classes {
    None,
    Count,
    Iv,
    Turn,
    All,
    Pos,
}

/// Capacities (shares of the trace's unique blocks) the estimate is made at.
pub const CAPACITIES: [f64; 4] = [0.01, 0.02, 0.05, 0.1];
/// Ages tried as a class's keep time: 151 points spaced evenly in log scale
/// from 1 request to the trace's length.
const AGE_POINTS: u32 = 150;
/// Lagrange multipliers tried: 10^-7 to 10^-1 in 120 steps.
const LAMBDAS: u32 = 120;

/// The estimate's result: how many classes the lives fell into, and the
/// block-hit share (of all accesses, partial blocks included) at each of
/// `CAPACITIES` (`None` where no multiplier tried keeps within the
/// capacity).
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    pub classes: usize,
    pub block_hit: Vec<Option<f64>>,
}

/// A life's class: up to three features (unused ones 0).
type Class = (u32, u32, u32);

fn bit_length(x: u64) -> u32 {
    u64::BITS - x.leading_zeros()
}

/// The class of every life, and the gap (in requests) to the block's next
/// access (`None`: never accessed again).
fn lives(reqs: &[Request], classes: Classes) -> HashMap<Class, Vec<Option<u64>>> {
    let mut seen: HashMap<u64, u32> = HashMap::new();
    let mut last: HashMap<u64, u64> = HashMap::new();
    // Per block: (request index, class) of each access, in order.
    let mut uses: HashMap<u64, Vec<(u64, Class)>> = HashMap::new();
    for (ri, r) in reqs.iter().enumerate() {
        let ri = ri as u64;
        let full = &r.hash_ids[..r.hash_ids.len().saturating_sub(1)];
        let turn = if full.len() > 1 { seen.get(&full[1]).copied().unwrap_or(0).min(6) } else { 0 };
        for (pos, &h) in full.iter().enumerate() {
            let count = seen.get(&h).copied().unwrap_or(0).min(4);
            let gap = last.get(&h).map_or(0, |&l| ri - l);
            let gap_bucket = (bit_length(gap + 1) - 1) / 2;
            let gap_bucket = gap_bucket.min(6);
            let class = match classes {
                Classes::None => (0, 0, 0),
                Classes::Count => (count, 0, 0),
                Classes::Iv => (count, gap_bucket, 0),
                Classes::Turn => (count, turn, 0),
                Classes::All => (count, turn, gap_bucket),
                Classes::Pos => (count, bit_length(pos as u64).min(6), 0),
            };
            uses.entry(h).or_default().push((ri, class));
            *seen.entry(h).or_default() += 1;
            last.insert(h, ri);
        }
    }
    let mut out: HashMap<Class, Vec<Option<u64>>> = HashMap::new();
    for u in uses.values() {
        for (i, &(ri, class)) in u.iter().enumerate() {
            out.entry(class).or_default().push(u.get(i + 1).map(|&(next, _)| next - ri));
        }
    }
    out
}

pub fn estimate(reqs: &[Request], classes: Classes) -> Estimate {
    let n = reqs.len() as u64;
    let unique = crate::unique_blocks(reqs) as f64;
    let accesses: usize = reqs.iter().map(|r| r.hash_ids.len()).sum();
    let mut ages: Vec<u64> =
        (0..=AGE_POINTS).map(|x| (x as f64 * (n.max(1) as f64).ln() / AGE_POINTS as f64).exp() as u64).collect();
    ages.dedup();
    // Per class and age: the hits of keeping every life of the class that
    // long (lives that end within it), and their cost in block-requests.
    let lives = lives(reqs, classes);
    let curves: Vec<(Vec<u64>, Vec<u64>)> = lives
        .values()
        .map(|gaps| {
            let mut fin: Vec<u64> = gaps.iter().flatten().copied().collect();
            fin.sort_unstable();
            let mut prefix = vec![0u64];
            for &g in &fin {
                prefix.push(prefix.last().unwrap() + g);
            }
            ages.iter()
                .map(|&a| {
                    let k = fin.partition_point(|&g| g <= a);
                    (k as u64, prefix[k] + (gaps.len() - k) as u64 * a)
                })
                .unzip()
        })
        .collect();
    let block_hit = CAPACITIES
        .iter()
        .map(|&cap| {
            let budget = cap * unique * n as f64;
            let mut best: Option<u64> = None;
            for j in 0..LAMBDAS {
                let lambda = 10f64.powf(-7.0 + (6 * j) as f64 / LAMBDAS as f64);
                let (mut hits, mut cost) = (0u64, 0u64);
                for (h, c) in &curves {
                    let value = |i: usize| h[i] as f64 - lambda * c[i] as f64;
                    // The first of the best ages.
                    let bi = (1..h.len()).fold(0, |b, i| if value(i) > value(b) { i } else { b });
                    if value(bi) > 0.0 {
                        hits += h[bi];
                        cost += c[bi];
                    }
                }
                if (cost as f64) <= budget && best.is_none_or(|b| hits > b) {
                    best = Some(hits);
                }
            }
            best.map(|b| b as f64 / accesses.max(1) as f64)
        })
        .collect();
    Estimate { classes: lives.len(), block_hit }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(e: &Estimate) -> Vec<String> {
        e.block_hit.iter().map(|h| h.map_or("-".into(), |h| format!("{:.1}", h * 100.0))).collect()
    }

    #[test]
    fn reproduces_the_research_script() {
        // What scripts/fluid_bound.py (the issue-16 script this replaces)
        // printed for this generated trace; a change to `gen` moves them.
        let reqs = crate::gen::generate("chat", 3000, 2).unwrap();
        let all = estimate(&reqs, Classes::All);
        assert_eq!((all.classes, shown(&all)), (101, vec!["8.6".into(), "9.9".into(), "12.0".into(), "15.8".into()]));
        let none = estimate(&reqs, Classes::None);
        assert_eq!((none.classes, shown(&none)), (1, vec!["5.3".into(), "6.5".into(), "6.5".into(), "11.3".into()]));
        let count = estimate(&reqs, Classes::Count);
        assert_eq!(count.classes, 5, "prior accesses 0 to 4");
    }

    #[test]
    fn more_capacity_never_estimates_fewer_hits() {
        for shape in crate::gen::SHAPES {
            let reqs = crate::gen::generate(shape, 1500, 4).unwrap();
            for classes in [Classes::None, Classes::Turn, Classes::Pos] {
                let hits: Vec<f64> = estimate(&reqs, classes).block_hit.iter().flatten().copied().collect();
                assert!(hits.windows(2).all(|w| w[0] <= w[1]), "{shape} {classes:?}: {hits:?}");
                assert!(hits.iter().all(|h| (0.0..=1.0).contains(h)), "{shape} {classes:?}: {hits:?}");
            }
        }
    }
}
