//! The election's epoch on every peer call. A follower stamps each call with
//! the epoch of the term it follows; the primary serves only calls of its
//! own epoch. A call from an older epoch comes from a node that still
//! follows a deposed primary; a call from a newer one means this primary
//! was deposed (its lease refuses writes too; this refuses before any work
//! is done). Static clusters are epoch 0 throughout. The pool's words are
//! fenced separately (`pool/epoch.rs`).
use std::sync::atomic::AtomicU64;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::{Request, Status};

use crate::auth::BearerToken;
use crate::error::{Error, ErrorKind};

/// A follower's client of the primary's peer service: every call stamped.
pub type Client = crate::peer_proto::peer_client::PeerClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Stamp>,
>;

/// Identity of this node at the primary (changes when it joins again).
#[derive(Default)]
pub struct Ident {
    pub node: AtomicU64,
    pub instance: AtomicU64,
}

/// A whole-call gRPC failure of a forwarded call: the primary is
/// unreachable or too slow, so the caller answers fast (UNAVAILABLE).
pub fn unavailable(e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Unavailable, format!("the cluster's primary did not answer: {e}"))
}

/// The metadata key that carries the caller's epoch.
pub const EPOCH_HEADER: &str = "x-cxlkv-epoch";

/// A follower's peer-call interceptor: its token, then its term's epoch.
#[derive(Clone)]
pub struct Stamp {
    token: BearerToken,
    epoch: MetadataValue<Ascii>,
}

impl Stamp {
    pub fn new(token: BearerToken, epoch: u64) -> Self {
        Self { token, epoch: MetadataValue::from(epoch) }
    }
}

impl Interceptor for Stamp {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let mut req = self.token.call(req)?;
        req.metadata_mut().insert(EPOCH_HEADER, self.epoch.clone());
        Ok(req)
    }
}

/// The primary's check: a node's credential (never one bound to tenants:
/// the peer port can join nodes, delete any key and list every tenant's),
/// then its own epoch or nothing. Runs after the listener's token check,
/// which puts the credential's scope into the request.
#[derive(Clone, Copy)]
pub struct EpochCheck(pub u64);

impl Interceptor for EpochCheck {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        if matches!(req.extensions().get::<crate::registry::Scope>(), Some(crate::registry::Scope::Tenants(_))) {
            crate::auth::refused("peer", "tenant_bound", 1);
            return Err(Status::permission_denied(
                "the peer port takes node credentials only (an operator token or certificate); this one is bound \
                 to tenants",
            ));
        }
        let theirs = req.metadata().get(EPOCH_HEADER).and_then(|v| v.to_str().ok()).and_then(|s| s.parse::<u64>().ok());
        let mine = self.0;
        let refuse = |caller: &'static str, msg: String| {
            metrics::counter!(crate::metric_names::CLUSTER_EPOCH_REFUSALS, "caller" => caller).increment(1);
            Err(Status::failed_precondition(msg))
        };
        match theirs {
            Some(e) if e == mine => Ok(req),
            Some(e) if e < mine => refuse(
                "older",
                format!("peer call of epoch {e}; the primary leads epoch {mine}: follow the current primary"),
            ),
            Some(e) => refuse("newer", format!("peer call of epoch {e}; this primary's epoch {mine} was superseded")),
            None => Err(Status::invalid_argument(format!("peer call without {EPOCH_HEADER}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamped(epoch: u64) -> Request<()> {
        Stamp::new(BearerToken::default(), epoch).call(Request::new(())).unwrap()
    }

    #[test]
    fn only_calls_of_the_primary_s_own_epoch_pass() {
        let mut check = EpochCheck(7);
        assert!(check.call(stamped(7)).is_ok());
        let older = check.call(stamped(6)).unwrap_err();
        assert_eq!(older.code(), tonic::Code::FailedPrecondition);
        assert!(
            older.message().contains("epoch 6") && older.message().contains("leads epoch 7"),
            "{}",
            older.message()
        );
        let newer = check.call(stamped(8)).unwrap_err();
        assert_eq!(newer.code(), tonic::Code::FailedPrecondition);
        assert!(newer.message().contains("superseded"), "{}", newer.message());
        assert_eq!(check.call(Request::new(())).unwrap_err().code(), tonic::Code::InvalidArgument);
        assert!(EpochCheck(0).call(stamped(0)).is_ok(), "static clusters: epoch 0 on both sides");
    }
}
