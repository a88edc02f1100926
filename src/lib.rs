//! cxlkv: a per-node sidecar that shares KV-cache chunks through a CXL pool.
//! Data flows one way: rpc → handler → allocator/registry → pool.
// `unsafe` is allowed in three places only: the pool's mappings
// (`pool/mapping.rs`), the CPU's instructions (`cpu.rs`: cache-line
// write-backs, streaming stores, the prefetch hint) and one system call
// (`platform::lower_thread_priority`), where every block carries a SAFETY
// note.
#![deny(unsafe_code)]
#![warn(clippy::undocumented_unsafe_blocks)]
pub mod allocator;
pub mod auth;
pub mod client;
pub mod cluster;
pub(crate) mod codec;
pub mod config;
pub mod conn;
#[allow(unsafe_code)]
pub(crate) mod cpu;
pub mod election;
pub mod error;
pub(crate) mod events;
pub mod eviction;
pub mod handler;
pub mod ids;
pub(crate) mod metric_names;
pub mod metrics;
pub(crate) mod node;
pub(crate) mod platform;
pub mod pool;
pub(crate) mod rebuild;
pub(crate) mod regions;
pub mod registry;
pub mod rpc;
pub mod server;
pub(crate) mod sessions;
pub mod status;
pub(crate) mod units;
pub mod wire;

/// Generated code, nested as the protobuf packages are (the peer service
/// refers to the client API's messages by relative path).
mod generated {
    pub mod cxlkv {
        pub mod v1 {
            tonic::include_proto!("cxlkv.v1");
        }
        pub mod peer {
            pub mod v1 {
                tonic::include_proto!("cxlkv.peer.v1");
            }
        }
    }
}
/// The slice of etcd's v3 API the `etcd` election uses (siblings, as the
/// generated code refers to each other's messages by relative path).
pub mod etcd_proto {
    #![allow(missing_docs)]
    pub mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
    }
    pub mod mvccpb {
        tonic::include_proto!("mvccpb");
    }
    pub mod v3electionpb {
        tonic::include_proto!("v3electionpb");
    }
}
/// The peer service between the sidecars of one pool.
pub use generated::cxlkv::peer::v1 as peer_proto;
/// The client API.
pub use generated::cxlkv::v1 as proto;
