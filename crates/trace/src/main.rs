//! `cxlkv-trace`: replay KV-cache request traces through cxlkv's registry and
//! eviction policies in process, and write synthetic ones
//! (docs/BENCHMARKS.md, "Eviction quality").
#![deny(unsafe_code)]
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use cxlkv::config::Config;
use cxlkv::error::Error;
use cxlkv_trace::fluid::{self, Classes};
use cxlkv_trace::{gen, svg, Policies};

#[derive(Parser)]
#[command(
    name = "cxlkv-trace",
    version,
    about = "Replay KV-cache request traces through cxlkv's eviction, or generate them"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Replay a KV-cache request trace (Mooncake JSONL) through the registry,
    /// its eviction policies and admission in process; print hit ratios and
    /// the blocks written per capacity.
    Replay(ReplayArgs),
    /// Write a synthetic request trace (Mooncake JSONL) of a workload shape.
    GenTrace {
        /// chat (multi-turn conversations), agent (long shared prefixes) or rag.
        #[arg(long, default_value = "chat")]
        shape: String,
        #[arg(long, default_value_t = 12_000)]
        requests: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Output file (default: stdout).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Estimate the block hits a policy could reach that knows only
    /// per-block features (prior accesses, gap since the last one,
    /// conversation turn), at 1, 2, 5 and 10 % capacity: one line,
    /// `TRACE CLASSES N classes: HIT% ...` (`-`: no estimate at that
    /// capacity).
    FluidBound {
        /// Trace file (Mooncake JSONL).
        trace: PathBuf,
        /// Features of a block's class: none, count, iv (count + gap), turn
        /// (count + turn), all, pos (count + position in the request).
        #[arg(long, value_enum, default_value = "all")]
        classes: Classes,
    },
}

#[derive(Args)]
struct ReplayArgs {
    /// Trace file: one JSON object per line with `hash_ids` (512-token prefix blocks).
    trace: PathBuf,
    /// Policies, comma-separated; `default` = the default policy, `belady` =
    /// the optimum. `NAME+MODE` replays admission too: `+admission` as a
    /// sidecar with these settings runs it, or `+adaptive`,
    /// `+second_touch`, `+off`; a bare name admits every store.
    #[arg(long, value_delimiter = ',', default_value = "lru,default,default+admission,belady")]
    policy: Vec<String>,
    /// Capacities as fractions of the trace's unique blocks, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0.01,0.02,0.05,0.1,0.2")]
    capacity: Vec<f64>,
    /// Print a JSON list of {policy, capacity, block_hit, prefix_hit,
    /// written_blocks, written_bytes} instead of the tables.
    #[arg(long)]
    json: bool,
    /// Also draw block-hit ratio against capacity, one line per policy, to this SVG file.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Take the policies' settings (`[registry.eviction.*]`), which one is
    /// `default` (`registry.eviction_policy`) and what `+admission` is
    /// (`registry.admission`, `admission_history`) from this config file.
    #[arg(long)]
    config: Option<PathBuf>,
}

fn replay(a: &ReplayArgs) -> Result<String, Error> {
    let with = match &a.config {
        Some(f) => Policies::of_config(&Config::load(f)?.validated()?),
        None => Policies::default(),
    };
    let reqs = cxlkv_trace::load(&a.trace)?;
    let cells = cxlkv_trace::run(&reqs, &a.policy, &a.capacity, &with)?;
    if let Some(p) = &a.svg {
        let title = a.trace.file_name().map_or("trace".into(), |f| f.to_string_lossy().into_owned());
        std::fs::write(p, svg::chart(&title, &cells)).map_err(|e| Error::io(format!("write {}", p.display()), e))?;
    }
    Ok(if a.json { serde_json::to_string(&cells).expect("cells serialize") + "\n" } else { cxlkv_trace::table(&cells) })
}

fn fluid_bound(trace: &std::path::Path, classes: Classes) -> Result<String, Error> {
    let e = fluid::estimate(&cxlkv_trace::load(trace)?, classes);
    let name = classes.to_possible_value().expect("every value has a name");
    let hits: Vec<String> = e.block_hit.iter().map(|h| h.map_or("-".into(), |h| format!("{:.1}", h * 100.0))).collect();
    Ok(format!("{} {} {} classes: {}\n", trace.display(), name.get_name(), e.classes, hits.join(" ")))
}

fn main() -> ExitCode {
    match Cli::parse().cmd {
        Cmd::FluidBound { trace, classes } => match fluid_bound(&trace, classes) {
            Ok(out) => {
                print!("{out}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("cxlkv-trace fluid-bound: {}", e.message());
                ExitCode::from(2)
            }
        },
        Cmd::Replay(a) => match replay(&a) {
            Ok(out) => {
                print!("{out}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("cxlkv-trace replay: {}", e.message());
                ExitCode::from(2)
            }
        },
        Cmd::GenTrace { shape, requests, seed, out } => {
            let Some(reqs) = gen::generate(&shape, requests, seed) else {
                eprintln!("cxlkv-trace gen-trace: unknown shape {shape:?}; known: {}", gen::SHAPES.join(", "));
                return ExitCode::from(2);
            };
            let text: String =
                reqs.iter().map(|r| serde_json::to_string(r).expect("requests serialize") + "\n").collect();
            let written = match out {
                Some(p) => std::fs::write(&p, text).map_err(|e| format!("write {}: {e}", p.display())),
                None => std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes()).map_err(|e| e.to_string()),
            };
            match written {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("cxlkv-trace gen-trace: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
