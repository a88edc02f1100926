//! Limits of the wire format that the server and every client must agree
//! on, in one place both sides use.

/// Largest gRPC message either side encodes or accepts (a batch of 4096
/// keys of up to 1 KiB each fits with room to spare).
pub const MAX_MESSAGE: usize = 64 << 20;

/// Chunk size of the inline-bytes streams (InlinePut, InlineGet).
pub const INLINE_CHUNK: usize = 1 << 20;
