//! Benchmark driver used by scripts/bench.sh. Every figure is printed as a
//! `BENCH <name> <value>` line; ratios are computed against baselines measured
//! in the same run. This file is the command line; each subcommand is a
//! module of its own.
// The one `unsafe` here maps the pool the way a client does (see `data::map_pool`).
#![deny(unsafe_code)]
#![warn(clippy::undocumented_unsafe_blocks)]
use std::path::PathBuf;

use clap::{Parser, Subcommand};

// One module per benchmark family (each a subcommand), then what they share.
mod admission;
mod cluster;
mod control;
mod evict;
mod flush;
mod memcpy;
mod rebuild;
mod scale;
mod storm;
mod storm_handler;
mod wakeup;

mod data;
mod figures;
mod fixtures;
mod keys;
mod lookups;
mod node;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Single-thread memcpy between prefaulted buffers.
    Memcpy {
        #[arg(long, value_delimiter = ',', default_value = "262144,2097152,33554432")]
        sizes: Vec<usize>,
        /// Bytes copied per measurement.
        #[arg(long, default_value_t = 256 << 20)]
        bytes: usize,
        #[arg(long, default_value_t = 7)]
        reps: usize,
    },
    /// Two threads waking each other over a Unix socket pair: the host's
    /// wake-up round trip, the baseline of the latency figures.
    Wakeup {
        #[arg(long, default_value_t = 20000)]
        rounds: usize,
    },
    /// Batched lookup-and-lock latency (UDS, TCP) and key-lookups/s.
    Control {
        #[arg(long)]
        socket: PathBuf,
        #[arg(long)]
        tcp: Option<String>,
        #[arg(long, default_value_t = 32)]
        batch: usize,
        #[arg(long, default_value_t = 5000)]
        iters: usize,
        #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
        clients: Vec<usize>,
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
    },
    /// In-process registry: bytes per entry and lookup rate at N entries.
    Scale {
        #[arg(long)]
        entries: usize,
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        /// Eviction policy of the registry (its per-entry state counts).
        #[arg(long, default_value = "default")]
        policy: String,
    },
    /// Store throughput into an empty pool and into a full one (every reserve evicts).
    Evict {
        #[arg(long)]
        socket: PathBuf,
        #[arg(long, default_value_t = 256 << 10)]
        object: usize,
        #[arg(long, default_value_t = 32)]
        batch: usize,
    },
    /// Warm restart: store N one-page objects, then time the start-up that
    /// rebuilds the registry from their records in the pool.
    Rebuild {
        /// Pool file (created; removed at the end).
        #[arg(long)]
        pool: PathBuf,
        #[arg(long, default_value_t = 100_000)]
        objects: usize,
    },
    /// Reserves that cannot be placed (4096 region-sized items, one every
    /// 10 ms), over many locked entries, while another client probes with
    /// Stats and LookupAndLock: the probes' p99 vs idle.
    Storm {
        #[arg(long)]
        socket: PathBuf,
        /// Entries locked (by a client that keeps them) during the storm.
        #[arg(long, default_value_t = 50_000)]
        locked: usize,
        /// Unlocked entries beside them (the only ones eviction may take).
        #[arg(long, default_value_t = 10_000)]
        free: usize,
        /// Probes (Stats + LookupAndLock of 32 keys) per phase.
        #[arg(long, default_value_t = 2000)]
        probes: usize,
        /// A second sidecar the storm never calls, probed in turn with the
        /// first: what the storm's CPU alone does to a probe on this host.
        #[arg(long)]
        control_socket: Option<PathBuf>,
        /// Send the storm's items as ReserveItem messages, not packed (its
        /// figures then end in `_items`).
        #[arg(long)]
        items: bool,
        /// Another node of the same pool (the primary, when `socket` is a
        /// follower): one entry stored and locked through it, so that its
        /// region too keeps a lock and no region of the pool is free to take.
        #[arg(long)]
        hold_socket: Option<PathBuf>,
        /// Appended to every figure's name (`_follower`).
        #[arg(long, default_value = "")]
        suffix: String,
    },
    /// The storm's Reserve given to a handler in this process (the same
    /// pool, entries and locks as `storm`'s sidecar): the sidecar's own
    /// work on it, without transport, other clients or the bulk lane.
    StormHandler {
        /// Pool file (created; removed at the end).
        #[arg(long)]
        pool: PathBuf,
        #[arg(long, default_value_t = 50_000)]
        locked: usize,
        #[arg(long, default_value_t = 10_000)]
        free: usize,
        #[arg(long, default_value_t = 300)]
        rounds: usize,
    },
    /// Store throughput with software coherence (records and payload lines
    /// flushed; payloads written back or streamed) as a ratio to hardware
    /// coherence (nothing flushed).
    Flush {
        /// Pool file shared by both nodes (created; removed at the end).
        #[arg(long)]
        pool: PathBuf,
        #[arg(long, value_delimiter = ',', default_value = "65536,262144,2097152")]
        sizes: Vec<usize>,
        /// Objects per small batch.
        #[arg(long, default_value_t = 32)]
        batch: usize,
        /// Bytes per large batch (above the last-level cache).
        #[arg(long, default_value_t = 128 << 20)]
        big: usize,
        #[arg(long, default_value_t = 15)]
        rounds: usize,
    },
    /// A stream of one-hit chunks into a full pool through a sidecar with
    /// admission (as configured) and one with admission off: bytes copied
    /// and time per store call, on ÷ off.
    Admission {
        /// The sidecar with admission as configured.
        #[arg(long)]
        on: PathBuf,
        /// The sidecar with `[registry] admission = "off"`.
        #[arg(long)]
        off: PathBuf,
        #[arg(long, default_value_t = 256 << 10)]
        object: usize,
        #[arg(long, default_value_t = 8)]
        batch: usize,
        /// Store calls before measuring: enough to fill the pool and then
        /// judge the stores admission waits for.
        #[arg(long, default_value_t = 800)]
        warmup: usize,
        #[arg(long, default_value_t = 1000)]
        calls: usize,
    },
    /// Three sidecars on one pool (a primary and two followers): lookup
    /// latency through a follower vs at the primary, loading cross-node vs
    /// same-node hits, key-lookups/s spread over the nodes vs on one.
    Cluster {
        /// The primary's client socket.
        #[arg(long)]
        primary: PathBuf,
        /// The primary's TCP listener (a reference latency).
        #[arg(long)]
        primary_tcp: Option<String>,
        /// The followers' client sockets (two).
        #[arg(long, value_delimiter = ',')]
        followers: Vec<PathBuf>,
        /// Lookups timed at the primary and as many through a follower.
        #[arg(long, default_value_t = 5000)]
        iters: usize,
        /// Object size of the load comparison.
        #[arg(long, default_value_t = 256 << 10)]
        object: usize,
        /// Objects stored for it (a working set larger than the last-level
        /// cache keeps both sides' copies from memory).
        #[arg(long, default_value_t = 256)]
        objects: usize,
        /// Load rounds (one batch of 32 per client each); lookup-rate rounds
        /// are min(rounds, 3).
        #[arg(long, default_value_t = 201)]
        rounds: usize,
        /// Lookup clients in the rate comparison.
        #[arg(long, default_value_t = 6)]
        clients: usize,
        /// Seconds per lookup-rate measurement.
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// The sidecars' process ids (primary first): the CPU each spends
        /// in the rate comparison.
        #[arg(long, value_delimiter = ',')]
        pids: Vec<u32>,
    },
}

