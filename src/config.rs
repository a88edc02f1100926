//! Configuration: TOML file (every knob documented in config/cxlkv.toml, all
//! optional) overridden by command-line flags.
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

use crate::election::ElectionKind;
use crate::error::{Error, Result};
use crate::eviction::PolicyKind;
use crate::pool::BackendKind;

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
#[derive(Default)]
pub struct Config {
    /// This node's id in the pool's region table; 0 = lowest free id.
    pub node_id: u32,
    pub pool: PoolConfig,
    pub server: ServerConfig,
    pub registry: RegistryConfig,
    pub log: LogConfig,
    pub auth: crate::auth::AuthConfig,
    pub tls: crate::auth::TlsConfig,
    pub cluster: ClusterConfig,
    pub quotas: crate::registry::QuotaConfig,
}

/// Several hosts on one pool (empty `node_name` = single node). One node,
/// `primary`, holds the registry of the whole pool; the others forward to it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// This node's name (Kubernetes: the node name from the downward API).
    pub node_name: String,
    /// Where this node's peer service listens (TCP host:port).
    pub peer_addr: String,
    /// Name of the primary node (static election).
    pub primary: String,
    /// The primary's peer address (host:port), for followers.
    pub primary_addr: String,
    /// `static` (the node named by `primary`), `etcd` or `kubernetes`.
    pub election: ElectionKind,
    /// etcd client URLs (election = "etcd").
    pub etcd_endpoints: Vec<String>,
    /// The etcd election every node campaigns on, or the name of the
    /// coordination.k8s.io Lease (election = "kubernetes").
    pub election_name: String,
    /// The Lease's namespace; empty: the service account's own (its
    /// namespace file), i.e. the namespace the DaemonSet runs in.
    pub lease_namespace: String,
    /// A follower's heartbeat period.
    pub heartbeat_ms: u64,
    /// A follower that has not heard from the primary for this long stops
    /// writing (self-fencing).
    pub lease_ms: u64,
    /// The primary declares a node dead after this much silence (> lease).
    pub dead_after_ms: u64,
    /// Longest a forwarded call may take.
    pub forward_timeout_ms: u64,
    /// A follower answers lookups of keys it read recently without asking
    /// the primary: the primary locks them for the node, which gives such a
    /// lock back once no client of its read the key for this long. 0: every
    /// lookup goes to the primary.
    pub hold_idle_ms: u64,
    /// How a follower authenticates to the primary's peer service (which
    /// checks the [auth]/[tls] settings like the client API): a token file
    /// (an operator token), and for TLS the CA of the primary's certificate
    /// plus this node's certificate and key.
    pub token_file: String,
    pub tls_ca: String,
    pub tls_cert: String,
    pub tls_key: String,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            node_name: String::new(),
            peer_addr: String::new(),
            primary: String::new(),
            primary_addr: String::new(),
            election: ElectionKind::Static,
            etcd_endpoints: vec![],
            election_name: "cxlkv-primary".into(),
            lease_namespace: String::new(),
            heartbeat_ms: 200,
            lease_ms: 2_000,
            dead_after_ms: 3_000,
            forward_timeout_ms: 1_000,
            hold_idle_ms: 500,
            token_file: String::new(),
            tls_ca: String::new(),
            tls_cert: String::new(),
            tls_key: String::new(),
        }
    }
}

impl ClusterConfig {
    pub fn enabled(&self) -> bool {
        !self.node_name.is_empty()
    }
    pub fn is_primary(&self) -> bool {
        self.enabled() && self.node_name == self.primary
    }
    /// The primary is elected (and may change while running).
    pub fn elected(&self) -> bool {
        self.enabled() && self.election != ElectionKind::Static
    }
    pub fn validate(&self) -> Result<()> {
        if !self.enabled() {
            return Ok(());
        }
        match self.election {
            ElectionKind::Static => {}
            ElectionKind::Etcd => {
                if self.etcd_endpoints.is_empty() || self.peer_addr.is_empty() {
                    return Err(Error::invalid(
                        "cluster.election = \"etcd\" needs cluster.etcd_endpoints and this node's cluster.peer_addr",
                    ));
                }
                return self.validate_timings();
            }
            ElectionKind::Kubernetes => return self.validate_kubernetes(),
        }
        if self.node_name.len() > crate::pool::MAX_NODE_NAME || self.primary.is_empty() {
            return Err(Error::invalid(format!(
                "cluster.node_name must be 1..={} bytes and cluster.primary must name the primary",
                crate::pool::MAX_NODE_NAME
            )));
        }
        let addr = if self.is_primary() { &self.peer_addr } else { &self.primary_addr };
        if addr.is_empty() {
            let which = if self.is_primary() { "cluster.peer_addr" } else { "cluster.primary_addr" };
            return Err(Error::invalid(format!("{which} is required for this node's role")));
        }
        self.validate_timings()
    }

