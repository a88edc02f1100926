//! What the server and every client (the plugin, the CLI, a follower
//! forwarding to its primary) must agree on, in one place both sides use:
//! the wire's limits, the client's deadline on forwarded calls, and the
//! conversions between the registry's types and the messages (the gRPC
//! code of each error kind is `error.rs`'s, both ways).

pub mod deadline;

/// Largest gRPC message either side encodes or accepts (a batch of 4096
/// keys of up to 1 KiB each fits with room to spare).
pub const MAX_MESSAGE: usize = 64 << 20;

/// Largest peer message (a follower's forwarded batch, the primary's
/// reply): one client call of `MAX_MESSAGE` forwarded whole, plus what the
/// forwarding adds (session, scope, framing). The batcher never coalesces
/// calls past `MAX_MESSAGE` in all.
pub const MAX_PEER_MESSAGE: usize = MAX_MESSAGE + (1 << 20);

/// Chunk size of the inline-bytes streams (InlinePut, InlineGet).
pub const INLINE_CHUNK: usize = 1 << 20;

/// Request metadata a Reserve may carry: `exempt` asks for pages that
/// admission does not judge (buffers under placeholder keys, which no
/// reader will ask for: the plugin's allocations outside a store; the
/// store of the real key is judged). Any other value, or none: judged.
pub const ADMISSION_HEADER: &str = "cxlkv-admission";

/// Whether a Reserve's metadata exempts it from admission.
pub fn admission_exempt<T>(req: &tonic::Request<T>) -> bool {
    req.metadata().get(ADMISSION_HEADER).is_some_and(|v| v.as_bytes() == b"exempt")
}
