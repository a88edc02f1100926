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
