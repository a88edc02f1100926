//! The client's deadline (its `grpc-timeout`), carried from the RPC edge to
//! the calls a follower forwards, so a forwarded call never outlives the
//! client that waits for it.
use std::time::{Duration, Instant};

tokio::task_local! {
    /// When the client stops waiting for the request being served.
    pub static DEADLINE: Option<Instant>;
}

/// The deadline a request's `grpc-timeout` header sets, if any.
pub fn of<T>(req: &tonic::Request<T>) -> Option<Instant> {
    let v = req.metadata().get("grpc-timeout")?.to_str().ok()?;
    parse(v).map(|d| Instant::now() + d)
}

/// A `grpc-timeout` value: up to 8 digits and a unit (H, M, S, m, u, n).
pub fn parse(v: &str) -> Option<Duration> {
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (n, unit) = v.split_at(v.len() - 1);
    let n: u64 = n.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// How long a forwarded call may wait: `cap`, or less when the client's
/// deadline is nearer.
pub fn budget(cap: Duration) -> Duration {
    let now = Instant::now();
    match DEADLINE.try_with(|d| *d).ok().flatten() {
        Some(d) => d.saturating_duration_since(now).min(cap),
        None => cap,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse() {
        assert_eq!(parse("100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse("7u"), Some(Duration::from_micros(7)));
        for bad in ["", "m", "10", "10x", "123456789m", "-1S"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[tokio::test]
    async fn the_nearer_of_the_cap_and_the_clients_deadline_wins() {
        let cap = Duration::from_secs(1);
        assert_eq!(budget(cap), cap, "no client deadline");
        let near = Some(Instant::now() + Duration::from_millis(100));
        let b = DEADLINE.scope(near, async { budget(cap) }).await;
        assert!(b <= Duration::from_millis(100));
        let far = Some(Instant::now() + Duration::from_secs(60));
        assert_eq!(DEADLINE.scope(far, async { budget(cap) }).await, cap);
    }
}
