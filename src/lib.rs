//! cxlkv: a per-node sidecar that shares KV-cache chunks through a CXL pool.
//! Data flows one way: rpc → handler → allocator/registry → pool.
pub mod allocator;
pub mod error;
pub mod eviction;
pub mod pool;
pub mod registry;

pub mod proto {
    tonic::include_proto!("cxlkv.v1");
}
