//! `[events]`: whether this node keeps an event stream, how it batches and
//! how much it keeps (in events and bytes), the gRPC streams' bounds, and
//! ZMQ in vLLM's format: endpoints, contract, topic, medium, block size and
//! what peers may hold.
use serde::{Deserialize, Serialize};

use super::vllm::{Form, Format};
use super::Limits;
use crate::error::{Error, Result};
use crate::units::de_size;

/// What HTTP/2 (hyper's `max_send_buf_size` default) buffers for one
/// stream whose peer does not read.
pub const H2_STREAM_BYTES: u64 = 400 << 10;

/// The ZMQ endpoints (`tcp://host:port`; a bound one may be `tcp://*:port`).
#[derive(Debug, Clone, Default)]
pub struct Endpoints {
    pub publish: String,
    pub connect: Vec<String>,
    pub replay: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsConfig {
    /// Keep the stream (WatchEvents; ZMQ when an endpoint is set).
    pub enabled: bool,
    pub batch_events: usize,
    #[serde(deserialize_with = "de_size")]
    pub batch_bytes: u64,
    pub batch_delay_ms: u64,
    pub buffer_events: usize,
    #[serde(deserialize_with = "de_size")]
    pub buffer_bytes: u64,
    pub ring_batches: usize,
    #[serde(deserialize_with = "de_size")]
    pub ring_bytes: u64,
    /// Token ids held from reservations to their commits.
    #[serde(deserialize_with = "de_size")]
    pub token_bytes: u64,
    /// Token ids one stored item may carry.
    pub max_item_tokens: usize,
    /// gRPC WatchEvents streams: per sidecar, per connection, and the bytes
    /// one stream may queue.
    pub max_streams: usize,
    pub max_streams_per_connection: usize,
    #[serde(deserialize_with = "de_size")]
    pub stream_bytes: u64,
    /// `tcp://ip:port` (or `tcp://*:port`) the ZMQ PUB socket binds ("": none).
    pub zmq_publish: String,
    /// `tcp://host:port` of routers' bound SUB sockets the PUB dials.
    pub zmq_connect: Vec<String>,
    /// `tcp://ip:port` of the replay ROUTER socket ("": none).
    pub zmq_replay: String,
    /// ZMQ has no authentication: an address other than loopback must be
    /// asked for.
    pub allow_non_loopback: bool,
    /// Connections each ZMQ socket serves (and as many in their handshake).
    pub zmq_max_peers: usize,
    #[serde(deserialize_with = "de_size")]
    pub zmq_queue_bytes: u64,
    #[serde(deserialize_with = "de_size")]
    pub zmq_replay_bytes: u64,
    /// "vllm" (vLLM 0.26 on: map events, three-frame replays) or
    /// "vllm-array" (the contract before it).
    pub format: String,
    pub topic: String,
    pub medium: String,
    /// The router's block size: a chunk's tokens are announced in blocks
    /// of this many.
    pub block_size: u32,
}

impl Default for EventsConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            batch_events: 512,
            batch_bytes: 64 << 10,
            batch_delay_ms: 10,
            buffer_events: 65_536,
            buffer_bytes: 8 << 20,
            ring_batches: 4_096,
            ring_bytes: 16 << 20,
            token_bytes: 4 << 20,
            max_item_tokens: 8_192,
            max_streams: 32,
            max_streams_per_connection: 4,
            stream_bytes: 256 << 10,
            zmq_publish: String::new(),
            zmq_connect: vec![],
            zmq_replay: String::new(),
            allow_non_loopback: false,
            zmq_max_peers: 16,
            zmq_queue_bytes: 1 << 20,
            zmq_replay_bytes: 16 << 20,
            format: "vllm".into(),
            topic: "kv@pool:cxlkv@{model}".into(),
            medium: "SHARED".into(),
            block_size: 16,
        }
    }
}

impl EventsConfig {
    pub fn limits(&self) -> Limits {
        Limits {
            batch_events: self.batch_events,
            batch_bytes: self.batch_bytes as usize,
            batch_delay: std::time::Duration::from_millis(self.batch_delay_ms),
            buffer_events: self.buffer_events,
            buffer_bytes: self.buffer_bytes as usize,
            ring_batches: self.ring_batches,
            ring_bytes: self.ring_bytes as usize,
            staged_bytes: self.token_bytes as usize,
            per_model: self.topic.contains("{model}"),
        }
    }

