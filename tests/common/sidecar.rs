//! The real `cxlkv` binary as a test starts it: its process, readiness,
//! signals, and the flags of a cluster's nodes.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cxlkv::client::{connect_uds, Client};

/// One `cxlkv serve` process of a test: its directory, socket, pool file
/// and log (killed when dropped).
pub struct Sidecar {
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub pool: PathBuf,
    pub child: Option<Child>,
    pub log: PathBuf,
}

/// The sidecar's gRPC health check says SERVING (asked from a thread of its
/// own: callers may be inside a runtime already).
pub fn ready(socket: &Path) -> bool {
    let socket = socket.to_owned();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(cxlkv::client::is_ready_uds(socket))
    })
    .join()
    .unwrap()
}

/// The arguments of node `node` of a cluster whose primary is "a": the
/// config file `cluster.toml` in `dir` (written to hold `toml`), a pool of
/// `pool_size`, and the primary's peer address `peer` ("a" listens there,
/// the others connect to it).
pub fn cluster_args(dir: &Path, node: &str, peer: &str, toml: &str, pool_size: &str) -> Vec<String> {
    let file = dir.join("cluster.toml");
    std::fs::write(&file, toml).unwrap();
    let role = if node == "a" { "--peer-addr" } else { "--primary-addr" };
    ["--config", file.to_str().unwrap(), "--node-name", node, "--primary", "a", "--pool-size", pool_size, role, peer]
        .map(String::from)
        .into()
}

/// Borrowed views of owned arguments (what `Sidecar::start` takes).
pub fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// A loopback port for a sidecar to listen on, outside the host's ephemeral
/// range. A port found by binding port 0 comes from that range, and between
/// the pick and the sidecar's bind any outgoing connection (another test's
/// follower dialling its primary) could take it as its source port: the
/// sidecar then failed with "Address already in use". Each pick in this
/// process is a new port (a counter), from an offset of the pid so that test
/// binaries run one after another start apart; a port something still holds
/// is skipped.
pub fn free_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let (lo, hi) = listening_ports();
    let span = hi - lo;
    let start = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let port = (lo + (start + n) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {lo}..{hi}");
}

/// Ports no outgoing connection takes: below the ephemeral range
/// (`ip_local_port_range`, 32768-60999 by default), else above it.
fn listening_ports() -> (u32, u32) {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let mut r = range.split_whitespace().filter_map(|w| w.parse::<u32>().ok());
    let (low, high) = (r.next().unwrap_or(32768), r.next().unwrap_or(60999));
    if low >= 2048 + 1024 {
        (low / 2, low)
    } else if high < 65535 - 1024 {
        (high + 1, 65536)
    } else {
        panic!("the ephemeral port range {low}-{high} leaves no ports to listen on outside it");
    }
}

