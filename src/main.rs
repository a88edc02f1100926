#![deny(unsafe_code)]
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use cxlkv::config::{parse_size, Config};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(name = "cxlkv", version, about = "Share LLM KV-cache chunks through a CXL shared-memory pool")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the sidecar (default: 1 GiB pool in /dev/shm, no config needed).
    Serve(Box<ServeArgs>),
    /// Show a running sidecar's pool, regions, pages, keys and tenants.
    Status(StatusArgs),
    /// Print a running sidecar's event stream (keys stored and removed,
    /// pool-wide), a line per event, until interrupted.
    Events(EventsArgs),
    /// Check a config file and print the effective configuration (TOML).
    Config {
        /// TOML config file.
        file: PathBuf,
    },
}

#[derive(Args)]
struct StatusArgs {
    /// gRPC Unix socket of the sidecar.
    #[arg(long, default_value = "/tmp/cxlkv/cxlkv.sock")]
    socket: String,
    /// Reach the sidecar over TCP instead (host:port).
    #[arg(long)]
    tcp: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// File holding a bearer token (an operator's, to see every tenant).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// CA of the sidecar's TLS certificate (TCP; turns TLS on).
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// Client certificate and key for mutual TLS.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Name the sidecar's certificate must carry (default: the --tcp host).
    #[arg(long)]
    tls_domain: Option<String>,
}

#[derive(Args)]
struct EventsArgs {
    #[command(flatten)]
    to: StatusArgs,
    /// The epoch `--since` belongs to (0: the current one).
    #[arg(long, default_value_t = 0)]
    epoch: u64,
    /// First batch wanted (0: the oldest held; see `cxlkv status`).
    #[arg(long, default_value_t = 0)]
    since: u64,
}

impl StatusArgs {
    fn auth(&self) -> cxlkv::auth::ClientAuth {
        cxlkv::auth::ClientAuth {
            token_file: self.token_file.clone(),
            tls_ca: self.tls_ca.clone(),
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
            tls_domain: self.tls_domain.clone(),
        }
    }
}

#[derive(Args)]
#[command(args_override_self = true)]
struct ServeArgs {
    /// TOML config file (see config/cxlkv.toml); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// gRPC Unix socket path.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Also serve gRPC on this TCP address (e.g. 127.0.0.1:50051).
    #[arg(long)]
    tcp: Option<String>,
    /// Serve --tcp on a non-loopback address without tokens or client
    /// certificates (anyone who reaches it can use every tenant's keys).
    #[arg(long)]
    insecure_tcp: bool,
    /// Tenants that get their own cxlkv_tenant_stored_bytes series (0 = none).
    #[arg(long)]
    max_tenant_series: Option<usize>,
    /// Pool backend: shm or dax.
    #[arg(long, value_parser = backend)]
    backend: Option<cxlkv::pool::BackendKind>,
    /// Pool file (shm) or device (dax).
    #[arg(long)]
    pool_path: Option<PathBuf>,
    /// Cache coherence of the pool memory: auto, hardware or software.
    #[arg(long, value_parser = coherence)]
    coherence: Option<cxlkv::pool::Coherence>,
    /// Region space of an shm pool, e.g. 1GiB.
    #[arg(long, value_parser = size)]
    pool_size: Option<u64>,
    /// Region size (a multiple of 2 MiB; also the largest object), e.g. 256MiB.
    #[arg(long, value_parser = size)]
    region_size: Option<u64>,
    /// Allocation unit inside a region (power of two, >= 4KiB), e.g. 64KiB.
    #[arg(long, value_parser = size)]
    page_size: Option<u64>,
    /// HTTP address for /metrics, /live, /ready ("" = off).
    #[arg(long)]
    metrics_addr: Option<String>,
    /// Node id in the pool (0 = lowest free).
    #[arg(long)]
    node_id: Option<u32>,
    /// Cap on regions this node owns (0 = no cap).
    #[arg(long)]
    max_regions: Option<u32>,
    #[arg(long, value_parser = policy, help = policy_help())]
    eviction_policy: Option<cxlkv::eviction::PolicyKind>,
    /// Reclaim reservations not committed within this time.
    #[arg(long)]
    reservation_timeout_ms: Option<u64>,
    /// Bytes one client connection may hold locked plus reserved (0 = half the pool).
    #[arg(long, value_parser = size)]
    max_client_pinned_bytes: Option<u64>,
    /// Skip prefaulting claimed regions.
    #[arg(long)]
    no_prefault: bool,
    /// Erase and reformat a damaged, foreign or mismatched pool.
    #[arg(long)]
    format: bool,
    /// Log format: text or json.
    #[arg(long, value_parser = log_format)]
    log_format: Option<cxlkv::config::LogFormat>,
    /// Cluster: this node's name (empty = single node).
    #[arg(long)]
    node_name: Option<String>,
    /// Cluster: where this node's peer service listens (host:port).
    #[arg(long)]
    peer_addr: Option<String>,
    /// Cluster: the primary's node name.
    #[arg(long)]
    primary: Option<String>,
    /// Cluster: the primary's peer address (host:port), for followers.
    #[arg(long)]
    primary_addr: Option<String>,
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.message().to_owned())
}

