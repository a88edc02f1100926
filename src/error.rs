//! One error type for the whole sidecar, classified by kind (foyer-style), so
//! every layer can say *what* went wrong and the RPC layer maps kinds to codes.
//! The mapping between kinds and gRPC codes is here, both ways, so the
//! server's answers and a caller's reading of them (a follower forwarding to
//! the primary) cannot drift apart.
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request itself is malformed (sizes, key length, unknown region).
    InvalidArgument,
    NotFound,
    AlreadyExists,
    /// No space left even after eviction.
    ResourceExhausted,
    /// The state does not allow it (locked, already committed, in use).
    FailedPrecondition,
    /// Another client's reservation (or, later, lock).
    PermissionDenied,
    /// Shutting down, not ready, or a peer is unreachable.
    Unavailable,
    /// The client's deadline passed before the request was processed.
    DeadlineExceeded,
    /// The client broke off its own stream.
    Cancelled,
    /// An object went away while it was being read (the read is void).
    Aborted,
    /// Not an error: admission declined a store (a per-item outcome of a
    /// reserve or an inline put; the client skips the store, nothing is
    /// reserved). Answered as ABORTED, which no other per-item status is.
    NotAdmitted,
    /// A position no longer (or not yet) held: an event sequence outside
    /// what a source keeps for replay.
    OutOfRange,
    /// On-pool metadata is not a cxlkv pool or is damaged.
    Corrupt,
    Io,
    Internal,
}

#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    /// Borrowed when static: a refusal repeated for every item of a large
    /// batch then costs no allocation per item.
    msg: Cow<'static, str>,
    /// The underlying error, for logs that walk the chain; its text is in
    /// `msg` already. Shared so that `Error` stays `Clone`.
    source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, msg: impl Into<Cow<'static, str>>) -> Self {
        Self { kind, msg: msg.into(), source: None }
    }
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
    pub fn message(&self) -> &str {
        &self.msg
    }
    pub fn invalid(msg: impl Into<Cow<'static, str>>) -> Self {
        Self::new(ErrorKind::InvalidArgument, msg)
    }
    pub fn precondition(msg: impl Into<Cow<'static, str>>) -> Self {
        Self::new(ErrorKind::FailedPrecondition, msg)
    }
    pub fn io(ctx: impl fmt::Display, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::new(ErrorKind::Io, format!("{ctx}: {e}")).with_source(e)
    }
    /// Keep `e` as this error's source.
    pub fn with_source(mut self, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(e));
        self
    }
    pub fn corrupt(msg: impl Into<Cow<'static, str>>) -> Self {
        Self::new(ErrorKind::Corrupt, msg)
    }
    /// A store admission declined (see `ErrorKind::NotAdmitted`).
    pub fn not_admitted() -> Self {
        Self::new(
            ErrorKind::NotAdmitted,
            "not admitted: the pool is full and this key has not been seen lately; nothing was reserved \
             (skip the store: a second store of the key is admitted)",
        )
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.msg)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
    }
}

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
            ErrorKind::Aborted | ErrorKind::NotAdmitted => Code::Aborted,
            ErrorKind::OutOfRange => Code::OutOfRange,
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
            Code::OutOfRange => ErrorKind::OutOfRange,
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
        Error::new(kind, s.message().to_owned()).with_source(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn an_io_error_keeps_its_source_and_its_text() {
        let e = Error::io("read x", std::io::Error::from(std::io::ErrorKind::NotFound));
        assert_eq!(e.to_string(), "Io: read x: entity not found");
        let source = e.source().expect("the io::Error is kept");
        assert_eq!(source.downcast_ref::<std::io::Error>().unwrap().kind(), std::io::ErrorKind::NotFound);
        assert!(e.clone().source().is_some(), "clones share it");
        assert!(Error::invalid("x").source().is_none());
    }
}

#[cfg(test)]
mod code_tests {
    use super::*;
    use std::error::Error as _;

    const KINDS: [ErrorKind; 14] = [
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
        ErrorKind::OutOfRange,
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
