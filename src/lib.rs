//! cxlkv: a per-node sidecar that shares KV-cache chunks through a CXL pool.
//! Data flows one way: rpc → handler → allocator/registry → pool.
// `unsafe` is allowed in one place only: the pool's mappings
// (`pool/mapping.rs`), where every block carries a SAFETY note.
#![deny(unsafe_code)]
#![warn(clippy::undocumented_unsafe_blocks)]
pub mod allocator;
pub mod auth;
pub mod client;
pub mod codec;
pub mod config;
pub mod conn;
pub mod error;
pub mod eviction;
pub mod handler;
pub mod metrics;
pub mod pool;
pub mod rebuild;
pub mod registry;
pub mod replay;
pub mod rpc;
pub mod server;
pub mod status;

pub mod proto {
    tonic::include_proto!("cxlkv.v1");
}
