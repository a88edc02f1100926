//! What the server and every client (the plugin, the CLI, a follower
//! forwarding to its primary) must agree on, in one place both sides use:
//! the wire's limits, and the gRPC code each error kind travels as.
use crate::error::{Error, ErrorKind};

pub mod convert;
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

impl ErrorKind {
    /// The gRPC code this kind is answered with.
    pub fn code(self) -> tonic::Code {
        use tonic::Code;
        match self {
            ErrorKind::InvalidArgument => Code::InvalidArgument,
            ErrorKind::NotFound => Code::NotFound,
            ErrorKind::AlreadyExists => Code::AlreadyExists,
            ErrorKind::ResourceExhausted => Code::ResourceExhausted,
            ErrorKind::FailedPrecondition => Code::FailedPrecondition,
            ErrorKind::PermissionDenied => Code::PermissionDenied,
            ErrorKind::Unavailable => Code::Unavailable,
            ErrorKind::DeadlineExceeded => Code::DeadlineExceeded,
            ErrorKind::Cancelled => Code::Cancelled,
            ErrorKind::Aborted => Code::Aborted,
            ErrorKind::Corrupt => Code::DataLoss,
            ErrorKind::Io | ErrorKind::Internal => Code::Internal,
        }
    }

    /// The kind a gRPC code from a cxlkv peer stands for: `None` for OK;
    /// `Internal` for a code no kind is answered with (and for `Io`, which
    /// is answered as `Internal`).
    pub fn from_code(code: tonic::Code) -> Option<Self> {
        use tonic::Code;
        Some(match code {
            Code::Ok => return None,
            Code::InvalidArgument => ErrorKind::InvalidArgument,
            Code::NotFound => ErrorKind::NotFound,
            Code::AlreadyExists => ErrorKind::AlreadyExists,
            Code::ResourceExhausted => ErrorKind::ResourceExhausted,
            Code::FailedPrecondition => ErrorKind::FailedPrecondition,
            Code::PermissionDenied => ErrorKind::PermissionDenied,
            Code::Unavailable => ErrorKind::Unavailable,
            Code::DeadlineExceeded => ErrorKind::DeadlineExceeded,
            Code::Cancelled => ErrorKind::Cancelled,
            Code::Aborted => ErrorKind::Aborted,
            Code::DataLoss => ErrorKind::Corrupt,
            _ => ErrorKind::Internal,
        })
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        tonic::Status::new(e.kind().code(), e.message())
    }
}

/// A failed call to a cxlkv peer, as the error the peer answered with (the
/// status stays the source). A status that says OK is no answer at all:
/// `Internal`.
impl From<tonic::Status> for Error {
    fn from(s: tonic::Status) -> Self {
        let kind = ErrorKind::from_code(s.code()).unwrap_or(ErrorKind::Internal);
        Error::new(kind, s.message()).with_source(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    const KINDS: [ErrorKind; 13] = [
        ErrorKind::InvalidArgument,
        ErrorKind::NotFound,
        ErrorKind::AlreadyExists,
        ErrorKind::ResourceExhausted,
        ErrorKind::FailedPrecondition,
        ErrorKind::PermissionDenied,
        ErrorKind::Unavailable,
        ErrorKind::DeadlineExceeded,
        ErrorKind::Cancelled,
        ErrorKind::Aborted,
        ErrorKind::Corrupt,
        ErrorKind::Io,
        ErrorKind::Internal,
    ];

    #[test]
    fn every_kind_survives_a_trip_through_a_grpc_status() {
        for kind in KINDS {
            let status = tonic::Status::from(Error::new(kind, "why"));
            assert_eq!((status.code(), status.message()), (kind.code(), "why"));
            let back = Error::from(status);
            // Io is answered as Internal: the one kind without a code of its own.
            let want = if kind == ErrorKind::Io { ErrorKind::Internal } else { kind };
            assert_eq!((back.kind(), back.message()), (want, "why"), "{kind:?}");
            assert!(back.source().is_some());
        }
        assert_eq!(ErrorKind::from_code(tonic::Code::Ok), None);
        assert_eq!(Error::from(tonic::Status::ok("")).kind(), ErrorKind::Internal);
        assert_eq!(ErrorKind::from_code(tonic::Code::Unauthenticated), Some(ErrorKind::Internal));
    }
}