    /// The Lease's name and namespace are Kubernetes object names (checked
    /// here rather than refused by the API server at every round).
    fn validate_kubernetes(&self) -> Result<()> {
        if self.peer_addr.is_empty() || self.node_name.len() > crate::pool::MAX_NODE_NAME {
            return Err(Error::invalid(format!(
                "cluster.election = \"kubernetes\" needs this node's cluster.peer_addr (the address the others \
                 reach it at) and a cluster.node_name of at most {} bytes",
                crate::pool::MAX_NODE_NAME
            )));
        }
        if !dns_name(&self.election_name, 253) {
            return Err(Error::invalid(format!(
                "cluster.election_name {:?} is not a Lease name (lowercase letters, digits, '-' and '.', \
                 starting and ending with a letter or digit, at most 253)",
                self.election_name
            )));
        }
        if !self.lease_namespace.is_empty()
            && (!dns_name(&self.lease_namespace, 63) || self.lease_namespace.contains('.'))
        {
            return Err(Error::invalid(format!(
                "cluster.lease_namespace {:?} is not a namespace name (lowercase letters, digits and '-', at most 63)",
                self.lease_namespace
            )));
        }
        self.validate_timings()
    }

    fn validate_timings(&self) -> Result<()> {
        if self.lease_ms == 0 || self.dead_after_ms <= self.lease_ms || self.heartbeat_ms * 2 > self.lease_ms {
            return Err(Error::invalid(
                "cluster timings must satisfy 2 * heartbeat_ms <= lease_ms < dead_after_ms".to_string(),
            ));
        }
        if self.hold_idle_ms > 60_000 {
            // A held key cannot be deleted or evicted: keep that short.
            return Err(Error::invalid(format!(
                "cluster.hold_idle_ms {} is over 60000 (a key a follower holds cannot be deleted or evicted)",
                self.hold_idle_ms
            )));
        }
        Ok(())
    }
}

