//! What the credential files have in common: their lines (a credential and
//! the tenants it grants, or `*`), and a file parsed again when it changes,
//! so credentials rotate without a restart.
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::error::{Error, Result};
use crate::registry::Scope;

/// How often a watched file is checked for a change (a `stat`).
pub const RELOAD_EVERY: Duration = Duration::from_secs(1);

/// The lines of a grants file (tokens, certificate names): line number
/// (from 1), the credential, and what follows it; blank lines and `#`
/// comments skipped.
pub fn grant_lines(text: &str) -> impl Iterator<Item = (usize, &str, Vec<&str>)> {
    text.lines().enumerate().filter_map(|(n, line)| {
        let mut words = line.split('#').next().unwrap_or("").split_whitespace();
        let first = words.next()?;
        Some((n + 1, first, words.collect()))
    })
}

/// What a credential's line grants: `*` (an operator: every tenant) or
/// tenants, `""` naming the empty one (LMCache without a `cache_salt`).
pub fn grant(tenants: &[&str]) -> std::result::Result<Scope, &'static str> {
    match tenants {
        [] => Err("needs its tenants, or * for an operator"),
        ["*"] => Ok(Scope::All),
        t if t.contains(&"*") => Err("lists tenants beside *: * cannot be combined with tenants"),
        t => Ok(Scope::tenants(t.iter().map(|t| if *t == "\"\"" { "" } else { t }))),
    }
}

/// What identifies a version of a file: a rewrite, a rename over it or a
/// Kubernetes secret's symlink swap all change it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp(Option<(SystemTime, u64, u64, u64)>);

fn stamp(path: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    Stamp(
        std::fs::metadata(path)
            .ok()
            .map(|m| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len(), m.ino(), m.dev())),
    )
}

/// A file parsed into `T`, parsed again when it changes (checked at most
/// every `every`, on use). A version that does not parse is skipped with a
/// warning: the previous one stays in force until the file is fixed.
pub struct Watched<T> {
    path: PathBuf,
    parse: fn(&str) -> Result<T>,
    every: Duration,
    state: Mutex<(Arc<T>, Stamp, Instant)>,
}

impl<T> Watched<T> {
    pub fn open(path: &Path, parse: fn(&str) -> Result<T>, every: Duration) -> Result<Self> {
        let s = stamp(path);
        let v = read_parse(path, parse)?;
        Ok(Self { path: path.to_owned(), parse, every, state: Mutex::new((Arc::new(v), s, Instant::now())) })
    }

    pub fn current(&self) -> Arc<T> {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if g.2.elapsed() >= self.every {
            g.2 = Instant::now();
            let s = stamp(&self.path);
            if s != g.1 {
                g.1 = s;
                match read_parse(&self.path, self.parse) {
                    Ok(v) => {
                        g.0 = Arc::new(v);
                        tracing::info!(path = %self.path.display(), "reloaded");
                    }
                    Err(e) => {
                        tracing::warn!(path = %self.path.display(), error = %e.message(), "changed file does not parse: kept the previous version")
                    }
                }
            }
        }
        g.0.clone()
    }
}

fn read_parse<T>(path: &Path, parse: fn(&str) -> Result<T>) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
    parse(&text).map_err(|e| Error::invalid(format!("{}: {}", path.display(), e.message())))
}
