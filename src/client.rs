//! Client helpers for tools and tests: connect over a Unix socket or TCP.
use std::path::PathBuf;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::proto::cxlkv_client::CxlkvClient;
use crate::wire::MAX_MESSAGE;

pub type Client = CxlkvClient<Channel>;

pub async fn connect_uds(path: impl Into<PathBuf>) -> Result<Client, tonic::transport::Error> {
    Ok(wrap(channel_uds(path.into()).await?))
}

/// A channel to the sidecar's Unix socket (for clients of other services on it).
pub async fn channel_uds(path: PathBuf) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
        }))
        .await
}

/// Whether the sidecar behind `path` reports SERVING on the standard health
/// service: then every listener it was configured with is bound.
pub async fn is_ready_uds(path: impl Into<PathBuf>) -> bool {
    use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest};
    let Ok(ch) = channel_uds(path.into()).await else { return false };
    let r = HealthClient::new(ch).check(HealthCheckRequest { service: String::new() }).await;
    r.is_ok_and(|r| r.into_inner().status == ServingStatus::Serving as i32)
}

pub async fn connect_tcp(addr: &str) -> Result<Client, tonic::transport::Error> {
    Ok(wrap(Endpoint::from_shared(format!("http://{addr}"))?.tcp_nodelay(true).connect().await?))
}

fn wrap(channel: Channel) -> Client {
    CxlkvClient::new(channel).max_decoding_message_size(MAX_MESSAGE).max_encoding_message_size(MAX_MESSAGE)
}
