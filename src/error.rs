//! One error type for the whole sidecar, classified by kind (foyer-style), so
//! every layer can say *what* went wrong and the RPC layer maps kinds to codes.
use std::fmt;

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
    /// On-pool metadata is not a cxlkv pool or is damaged.
    Corrupt,
    Io,
    Internal,
}

#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    msg: String,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, msg: impl Into<String>) -> Self {
        Self { kind, msg: msg.into() }
    }
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
    pub fn message(&self) -> &str {
        &self.msg
    }
    pub fn invalid(msg: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, msg)
    }
    pub fn precondition(msg: impl Into<String>) -> Self {
        Self::new(ErrorKind::FailedPrecondition, msg)
    }
    pub fn io(ctx: impl fmt::Display, e: impl fmt::Display) -> Self {
        Self::new(ErrorKind::Io, format!("{ctx}: {e}"))
    }
    pub fn corrupt(msg: impl Into<String>) -> Self {
        Self::new(ErrorKind::Corrupt, msg)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.msg)
    }
}

impl std::error::Error for Error {}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        use tonic::Code;
        let code = match e.kind {
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
        };
        tonic::Status::new(code, e.msg)
    }
}
