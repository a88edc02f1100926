//! A real network partition: the primary and a follower in network
//! namespaces of their own, joined by a veth pair, the peer service on a
//! non-loopback address (so it needs a token: the same authentication as the
//! client API). Taking the link down cuts the follower off: it fences itself
//! (stores fail fast, nothing hangs), the primary declares it dead, and when
//! the link comes back it joins again with its chunks intact. Needs root
//! (namespaces), as CI has.
mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use cxlkv::proto;

const TOKEN: &str = "peer-token-0123456789abcdef";

struct Netns {
    p: String,
    f: String,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip (iproute2) must be installed");
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

impl Netns {
    fn new() -> Self {
        let id = std::process::id() % 100_000;
        let (p, f) = (format!("cxp{id}"), format!("cxf{id}"));
        ip(&["netns", "add", &p]);
        ip(&["netns", "add", &f]);
        let (vp, vf) = (format!("vp{id}"), format!("vf{id}"));
        ip(&["link", "add", &vp, "netns", &p, "type", "veth", "peer", "name", &vf, "netns", &f]);
        for (ns, dev, addr) in [(&p, &vp, "10.77.0.1/24"), (&f, &vf, "10.77.0.2/24")] {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        Self { p, f }
    }

    fn link(&self, up: bool) {
        let dev = format!("vf{}", std::process::id() % 100_000);
        ip(&["-n", &self.f, "link", "set", &dev, if up { "up" } else { "down" }]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.p]).status();
        let _ = Command::new("ip").args(["netns", "del", &self.f]).status();
    }
}

/// A sidecar started inside network namespace `ns`.
fn start_in(ns: &str, dir: &Path, name: &str, extra: &[&str]) -> Sidecar {
    let socket = dir.join(format!("{name}.sock"));
    let log = dir.join(format!("{name}.log"));
    let mut sc = Sidecar { dir: dir.to_owned(), socket: socket.clone(), pool: dir.join("pool"), child: None, log };
    let mut args = vec!["netns".to_string(), "exec".into(), ns.into(), env!("CARGO_BIN_EXE_cxlkv").into()];
    args.extend(sc.args(extra));
    let logf = std::fs::OpenOptions::new().create(true).append(true).open(&sc.log).unwrap();
    sc.child = Some(
        Command::new("ip")
            .args(&args)
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(logf)
            .spawn()
            .unwrap(),
    );
    sc.wait_ready(Duration::from_secs(30));
    sc
}

#[tokio::test(flavor = "multi_thread")]
async fn a_partitioned_follower_fences_itself_and_rejoins_when_the_link_returns() {
    let dir = tempfile::tempdir().unwrap();
    let ns = Netns::new();
    let d = dir.path();
    let tokens = d.join("tokens");
    std::fs::write(&tokens, format!("{TOKEN} *\n")).unwrap();
    let token = d.join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let cfg = d.join("cluster.toml");
    std::fs::write(
        &cfg,
        format!(
            "[auth]\ntokens_file = {:?}\n[cluster]\nheartbeat_ms = 100\nlease_ms = 600\ndead_after_ms = 1000\n\
             forward_timeout_ms = 500\ntoken_file = {:?}\n",
            tokens.display().to_string(),
            token.display().to_string()
        ),
    )
    .unwrap();
    let common = ["--config", cfg.to_str().unwrap(), "--primary", "a", "--pool-size", "16MiB"];
    let a = start_in(&ns.p, d, "a", &[&common[..], &["--node-name", "a", "--peer-addr", "10.77.0.1:7710"]].concat());
    let b = start_in(&ns.f, d, "b", &[&common[..], &["--node-name", "b", "--primary-addr", "10.77.0.1:7710"]].concat());
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let mut mb = PoolMap::open(&mut cb).await;
    let data = pattern(11, 150_000);
    assert_eq!(store(&mut cb, &mut mb, "t", &[("k", data.clone())]).await, vec![OK]);
    assert!(lookup(&mut ca, &["k"]).await[0].is_some(), "the primary sees b's chunk across the link");
    unlock(&mut ca, &["k"]).await;

    ns.link(false);
    tokio::time::sleep(Duration::from_millis(900)).await; // past b's lease
    let t = Instant::now();
    let r = cb
        .reserve(proto::ReserveRequest {
            tenant: "t".into(),
            items: vec![proto::ReserveItem { key: key("cut-off"), size: 10, ..Default::default() }],
            ..Default::default()
        })
        .await;
    assert_eq!(r.unwrap_err().code(), tonic::Code::Unavailable, "a cut-off follower stops writing");
    assert_eq!(lookup(&mut cb, &["k"]).await, vec![None], "and answers lookups with misses");
    assert!(t.elapsed() < Duration::from_secs(2), "without waiting on the lost primary");
    // The primary declares b dead; b's chunk stays readable through it.
    let t = Instant::now();
    while !a.logs().contains("node declared dead") {
        assert!(t.elapsed() < Duration::from_secs(10), "b was never declared dead");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(inline_get(&mut ca, "k").await.as_deref(), Some(&data[..]));

    ns.link(true);
    let t = Instant::now();
    loop {
        if let Some(l) = lookup(&mut cb, &["k"]).await.remove(0) {
            assert_eq!(mb.read(&l), data, "b's chunk survived the partition byte for byte");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "b never rejoined: {}", b.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(b.logs().contains("joined the primary again"));
}