/// A DNS-1123 subdomain of at most `max` bytes (Kubernetes object names).
fn dns_name(s: &str, max: usize) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !s.is_empty()
        && s.len() <= max
        && s.starts_with(alnum)
        && s.ends_with(alnum)
        && s.chars().all(|c| alnum(c) || c == '-' || c == '.')
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    pub backend: BackendKind,
    pub path: PathBuf,
    #[serde(deserialize_with = "de_size")]
    pub size: u64,
    #[serde(deserialize_with = "de_size")]
    pub region_size: u64,
    #[serde(deserialize_with = "de_size")]
    pub page_size: u64,
    pub prefault: bool,
    pub format: bool,
    /// Flush and invalidate cache lines (software) or not (hardware).
    pub coherence: crate::pool::Coherence,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub socket: PathBuf,
    pub socket_mode: String,
    /// Group of the socket file (name or gid); empty = the process's group.
    pub socket_group: String,
    pub tcp_addr: String,
    pub metrics_addr: String,
    pub shutdown_grace_ms: u64,
    /// Tenants with a metric series of their own (the rest, and all of them
    /// at 0, the default, go to `tenant="_other"`): tenant names are visible
    /// to whoever reaches /metrics, so they are opt-in.
    pub max_tenant_series: usize,
    /// Connections per listener (Unix socket, TCP, the peer port) at once;
    /// one more is accepted and closed at once.
    pub max_connections: usize,
    /// A connection whose first request (past the credential check) has
    /// not come within this is closed.
    pub handshake_timeout_ms: u64,
    /// A connection that sent nothing for this long is closed (its locks
    /// are released, as for any closed connection).
    pub idle_timeout_ms: u64,
    /// InlineGet streams open at once, per sidecar and per connection; one
    /// more is refused with RESOURCE_EXHAUSTED.
    pub max_inline_streams: usize,
    pub max_inline_streams_per_connection: usize,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistryConfig {
    pub eviction_policy: PolicyKind,
    /// `[registry.eviction.gd|kv|s3fifo|ttl]`: the settings of those policies.
    pub eviction: crate::eviction::PolicySettings,
    pub max_regions_per_instance: u32,
    pub reservation_timeout_ms: u64,
    pub lock_ttl_ms: u64,
    pub max_lock_ttl_ms: u64,
    pub max_key_bytes: usize,
    pub max_batch: usize,
    pub reap_interval_ms: u64,
    /// Most tenants with keys or reservations at once.
    pub max_tenants: usize,
    /// Refuse commits without a payload checksum.
    pub require_checksum: bool,
    /// Bytes one client connection may hold locked plus reserved at once
    /// (0: half of the pool's region space); past it a lookup or reserve
    /// gets RESOURCE_EXHAUSTED for that key.
    #[serde(deserialize_with = "de_size")]
    pub max_client_pinned_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    pub format: LogFormat,
    /// A tracing filter ("info", "cxlkv=debug"): free-form, checked by
    /// tracing when the logs start.
    pub level: String,
}

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl LogFormat {
    /// For the command line (the config file goes through serde).
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(Error::invalid(format!("log.format {other:?} must be \"text\" or \"json\""))),
        }
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            backend: BackendKind::Shm,
            path: "/dev/shm/cxlkv-pool".into(),
            size: 1 << 30,
            region_size: 256 << 20,
            page_size: 64 << 10,
            prefault: true,
            format: false,
            coherence: crate::pool::Coherence::Auto,
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            socket: "/tmp/cxlkv/cxlkv.sock".into(),
            socket_mode: "0660".into(),
            socket_group: String::new(),
            tcp_addr: String::new(),
            metrics_addr: "127.0.0.1:9464".into(),
            shutdown_grace_ms: 10_000,
            max_tenant_series: 0,
            max_connections: 1024,
            handshake_timeout_ms: 10_000,
            idle_timeout_ms: 300_000,
            max_inline_streams: 64,
            max_inline_streams_per_connection: 8,
        }
    }
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            eviction_policy: PolicyKind::DEFAULT,
            eviction: Default::default(),
            max_regions_per_instance: 0,
            reservation_timeout_ms: 10_000,
            lock_ttl_ms: 60_000,
            max_lock_ttl_ms: 600_000,
            max_key_bytes: 1024,
            max_batch: 4096,
            reap_interval_ms: 200,
            max_tenants: 1024,
            require_checksum: false,
            max_client_pinned_bytes: 0,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { format: LogFormat::Text, level: "info".into() }
    }
}

impl Config {
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::io(format!("read config {}", path.display()), e))?;
        Self::parse(&text).map_err(|e| Error::invalid(format!("config {}: {}", path.display(), e.message())))
    }

    pub fn parse(text: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| Error::invalid(e.to_string()))
    }

    /// This config once `validate` passed: what every command that reads a
    /// config uses it for.
    pub fn validated(self) -> Result<Self> {
        self.validate()?;
        Ok(self)
    }

    /// Checks that need more than parsing (modes, addresses, combinations);
    /// names from a fixed set are enums, refused by the parser.
    pub fn validate(&self) -> Result<()> {
        self.socket_mode()?;
        self.cluster.validate()?;
        self.quotas.validate()?;
        self.registry.eviction.validate()?;
        self.auth.validate(&self.tls)?;
        let s = &self.server;
        if s.max_connections == 0 || s.handshake_timeout_ms < 100 || s.idle_timeout_ms < s.handshake_timeout_ms {
            return Err(Error::invalid(
                "server.max_connections must be at least 1, handshake_timeout_ms at least 100 and idle_timeout_ms \
                 at least handshake_timeout_ms",
            ));
        }
        if s.max_inline_streams_per_connection == 0 || s.max_inline_streams < s.max_inline_streams_per_connection {
            return Err(Error::invalid(
                "server.max_inline_streams_per_connection must be at least 1 and at most server.max_inline_streams",
            ));
        }
        for (what, addr) in [("tcp_addr", &self.server.tcp_addr), ("metrics_addr", &self.server.metrics_addr)] {
            if !addr.is_empty() && addr.parse::<std::net::SocketAddr>().is_err() {
                return Err(Error::invalid(format!("server.{what} {addr:?} is not host:port")));
            }
        }
        Ok(())
    }

    pub fn socket_mode(&self) -> Result<u32> {
        u32::from_str_radix(self.server.socket_mode.trim_start_matches("0o"), 8)
            .map_err(|_| Error::invalid(format!("socket_mode {:?} is not an octal mode", self.server.socket_mode)))
    }
}