    pub fn format(&self) -> Format {
        let form = if self.format == "vllm-array" { Form::Array } else { Form::Map };
        Format { form, topic: self.topic.clone(), medium: self.medium.clone(), block_size: self.block_size }
    }

    /// The ZMQ endpoints, if any is set.
    pub fn endpoints(&self) -> Option<Endpoints> {
        (!self.zmq_publish.is_empty() || !self.zmq_connect.is_empty()).then(|| Endpoints {
            publish: self.zmq_publish.clone(),
            connect: self.zmq_connect.clone(),
            replay: self.zmq_replay.clone(),
        })
    }

    /// The most bytes the event plane holds with this configuration
    /// (docs/EVENTS.md "Memory"): the buffer, the ring, staged tokens, the
    /// gRPC streams and the ZMQ sockets. The hash set (per live key) is
    /// not in it.
    pub fn bound_bytes(&self) -> u64 {
        // Per stream: its queue, a batch read and its message (twice the
        // batch), the message tonic encodes, HTTP/2's send buffer.
        let grpc = self.max_streams as u64 * (self.stream_bytes + 4 * self.batch_bytes + H2_STREAM_BYTES);
        // Per socket (PUB, replay): per peer its queue (a replay peer: what
        // it reads at once) and write buffer; the PUB's replay ring.
        let per_peer = self.zmq_queue_bytes + (64 << 10);
        let zmq = if self.endpoints().is_some() {
            self.zmq_replay_bytes + 2 * self.zmq_max_peers as u64 * per_peer
        } else {
            0
        };
        self.buffer_bytes + self.ring_bytes + self.token_bytes + grpc + zmq
    }

    pub fn validate(&self) -> Result<()> {
        if self.batch_events == 0 || self.buffer_events < self.batch_events || self.ring_batches == 0 {
            return Err(Error::invalid(
                "events.batch_events and ring_batches must be at least 1, buffer_events at least batch_events",
            ));
        }
        if self.batch_bytes == 0 || self.buffer_bytes < self.batch_bytes || self.ring_bytes < self.batch_bytes {
            return Err(Error::invalid(
                "events.batch_bytes must be at least 1, buffer_bytes and ring_bytes at least it",
            ));
        }
        if !(1..=10_000).contains(&self.batch_delay_ms) {
            return Err(Error::invalid("events.batch_delay_ms must be 1 to 10000"));
        }
        if self.max_streams == 0 || self.max_streams_per_connection == 0 || self.stream_bytes == 0 {
            return Err(Error::invalid(
                "events.max_streams, max_streams_per_connection and stream_bytes must be at least 1",
            ));
        }
        if self.zmq_max_peers == 0 || self.zmq_queue_bytes == 0 || self.zmq_replay_bytes == 0 || self.block_size == 0 {
            return Err(Error::invalid(
                "events.zmq_max_peers, zmq_queue_bytes, zmq_replay_bytes and block_size must be at least 1",
            ));
        }
        if !["vllm", "vllm-array"].contains(&self.format.as_str()) {
            return Err(Error::invalid(
                "events.format is \"vllm\" (vLLM 0.26 and later) or \"vllm-array\" (before 0.26)",
            ));
        }
        let zmq = self.endpoints().is_some();
        if !self.zmq_replay.is_empty() && !zmq {
            return Err(Error::invalid(
                "events.zmq_replay replays what the PUB socket sends: set zmq_publish or zmq_connect",
            ));
        }
        if zmq && !self.enabled {
            return Err(Error::invalid("events.zmq_publish or zmq_connect is set but events.enabled is false"));
        }
        for at in [&self.zmq_publish, &self.zmq_replay].into_iter().filter(|a| !a.is_empty()) {
            self.allowed(at, bind_addr(at)?.ip().to_canonical().is_loopback())?;
        }
        for at in &self.zmq_connect {
            self.allowed(at, connect_is_loopback(at)?)?;
        }
        Ok(())
    }

    fn allowed(&self, at: &str, loopback: bool) -> Result<()> {
        if !loopback && !self.allow_non_loopback {
            return Err(Error::invalid(format!(
                "refusing to publish KV events on non-loopback {at}: ZMQ has no authentication, and the events \
                 name every tenant's keys; set events.allow_non_loopback = true to accept anyone who can reach it"
            )));
        }
        Ok(())
    }
}

