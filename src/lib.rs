//! cxlkv: a per-node sidecar that shares KV-cache chunks through a CXL pool.
//! Data flows one way: rpc → handler → allocator/registry → pool.
pub mod allocator;
pub mod client;
pub mod config;
pub mod error;
pub mod eviction;
pub mod handler;
pub mod metrics;
pub mod pool;
pub mod registry;
pub mod replay;
pub mod rpc;
pub mod server;
pub mod status;

pub mod proto {
    tonic::include_proto!("cxlkv.v1");
}
