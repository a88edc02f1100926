//! One error type for the whole sidecar, classified by kind (foyer-style), so
//! every layer can say *what* went wrong and the RPC layer maps kinds to codes.
//! The mapping between kinds and gRPC codes is here, both ways, so the
//! server's answers and a caller's reading of them (a follower forwarding to
//! the primary) cannot drift apart.
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
    /// On-pool metadata is not a cxlkv pool or is damaged.
    Corrupt,
    Io,
    Internal,
}

#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    msg: String,
    /// The underlying error, for logs that walk the chain; its text is in
    /// `msg` already. Shared so that `Error` stays `Clone`.
    source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, msg: impl Into<String>) -> Self {
        Self { kind, msg: msg.into(), source: None }
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
    pub fn io(ctx: impl fmt::Display, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::new(ErrorKind::Io, format!("{ctx}: {e}")).with_source(e)
    }
    /// Keep `e` as this error's source.
    pub fn with_source(mut self, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(e));
        self
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

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
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