fn backend(s: &str) -> Result<cxlkv::pool::BackendKind, String> {
    cxlkv::pool::BackendKind::parse(s).map_err(|e| e.message().to_owned())
}

fn policy(s: &str) -> Result<cxlkv::eviction::PolicyKind, String> {
    s.parse().map_err(|e: cxlkv::error::Error| e.message().to_owned())
}

/// The `--eviction-policy` help, naming every policy of the table.
fn policy_help() -> String {
    let others = cxlkv::eviction::POLICIES.iter().filter(|&&p| p != cxlkv::eviction::DEFAULT_POLICY);
    let names: Vec<&str> = others.copied().collect();
    format!(
        "Victim order when a reserve finds no free pages: {} (default), {}",
        cxlkv::eviction::DEFAULT_POLICY,
        names.join(", ")
    )
}

fn log_format(s: &str) -> Result<cxlkv::config::LogFormat, String> {
    cxlkv::config::LogFormat::parse(s).map_err(|e| e.message().to_owned())
}

fn coherence(s: &str) -> Result<cxlkv::pool::Coherence, String> {
    cxlkv::pool::Coherence::parse(s).map_err(|e| e.message().to_owned())
}

impl ServeArgs {
    fn config(self) -> Result<Config, cxlkv::error::Error> {
        let mut c = match &self.config {
            Some(p) => Config::load(p)?,
            None => Config::default(),
        };
        macro_rules! set { ($($f:ident => $($t:ident).+),*) => {$( if let Some(v) = self.$f { c.$($t).+ = v; } )*}; }
        set!(socket => server.socket, tcp => server.tcp_addr, backend => pool.backend, pool_path => pool.path,
             coherence => pool.coherence,
             pool_size => pool.size, region_size => pool.region_size, page_size => pool.page_size,
             metrics_addr => server.metrics_addr, node_id => node_id, max_regions => registry.max_regions_per_instance,
             eviction_policy => registry.eviction_policy, reservation_timeout_ms => registry.reservation_timeout_ms,
             max_client_pinned_bytes => registry.max_client_pinned_bytes,
             log_format => log.format, max_tenant_series => server.max_tenant_series,
             node_name => cluster.node_name, peer_addr => cluster.peer_addr, primary => cluster.primary,
             primary_addr => cluster.primary_addr);
        c.auth.insecure_tcp |= self.insecure_tcp;
        c.pool.prefault &= !self.no_prefault;
        c.pool.format |= self.format;
        Ok(c)
    }
}

fn init_logs(c: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&c.log.level));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    if c.log.format == cxlkv::config::LogFormat::Json {
        b.json().init();
    } else {
        b.init();
    }
}

async fn shutdown_on_signal(token: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term.recv() => {},
    }
    tracing::info!("signal received");
    token.cancel();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    match cli.cmd {
        Cmd::Config { file } => match Config::load(&file).and_then(Config::validated) {
            Ok(c) => {
                print!("{}", toml::to_string(&c).expect("config serializes"));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("cxlkv: {}", e.message());
                ExitCode::from(2)
            }
        },
        Cmd::Status(a) => rt.block_on(async {
            match cxlkv::status::fetch(&a.socket, a.tcp.as_deref(), &a.auth()).await {
                Ok(s) => {
                    print!("{}", if a.json { cxlkv::status::to_json(&s) + "\n" } else { cxlkv::status::render(&s) });
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("cxlkv status: {}", e.message());
                    ExitCode::from(3)
                }
            }
        }),
        Cmd::Events(a) => rt.block_on(async {
            let mut out = std::io::stdout().lock();
            let (to, at) = (&a.to, (a.epoch, a.since));
            match cxlkv::status::watch(&to.socket, to.tcp.as_deref(), &to.auth(), at, to.json, &mut out).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("cxlkv events: {}", e.message());
                    ExitCode::from(3)
                }
            }
        }),
        Cmd::Serve(args) => {
            let cfg = match args.config().and_then(Config::validated) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("cxlkv: {}", e.message());
                    return ExitCode::from(2);
                }
            };
            init_logs(&cfg);
            let token = CancellationToken::new();
            rt.block_on(async {
                tokio::spawn(shutdown_on_signal(token.clone()));
                match cxlkv::server::run(cfg, token).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        tracing::error!("{}", e.message());
                        eprintln!("cxlkv: {}", e.message());
                        ExitCode::FAILURE
                    }
                }
            })
        }
    }
}