/// SIGSTOP `pid` and wait until every one of its threads has stopped: kill()
/// only queues the signal, and until a thread takes it and starts the group
/// stop the others keep serving requests (milliseconds on a loaded host).
#[allow(dead_code)] // not every test binary stops a process
pub fn sigstop(pid: u32) {
    use nix::sys::signal::{kill, Signal};
    kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGSTOP).unwrap();
    let t = Instant::now();
    let stopped = || {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
        tasks.flatten().all(|t| {
            let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
            // The state follows the command name's closing parenthesis.
            matches!(stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()), Some("T" | "t"))
        })
    };
    while !stopped() {
        assert!(t.elapsed() < Duration::from_secs(5), "process {pid} did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
}

impl Sidecar {
    /// Small geometry so tests can fill it: 2 MiB regions, 64 KiB pages.
    pub fn start(dir: &Path, name: &str, extra: &[&str]) -> Self {
        let socket = dir.join(format!("{name}.sock"));
        let pool = dir.join("pool");
        let log = dir.join(format!("{name}.log"));
        let mut s = Self { dir: dir.to_owned(), socket, pool, child: None, log };
        s.spawn(extra);
        s
    }

    /// Started with a config file holding `toml` (written as `<name>.toml`
    /// in `dir`) and the usual flags.
    pub fn with_config(dir: &Path, name: &str, toml: &str, extra: &[&str]) -> Self {
        let cfg = dir.join(format!("{name}.toml"));
        std::fs::write(&cfg, toml).unwrap();
        let mut args = vec!["--config", cfg.to_str().unwrap()];
        args.extend_from_slice(extra);
        Self::start(dir, name, &args)
    }

    /// Start without waiting for readiness (for starts that must fail).
    pub fn start_unchecked(dir: &Path, name: &str, extra: &[&str]) -> Self {
        let mut s = Self {
            dir: dir.to_owned(),
            socket: dir.join(format!("{name}.sock")),
            pool: dir.join("pool"),
            child: None,
            log: dir.join(format!("{name}.log")),
        };
        s.child = Some(s.command(extra).spawn().expect("start cxlkv"));
        s
    }

    /// Wait for the process to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(st) = self.child.as_mut().expect("running").try_wait().unwrap() {
                return st;
            }
            assert!(t.elapsed() < timeout, "cxlkv did not exit: {}", self.logs());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn command(&self, extra: &[&str]) -> Command {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let mut c = Command::new(env!("CARGO_BIN_EXE_cxlkv"));
        c.args(self.args(extra)).env("RUST_LOG", "info").stdout(Stdio::null()).stderr(log);
        c
    }

    pub fn args(&self, extra: &[&str]) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "serve".into(),
            "--pool-path".into(),
            self.pool.display().to_string(),
            "--pool-size".into(),
            "8MiB".into(),
            "--region-size".into(),
            "2MiB".into(),
            "--page-size".into(),
            "64KiB".into(),
            "--socket".into(),
            self.socket.display().to_string(),
            "--metrics-addr".into(),
            "".into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }

    pub fn spawn(&mut self, extra: &[&str]) {
        let child = self.command(extra).spawn().expect("start cxlkv");
        self.child = Some(child);
        self.wait_ready(Duration::from_secs(30));
    }

    /// Wait for readiness (every listener bound), never for one socket:
    /// panics, with the logs, if the process exits first or `within` passes.
    pub fn wait_ready(&mut self, within: Duration) {
        let t = Instant::now();
        while !ready(&self.socket) {
            if let Some(st) = self.child.as_mut().expect("started").try_wait().unwrap() {
                panic!("{} exited early ({st}): {}", self.log.display(), self.logs());
            }
            assert!(t.elapsed() < within, "{} did not come up within {within:?}: {}", self.log.display(), self.logs());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub async fn client(&self) -> Client {
        connect_uds(&self.socket).await.expect("connect")
    }

    /// SIGTERM and wait; returns the exit status and how long it took.
    pub fn stop(&mut self) -> (std::process::ExitStatus, Duration) {
        let mut c = self.child.take().expect("running");
        let t = Instant::now();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
        (c.wait().unwrap(), t.elapsed())
    }

    /// Send SIGTERM and return at once (`stop` waits for the exit).
    pub fn sigterm(&self) {
        let pid = nix::unistd::Pid::from_raw(self.child.as_ref().expect("running").id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// kill -9 and reap; `spawn` starts it again (same socket and log).
    pub fn kill9(&mut self) {
        let mut c = self.child.take().expect("running");
        c.kill().unwrap();
        c.wait().unwrap();
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The `cxlkv` binary run to completion (a subcommand, or a start expected
/// to fail).
pub fn run_cxlkv<S: AsRef<std::ffi::OsStr>>(args: impl IntoIterator<Item = S>) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cxlkv")).args(args).output().unwrap()
}

/// SIGCONT a process stopped with `sigstop`.
pub fn sigcont(pid: u32) {
    use nix::sys::signal::{kill, Signal};
    kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGCONT).unwrap();
}
