//! Configuration: TOML file (every knob documented in config/cxlkv.toml, all
//! optional) overridden by command-line flags.
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use crate::cluster::config::{ClusterConfig, ElectionKind};
pub use crate::pool::config::PoolConfig;
pub use crate::registry::config::RegistryConfig;
pub use crate::units::{de_size, parse_size};

use crate::error::{Error, Result};

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
    pub events: crate::events::config::EventsConfig,
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
    /// Durable sessions a client may name (`crate::sessions`), open or
    /// lingering after their last connection; one more is RESOURCE_EXHAUSTED.
    pub max_sessions: usize,
    /// HTTP/2 streams one client connection may have open at once (every
    /// call is one): past it the client waits for one to end.
    pub http2_max_concurrent_streams: u32,
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
            max_sessions: 1024,
            http2_max_concurrent_streams: 256,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { format: LogFormat::Text, level: "info".into() }
    }
}

impl ServerConfig {
    /// The bounds every listener applies to its connections.
    pub fn conn_limits(&self) -> crate::conn::ConnLimits {
        crate::conn::ConnLimits {
            max: self.max_connections,
            handshake: std::time::Duration::from_millis(self.handshake_timeout_ms),
            idle: std::time::Duration::from_millis(self.idle_timeout_ms),
        }
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
        self.events.validate()?;
        self.registry.eviction.validate()?;
        self.registry.validate()?;
        self.auth.validate(&self.tls)?;
        let s = &self.server;
        if s.max_connections == 0 || s.handshake_timeout_ms < 100 || s.idle_timeout_ms < s.handshake_timeout_ms {
            return Err(Error::invalid(
                "server.max_connections must be at least 1, handshake_timeout_ms at least 100 and idle_timeout_ms \
                 at least handshake_timeout_ms",
            ));
        }
        if s.http2_max_concurrent_streams == 0 {
            return Err(Error::invalid("server.http2_max_concurrent_streams must be at least 1"));
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
#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::PolicyKind;
    use crate::pool::BackendKind;

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
