//! Durable client sessions: a client that names its session on a call
//! (`x-cxlkv-session`: 32 hex digits, 128 random bits it made) keeps its
//! locks, reservations and pin budget across connections. A connection's
//! own session ends with it (its locks are released at once); a named one
//! does not: its locks end by unlock or TTL only, and a new connection that
//! names it carries on. The LMCache backend uses one for its zero-copy
//! views, which LMCache may read long after the lookup that located them:
//! a reset connection must not take their protection away.
//!
//! A session whose every connection closed and whose every client process
//! is gone (the Unix socket names the peer's pid; the process has exited or
//! is a zombie) is released at once, as a connection's own session is: no
//! view of a dead process can be read. Where a process cannot be named (TCP,
//! a pid from another namespace) or may be alive, its locks stay until
//! unlocked or lapsed. A reused pid only errs on that side.
//!
//! Bounds: `max` named sessions per sidecar (each a table row of < 100 B),
//! `conn::DURABLE_PER_CONNECTION` names per connection, and a name is kept for `linger`
//! after its last connection closed (by then everything it could hold has
//! lapsed). A name belongs to the credential that created it: the same
//! tenant scope and, on the Unix socket, the same uid.
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hashbrown::HashMap;

use crate::conn::ConnInfo;
use crate::error::{Error, ErrorKind, Result};
use crate::registry::{Scope, Session};

/// The metadata key a client names its durable session with.
pub const HEADER: &str = "x-cxlkv-session";
use crate::conn::DURABLE_PER_CONNECTION as PER_CONNECTION;

struct Named {
    session: Session,
    uid: Option<u32>,
    scope: Scope,
    /// Live connections that named it.
    conns: u32,
    /// When the last of them closed (None while one is open).
    detached: Option<Instant>,
    /// The client processes that named it, while each can be named (at
    /// most `PIDS`); None once one could not be (then it is never known gone).
    pids: Option<Vec<i32>>,
}

/// Client processes remembered per named session.
const PIDS: usize = 8;

impl Named {
    fn saw(&mut self, pid: Option<i32>) {
        match (self.pids.as_mut(), pid) {
            (Some(p), Some(pid)) if pid > 0 && (p.contains(&pid) || p.len() < PIDS) => {
                if !p.contains(&pid) {
                    p.push(pid);
                }
            }
            _ => self.pids = None,
        }
    }

    /// No connection, and every process that named it is gone.
    fn orphaned(&self) -> bool {
        self.conns == 0 && self.pids.as_ref().is_some_and(|p| p.iter().all(|&pid| gone(pid)))
    }
}

/// The process has exited (no /proc entry) or is a zombie.
fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // "pid (comm) S ...": comm may hold spaces and parentheses.
        Ok(s) => {
            s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()).is_some_and(|st| st == "Z" || st == "X")
        }
    }
}

/// The named sessions of one term's listeners.
pub struct DurableSessions {
    names: Mutex<HashMap<u128, Named>>,
    max: usize,
    linger: Duration,
}

impl DurableSessions {
    /// At most `max` names; one is forgotten `linger` after its last
    /// connection closed (give it the longest lock TTL plus the reservation
    /// timeout: nothing it holds outlives that).
    pub fn new(max: usize, linger: Duration) -> Self {
        Self { names: Mutex::new(HashMap::new()), max, linger }
    }

    /// The session a request names, if it names one (else None: the
    /// connection's own session applies).
    pub fn of_request<T>(&self, req: &tonic::Request<T>, scope: &Scope) -> Result<Option<Session>> {
        let Some(v) = req.metadata().get(HEADER) else { return Ok(None) };
        let name = v.to_str().ok().and_then(parse).ok_or_else(|| {
            Error::invalid(format!("{HEADER} must be 32 hexadecimal digits (a 128-bit random session name)"))
        })?;
        let conn = crate::conn::conn_of(req)
            .ok_or_else(|| Error::new(ErrorKind::Internal, "a request without its connection"))?;
        self.attach(name, conn, scope).map(Some)
    }

    /// `name`'s session for a request on `conn` (made on first use).
    pub fn attach(&self, name: u128, conn: &ConnInfo, scope: &Scope) -> Result<Session> {
        if let Some(s) = conn.state.durable_session(name) {
            return Ok(s);
        }
        let uid = conn.peer.map(|p| p.uid);
        let mut names = self.names.lock().unwrap();
        let session = match names.get_mut(&name) {
            Some(n) => {
                if n.uid != uid || &n.scope != scope {
                    return Err(Error::new(
                        ErrorKind::PermissionDenied,
                        "this session name belongs to another credential (uid or tenant binding)",
                    ));
                }
                n.session
            }
            None => {
                if names.len() >= self.max {
                    let linger = self.linger;
                    names.retain(|_, n| n.detached.is_none_or(|t| t.elapsed() < linger));
                }
                if names.len() >= self.max {
                    return Err(Error::new(
                        ErrorKind::ResourceExhausted,
                        format!("{} named sessions are open or lingering (server.max_sessions)", self.max),
                    ));
                }
                let session = fresh(&names);
                // Detached until the connection takes it (below), so a name
                // the connection may not take is forgotten in time.
                let detached = Some(Instant::now());
                names
                    .insert(name, Named { session, uid, scope: scope.clone(), conns: 0, detached, pids: Some(vec![]) });
                session
            }
        };
        if !conn.state.add_durable(name, session) {
            return Err(Error::new(
                ErrorKind::ResourceExhausted,
                format!("a connection may name at most {PER_CONNECTION} sessions"),
            ));
        }
        let n = names.get_mut(&name).expect("present");
        n.conns += 1;
        n.detached = None;
        n.saw(conn.peer.and_then(|p| p.pid));
        Ok(session)
    }