fn main() {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    match cli.cmd {
        Cmd::Memcpy { sizes, bytes, reps } => memcpy::memcpy(&sizes, bytes, reps),
        Cmd::Wakeup { rounds } => wakeup::wakeup(rounds),
        Cmd::Control { socket, tcp, batch, iters, clients, seconds } => {
            // Latency from a current-thread client: the await and the socket
            // wake-up stay on one thread (a multi-thread client adds a
            // cross-thread hop per call: docs/benchmark-findings.md, "What
            // profiling found"). Throughput from many client tasks on the
            // multi-thread runtime.
            let ct = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            ct.block_on(control::control_latency(&socket, tcp.as_deref(), batch, iters));
            rt.block_on(control::control_throughput(socket, batch, clients, seconds))
        }
        Cmd::Scale { entries, seconds, policy } => scale::scale(entries, seconds, &policy),
        Cmd::Evict { socket, object, batch } => rt.block_on(evict::evict(socket, object, batch)),
        Cmd::Storm { socket, locked, free, probes, control_socket, items, hold_socket, suffix } => {
            let suffix = if items { format!("_items{suffix}") } else { suffix };
            let (sockets, packed) = (storm::Sockets { socket, control: control_socket, hold: hold_socket }, !items);
            rt.block_on(storm::storm(sockets, storm::Storm { locked, free, probes, packed, suffix }))
        }
        Cmd::StormHandler { pool, locked, free, rounds } => {
            rt.block_on(storm_handler::run(&pool, locked, free, rounds))
        }
        Cmd::Rebuild { pool, objects } => rt.block_on(rebuild::rebuild(&pool, objects)),
        Cmd::Flush { pool, sizes, batch, big, rounds } => flush::run(&pool, &sizes, batch, big, rounds),
        Cmd::Admission { on, off, object, batch, warmup, calls } => {
            rt.block_on(admission::run(admission::Args { on, off, object, batch, warmup, calls }))
        }
        Cmd::Cluster { primary, primary_tcp, followers, iters, object, objects, rounds, clients, seconds, pids } => {
            let a = cluster::Args {
                primary,
                primary_tcp,
                followers,
                iters,
                object,
                objects,
                rounds,
                clients,
                seconds,
                pids,
            };
            cluster::run(a)
        }
    }
}