/// The address a bound endpoint takes: `tcp://ip:port`, or `tcp://*:port`
/// for every interface (a host name is refused: the ZMQ library would
/// resolve it, and so it could not be checked).
pub fn bind_addr(at: &str) -> Result<std::net::SocketAddr> {
    let bad = || Error::invalid(format!("events endpoint {at:?} is not tcp://ip:port or tcp://*:port"));
    let rest = at.strip_prefix("tcp://").ok_or_else(bad)?;
    if let Some(port) = rest.strip_prefix("*:") {
        return Ok(std::net::SocketAddr::from(([0, 0, 0, 0], port.parse().map_err(|_| bad())?)));
    }
    rest.parse().map_err(|_| bad())
}

/// Whether a dialed `tcp://host:port` is a loopback address (a host name
/// is not known to be).
fn connect_is_loopback(at: &str) -> Result<bool> {
    let bad = || Error::invalid(format!("events.zmq_connect endpoint {at:?} is not tcp://host:port"));
    let rest = at.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    port.parse::<u16>().map_err(|_| bad())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Ok(host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.to_canonical().is_loopback()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(publish: &str, replay: &str, open: bool) -> EventsConfig {
        EventsConfig {
            zmq_publish: publish.into(),
            zmq_replay: replay.into(),
            allow_non_loopback: open,
            ..Default::default()
        }
    }

    #[test]
    fn zmq_binds_loopback_unless_asked_and_names_ip_addresses_or_every_interface() {
        assert!(with("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", false).validate().is_ok());
        assert!(with("tcp://[::1]:5557", "tcp://[::1]:5558", false).validate().is_ok());
        let e = with("tcp://0.0.0.0:5557", "tcp://127.0.0.1:5558", false).validate().unwrap_err();
        assert!(e.to_string().contains("allow_non_loopback"), "{e}");
        assert!(with("tcp://*:5557", "", false).validate().is_err(), "every interface is not loopback");
        assert!(with("tcp://*:5557", "tcp://0.0.0.0:5558", true).validate().is_ok());
        for bad in ["127.0.0.1:5557", "tcp://localhost:5557", "ipc:///tmp/x", "tcp://1.2.3.4", "tcp://*:x"] {
            assert!(with(bad, "tcp://127.0.0.1:5558", true).validate().is_err(), "{bad}");
        }
        assert!(with("", "tcp://127.0.0.1:5558", false).validate().is_err(), "a replay needs a PUB");
        assert!(with("tcp://127.0.0.1:5557", "", false).validate().is_ok(), "a PUB without replay");
        assert!(EventsConfig::default().validate().is_ok());
    }

    #[test]
    fn a_pub_may_dial_routers_loopback_unless_asked() {
        let dial = |to: &str, open: bool| EventsConfig {
            zmq_connect: vec![to.into()],
            allow_non_loopback: open,
            ..Default::default()
        };
        assert!(dial("tcp://127.0.0.1:5557", false).validate().is_ok());
        assert!(dial("tcp://router.llm-d:5557", false).validate().is_err(), "a host name needs allow_non_loopback");
        assert!(dial("tcp://router.llm-d:5557", true).validate().is_ok());
        assert!(dial("router:5557", true).validate().is_err());
    }

    #[test]
    fn the_default_contract_is_vllm_026s_and_the_older_one_is_selectable() {
        assert_eq!(EventsConfig::default().format().form, Form::Map);
        let old = EventsConfig { format: "vllm-array".into(), ..Default::default() };
        assert_eq!(old.format().form, Form::Array);
        assert!(EventsConfig { format: "vllm-0.1".into(), ..Default::default() }.validate().is_err());
    }

    #[test]
    fn the_defaults_fit_the_shipped_pod_limit_with_room_for_the_registry() {
        // deploy/kubernetes: 512Mi; the event plane's bound with both ZMQ
        // sockets on must leave most of it to the registry and the rest.
        let cfg = EventsConfig {
            zmq_publish: "tcp://127.0.0.1:5557".into(),
            zmq_replay: "tcp://127.0.0.1:5558".into(),
            ..Default::default()
        };
        assert!(cfg.bound_bytes() <= 160 << 20, "{} MiB", cfg.bound_bytes() >> 20);
    }
}
