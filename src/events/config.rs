//! `[events]`: whether this node keeps an event stream, how it batches and
//! how much it keeps, and the ZMQ endpoints in vLLM's format.
use serde::{Deserialize, Serialize};

use super::zmq::{Endpoints, Format};
use super::Limits;
use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsConfig {
    /// Keep the stream (WatchEvents; ZMQ when an endpoint is set).
    pub enabled: bool,
    pub batch_events: usize,
    pub batch_delay_ms: u64,
    pub buffer_events: usize,
    pub ring_batches: usize,
    /// `tcp://host:port` of the ZMQ PUB socket ("": none).
    pub zmq_publish: String,
    /// `tcp://host:port` of the replay ROUTER socket ("": none).
    pub zmq_replay: String,
    /// ZMQ has no authentication: an address other than loopback must be
    /// asked for.
    pub allow_non_loopback: bool,
    pub topic: String,
    pub medium: String,
    pub block_size: u32,
}

impl Default for EventsConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            batch_events: 512,
            batch_delay_ms: 10,
            buffer_events: 65_536,
            ring_batches: 4_096,
            zmq_publish: String::new(),
            zmq_replay: String::new(),
            allow_non_loopback: false,
            topic: String::new(),
            medium: "cxl".into(),
            block_size: 256,
        }
    }
}

impl EventsConfig {
    pub fn limits(&self) -> Limits {
        Limits {
            batch_events: self.batch_events,
            batch_delay: std::time::Duration::from_millis(self.batch_delay_ms),
            buffer_events: self.buffer_events,
            ring_batches: self.ring_batches,
        }
    }

    pub fn format(&self) -> Format {
        Format { topic: self.topic.clone(), medium: self.medium.clone(), block_size: self.block_size }
    }

    /// The ZMQ endpoints, if both are set.
    pub fn endpoints(&self) -> Option<Endpoints> {
        (!self.zmq_publish.is_empty())
            .then(|| Endpoints { publish: self.zmq_publish.clone(), replay: self.zmq_replay.clone() })
    }

    pub fn validate(&self) -> Result<()> {
        if self.batch_events == 0 || self.buffer_events < self.batch_events || self.ring_batches == 0 {
            return Err(Error::invalid(
                "events.batch_events and ring_batches must be at least 1, buffer_events at least batch_events",
            ));
        }
        if !(1..=10_000).contains(&self.batch_delay_ms) {
            return Err(Error::invalid("events.batch_delay_ms must be 1 to 10000"));
        }
        if self.zmq_publish.is_empty() != self.zmq_replay.is_empty() {
            return Err(Error::invalid("events.zmq_publish and events.zmq_replay are set together, or neither"));
        }
        if (!self.zmq_publish.is_empty()) && !self.enabled {
            return Err(Error::invalid("events.zmq_publish is set but events.enabled is false"));
        }
        for at in [&self.zmq_publish, &self.zmq_replay].into_iter().filter(|a| !a.is_empty()) {
            let loopback = zmq_host(at)?;
            if !loopback && !self.allow_non_loopback {
                return Err(Error::invalid(format!(
                    "refusing to publish KV events on non-loopback {at}: ZMQ has no authentication, and the events \
                     name every tenant's keys; set events.allow_non_loopback = true to accept anyone who can reach it"
                )));
            }
        }
        Ok(())
    }
}

/// Whether a `tcp://ip:port` endpoint is loopback (an error if it is not
/// such an endpoint: a host name would be resolved by the ZMQ library,
/// and so could not be checked).
fn zmq_host(at: &str) -> Result<bool> {
    let bad = || Error::invalid(format!("events endpoint {at:?} is not tcp://ip:port"));
    let addr: std::net::SocketAddr = at.strip_prefix("tcp://").ok_or_else(bad)?.parse().map_err(|_| bad())?;
    Ok(addr.ip().to_canonical().is_loopback())
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
    fn zmq_binds_loopback_unless_asked_and_names_ip_addresses() {
        assert!(with("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", false).validate().is_ok());
        assert!(with("tcp://[::1]:5557", "tcp://[::1]:5558", false).validate().is_ok());
        let e = with("tcp://0.0.0.0:5557", "tcp://127.0.0.1:5558", false).validate().unwrap_err();
        assert!(e.to_string().contains("allow_non_loopback"), "{e}");
        assert!(with("tcp://0.0.0.0:5557", "tcp://0.0.0.0:5558", true).validate().is_ok());
        for bad in ["127.0.0.1:5557", "tcp://localhost:5557", "ipc:///tmp/x", "tcp://1.2.3.4"] {
            assert!(with(bad, "tcp://127.0.0.1:5558", true).validate().is_err(), "{bad}");
        }
        assert!(with("tcp://127.0.0.1:5557", "", false).validate().is_err(), "both or neither");
        assert!(EventsConfig::default().validate().is_ok());
    }
}