    /// A connection that named `names` closed.
    pub fn detach(&self, names: &[u128]) {
        let mut table = self.names.lock().unwrap();
        for name in names {
            if let Some(n) = table.get_mut(name) {
                n.conns = n.conns.saturating_sub(1);
                if n.conns == 0 {
                    n.detached = Some(Instant::now());
                }
            }
        }
    }

    /// Sessions whose client processes are all gone, forgotten here: the
    /// caller releases their locks (their reservations lapse on their own).
    pub fn reap(&self) -> Vec<Session> {
        let mut out = vec![];
        self.names.lock().unwrap().retain(|_, n| {
            let orphaned = n.orphaned();
            if orphaned {
                out.push(n.session);
            }
            !orphaned
        });
        out
    }

    /// Named sessions open or lingering.
    pub fn len(&self) -> usize {
        self.names.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn parse(s: &str) -> Option<u128> {
    (s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit())).then(|| u128::from_str_radix(s, 16).ok())?
}

/// A durable session id no named session of this table has: random client
/// bits (ids of other instances, which may linger at a primary, are as
/// unlikely to collide), never `Session::HOLD`'s.
fn fresh(names: &HashMap<u128, Named>) -> Session {
    loop {
        let bits = rand::random::<u64>() & (Session::DURABLE_BIT - 1);
        let s = Session(Session::DURABLE_BIT | bits);
        if bits != Session::DURABLE_BIT - 1 && bits != 0 && !names.values().any(|n| n.session == s) {
            return s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::{ConnInfo, PeerCred};

    fn conn(uid: u32) -> ConnInfo {
        ConnInfo::new(Session(1), Some(PeerCred { uid, gid: 0, pid: None }))
    }

    const NAME: u128 = 0x0123_4567_89ab_cdef_0123_4567_89ab_cdef;

    #[test]
    fn a_name_is_one_durable_session_across_connections() {
        let t = DurableSessions::new(4, Duration::from_secs(60));
        let (a, b) = (conn(7), conn(7));
        let s = t.attach(NAME, &a, &Scope::All).unwrap();
        assert!(s.is_durable() && !s.is_sidecar() && !s.is_hold());
        t.detach(&a.state.durable_names());
        assert_eq!(t.attach(NAME, &b, &Scope::All).unwrap(), s, "a new connection carries on the session");
        assert_ne!(t.attach(NAME + 1, &b, &Scope::All).unwrap(), s);
    }

    #[test]
    fn another_credential_cannot_take_a_name_over() {
        let t = DurableSessions::new(4, Duration::from_secs(60));
        t.attach(NAME, &conn(7), &Scope::All).unwrap();
        let e = t.attach(NAME, &conn(8), &Scope::All).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
        let e = t.attach(NAME, &conn(7), &Scope::tenants(["a"])).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
    }

    #[test]
    fn names_are_bounded_per_sidecar_and_per_connection_and_forgotten_after_their_linger() {
        let t = DurableSessions::new(2, Duration::from_millis(50));
        let (a, b) = (conn(1), conn(1));
        t.attach(1, &a, &Scope::All).unwrap();
        t.attach(2, &a, &Scope::All).unwrap();
        assert_eq!(t.attach(3, &b, &Scope::All).unwrap_err().kind(), ErrorKind::ResourceExhausted);
        t.detach(&a.state.durable_names());
        // Detached, but lingering: still counted.
        assert_eq!(t.attach(3, &b, &Scope::All).unwrap_err().kind(), ErrorKind::ResourceExhausted);
        std::thread::sleep(Duration::from_millis(60));
        t.attach(3, &b, &Scope::All).unwrap();
        assert_eq!(t.len(), 1);
        let c = conn(1);
        let big = DurableSessions::new(64, Duration::from_secs(1));
        for n in 0..PER_CONNECTION as u128 {
            big.attach(100 + n, &c, &Scope::All).unwrap();
        }
        assert_eq!(big.attach(999, &c, &Scope::All).unwrap_err().kind(), ErrorKind::ResourceExhausted);
    }

    #[test]
    fn a_session_whose_client_processes_are_gone_is_reaped_and_one_that_may_live_is_kept() {
        let t = DurableSessions::new(8, Duration::from_secs(60));
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        let of = |pid: Option<i32>| ConnInfo::new(Session(1), Some(PeerCred { uid: 7, gid: 0, pid }));
        let (dying, alive, unknown) = (of(Some(pid)), of(Some(std::process::id() as i32)), of(None));
        let s = t.attach(1, &dying, &Scope::All).unwrap();
        t.attach(2, &alive, &Scope::All).unwrap();
        t.attach(3, &unknown, &Scope::All).unwrap();
        t.detach(&[1, 2, 3]);
        assert!(t.reap().is_empty(), "every client process may still read views");
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(t.reap(), vec![s], "the dead process's session goes; the live and the unnamed one stay");
        assert_eq!(t.len(), 2);
        // Still attached: never reaped, whatever its process.
        let held = of(Some(i32::MAX));
        t.attach(4, &held, &Scope::All).unwrap();
        assert!(t.reap().is_empty());
    }

    #[test]
    fn only_32_hex_digits_name_a_session() {
        assert_eq!(parse("0123456789abcdef0123456789ABCDEF"), Some(0x0123456789abcdef0123456789abcdef));
        assert_eq!(parse("0123"), None);
        assert_eq!(parse("0123456789abcdef0123456789abcdeg"), None);
        assert_eq!(parse("+123456789abcdef0123456789abcdef"), None);
    }
}
