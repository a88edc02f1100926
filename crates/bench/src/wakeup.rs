//! `cxlkv-bench wakeup`: what this host charges for waking a thread, the
//! baseline of every latency figure (a gRPC call is two wake-ups or more:
//! the server's on the request, the client's on the reply). Two threads
//! ping-pong one byte over a Unix socket pair, as a client and the sidecar
//! do over theirs; a round trip is two wake-ups. On a VM whose idle vCPUs
//! halt, each one is a VM exit, and the figure moves from run to run with
//! the host's load: the latency rows of the same run are read against it.
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use crate::figures::{bench, pct};

/// `n` round trips back to back, in µs (as the control bench's client
/// sends its calls).
fn round_trips(n: usize) -> Vec<f64> {
    let (mut a, mut b) = UnixStream::pair().expect("socket pair");
    let echo = std::thread::spawn(move || {
        let mut byte = [0u8; 1];
        while b.read_exact(&mut byte).is_ok() {
            if b.write_all(&byte).is_err() {
                break;
            }
        }
    });
    let mut us = Vec::with_capacity(n);
    let mut byte = [0u8; 1];
    for _ in 0..n {
        let t = Instant::now();
        a.write_all(&byte).unwrap();
        a.read_exact(&mut byte).unwrap();
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(a);
    echo.join().unwrap();
    us
}

pub fn wakeup(n: usize) {
    let mut us = round_trips(n);
    bench("wakeup_rtt_us_p50", pct(&mut us, 0.5));
    bench("wakeup_rtt_us_p99", pct(&mut us, 0.99));
}
