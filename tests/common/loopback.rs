//! A cluster primary in this process, its peer service on loopback TCP, and
//! a peer client to it: the registry boundary tests talk to it as a follower
//! does (`tests/directory.rs`, `tests/registration.rs`).
use std::sync::Arc;

use cxlkv::cluster::epoch::{Client, Stamp};
use cxlkv::cluster::notices::Notices;
use cxlkv::cluster::peer_service::PeerService;
use cxlkv::cluster::primary::Primary;
use cxlkv::config::ClusterConfig;
use cxlkv::handler::{Handler, Limits};
use cxlkv::peer_proto::peer_client::PeerClient;
use cxlkv::peer_proto::peer_server::PeerServer;
use cxlkv::pool::{Geometry, NodeId, Pool, PoolOptions, ShmBackend};
use cxlkv::registry::{LocalDirectory, LocalRegistry};

pub const PAGE: u64 = 64 << 10;

pub struct Loopback {
    pub pool: Arc<Pool>,
    pub handler: Arc<Handler>,
    pub primary: Arc<Primary>,
    pub ldir: Arc<LocalDirectory>,
    pub client: Client,
    pub tmp: tempfile::TempDir,
}

/// A 16 MiB pool of 2 MiB regions and `PAGE` pages in a temporary folder.
pub fn pool(dir: &std::path::Path) -> Arc<Pool> {
    let g = Geometry::for_capacity(16 << 20, 2 << 20, PAGE, 2 << 20).unwrap();
    let backend = Box::new(ShmBackend::open(&dir.join("pool"), g.pool_size, false).unwrap());
    Arc::new(Pool::open(backend, &PoolOptions { region_size: 2 << 20, page_size: PAGE, format: false }).unwrap().0)
}

/// Primary "p" of `cfg` (whose `node_name` is the follower's) serving.
pub async fn primary(cfg: &ClusterConfig) -> Loopback {
    let tmp = tempfile::tempdir().unwrap();
    let pool = pool(tmp.path());
    let pnode = pool.node_id_for("p").unwrap();
    let notices = Arc::new(Notices::default());
    let ldir = Arc::new(LocalDirectory::with_sink(Arc::new(LocalRegistry::new("lru", 64).unwrap()), notices.clone()));
    let limits = Limits { prefault: false, ..Limits::default() };
    let handler = Arc::new(Handler::with_directory(pool.clone(), NodeId(pnode), ldir.clone(), limits, true).unwrap());
    let primary = Arc::new(Primary::new(pool.clone(), pnode, ldir.clone(), notices, 7, cfg, 10_000));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let svc = PeerServer::new(PeerService::new(primary.clone(), handler.clone(), "p".into(), None));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
    );
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect_lazy();
    let client = PeerClient::with_interceptor(ch, Stamp::new(cxlkv::auth::BearerToken::default(), 0));
    Loopback { pool, handler, primary, ldir, client, tmp }
}