/// Parse "1GiB", "256MiB", "64k", "4096" (binary units; no suffix = bytes).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 =
        num.parse().map_err(|_| Error::invalid(format!("size {s:?}: expected a number with an optional unit")))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(Error::invalid(format!("size {s:?}: unknown unit {other:?}"))),
    };
    n.checked_mul(mult).ok_or_else(|| Error::invalid(format!("size {s:?} overflows")))
}

pub(crate) fn de_size<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum S {
        N(u64),
        S(String),
    }
    match S::deserialize(d)? {
        S::N(n) => Ok(n),
        S::S(s) => parse_size(&s).map_err(|e| serde::de::Error::custom(e.message().to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("64k").unwrap(), 64 << 10);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size(" 2 MiB ").unwrap(), 2 << 20);
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn shipped_example_documents_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/cxlkv.toml");
        assert_eq!(Config::load(&path).unwrap(), Config::default());
    }

    /// The README's table of registry defaults says what the code does: a
    /// default changed in one place fails here until the other follows.
    #[test]
    fn the_readme_table_of_defaults_is_the_code_s() {
        let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
        let code = toml::Value::try_from(Config::default().registry).unwrap();
        let mut checked = 0;
        let table = readme.split("| setting | default | why |").nth(1).expect("the README's table of defaults");
        for row in table.lines().skip(2).take_while(|l| l.starts_with('|')) {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let (key, shown) = (cells[1].trim_matches('`'), cells[2]);
            let Some(value) = code.get(key) else { continue }; // a flag or another section
            let said = match shown.split_once(' ') {
                Some((n, "s")) => toml::Value::Integer(n.parse::<i64>().unwrap() * 1000),
                Some((n, "min")) => toml::Value::Integer(n.parse::<i64>().unwrap() * 60_000),
                _ if shown == "off" => toml::Value::Boolean(false),
                _ if shown == "on" => toml::Value::Boolean(true),
                _ => toml::Value::Integer(shown.parse().unwrap_or_else(|_| panic!("README {key}: {shown:?}"))),
            };
            assert_eq!(&said, value, "README says {key} defaults to {shown}");
            checked += 1;
        }
        assert!(checked >= 5, "the README's table of registry defaults went missing ({checked} rows)");
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused() {
        assert!(Config::parse("[pool]\nsize = \"1GiB\"\nsiez = 3\n").is_err());
        assert!(Config::parse("[pool]\nsize = \"lots\"\n").is_err());
        let c = Config::parse("node_id = 3\n[pool]\nsize = \"2GiB\"\n").unwrap();
        assert_eq!((c.node_id, c.pool.size, c.pool.region_size), (3, 2 << 30, 256 << 20));
        assert_eq!(Config::default().socket_mode().unwrap(), 0o660);
        Config::default().validate().unwrap();
        let follower = "[cluster]\nnode_name = \"b\"\nprimary = \"a\"\nprimary_addr = \"10.0.0.1:50052\"";
        Config::parse(follower).unwrap().validate().unwrap();
        assert!(!Config::default().cluster.enabled(), "single node unless a node name is set");
        for bad in [
            "[pool]\nbackend = \"nvme\"",
            "[registry]\neviction_policy = \"mru\"",
            "[log]\nformat = \"xml\"",
            "[cluster]\nelection = \"raft\"",
        ] {
            assert!(Config::parse(bad).is_err(), "{bad}");
        }
        for bad in [
            "[server]\nsocket_mode = \"rw\"",
            "[server]\nmetrics_addr = \"localhost\"",
            "[cluster]\nnode_name = \"b\"",
            "[cluster]\nnode_name = \"b\"\nprimary = \"a\"",
            "[cluster]\nnode_name = \"a\"\nprimary = \"a\"",
            "[cluster]\nnode_name = \"a\"\nprimary = \"a\"\npeer_addr = \"x:1\"\nlease_ms = 5000",
        ] {
            assert!(Config::parse(bad).unwrap().validate().is_err(), "{bad}");
        }
        use crate::pool::Coherence;
        assert_eq!(Config::default().pool.coherence, Coherence::Auto);
        assert_eq!(Config::parse("[pool]\ncoherence = \"software\"").unwrap().pool.coherence, Coherence::Software);
        assert!(Config::parse("[pool]\ncoherence = \"sometimes\"").is_err());
        Config::parse("[pool]\nbackend = \"noncoherent-test\"").unwrap().validate().unwrap();
    }

    #[test]
    fn a_kubernetes_election_needs_a_peer_address_and_kubernetes_object_names() {
        let base = "[cluster]\nelection = \"kubernetes\"\nnode_name = \"worker-1\"\n";
        let ok = |extra: &str| Config::parse(&format!("{base}{extra}")).unwrap().validate();
        ok("peer_addr = \"10.0.0.1:50052\"").unwrap();
        ok("peer_addr = \"10.0.0.1:50052\"\nelection_name = \"cxlkv.primary-2\"\nlease_namespace = \"kv\"").unwrap();
        for (bad, says) in [
            ("", "peer_addr"),
            ("peer_addr = \"x:1\"\nelection_name = \"Primary\"", "not a Lease name"),
            ("peer_addr = \"x:1\"\nelection_name = \"a_b\"", "not a Lease name"),
            ("peer_addr = \"x:1\"\nlease_namespace = \"kv.system\"", "not a namespace"),
            ("peer_addr = \"x:1\"\nlease_namespace = \"-kv\"", "not a namespace"),
            ("peer_addr = \"x:1\"\nlease_ms = 5000", "timings"),
        ] {
            let e = ok(bad).unwrap_err();
            assert!(e.message().contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn a_name_outside_its_set_fails_at_parse_time_naming_the_valid_ones() {
        let refused = |text: &str| Config::parse(text).unwrap_err().message().to_owned();
        let e = refused("[pool]\nbackend = \"nvme\"");
        assert!(e.contains("nvme") && ["shm", "dax", "noncoherent-test"].iter().all(|v| e.contains(v)), "{e}");
        let e = refused("[registry]\neviction_policy = \"mru\"");
        assert!(e.contains("mru") && crate::eviction::POLICIES.iter().all(|v| e.contains(v)), "{e}");
        let e = refused("[cluster]\nelection = \"raft\"");
        assert!(e.contains("raft") && ["static", "etcd"].iter().all(|v| e.contains(v)), "{e}");
        let e = refused("[log]\nformat = \"xml\"");
        assert!(e.contains("xml") && ["text", "json"].iter().all(|v| e.contains(v)), "{e}");
        let e = refused("[pool]\ncoherence = \"sometimes\"");
        assert!(["auto", "hardware", "software"].iter().all(|v| e.contains(v)), "{e}");
        // The spellings accepted before these were enums still are.
        let c = Config::parse(
            "[pool]\nbackend = \"dax\"\n[registry]\neviction_policy = \"S3FIFO\"\n\
             [cluster]\nelection = \"etcd\"\n[log]\nformat = \"json\"",
        )
        .unwrap();
        assert_eq!(c.pool.backend, BackendKind::Dax);
        assert_eq!(c.registry.eviction_policy, PolicyKind::S3Fifo);
        assert_eq!(c.cluster.election, ElectionKind::Etcd);
        assert_eq!(c.log.format, LogFormat::Json);
        let c = Config::parse("[registry]\neviction_policy = \"default\"").unwrap();
        assert_eq!(c.registry.eviction_policy, PolicyKind::DEFAULT);
        // And print back as they are spelled in the shipped example.
        let text = toml::to_string(&Config::default()).unwrap();
        for line in ["backend = \"shm\"", "eviction_policy = \"gd\"", "election = \"static\"", "format = \"text\""] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }
}
