//! Pool backends: where the pool's bytes come from. All are mapped by the
//! same code in `Pool`; they differ in how they are opened, sized and aligned,
//! and in whether the memory is cache-coherent across the hosts that map it.
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub const MIB: u64 = 1 << 20;
pub const DAX_ALIGN: u64 = 2 * MIB;

/// The config's `pool.backend`; an unknown name fails at parse time with the
/// list of known ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    /// A file on tmpfs (e.g. /dev/shm): the embedded default and the test pool.
    Shm,
    /// A device-DAX character device (/dev/daxX.Y), mapped in 2 MiB units.
    Dax,
    /// Tests only: a file like `Shm`, mapped so that every process behaves
    /// like a host with its own non-coherent cache (see `CacheMode::Private`).
    NoncoherentTest,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Shm => "shm",
            BackendKind::Dax => "dax",
            BackendKind::NoncoherentTest => "noncoherent-test",
        }
    }
    /// For the command line (the config file goes through serde).
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "shm" => Ok(Self::Shm),
            "dax" => Ok(Self::Dax),
            "noncoherent-test" => Ok(Self::NoncoherentTest),
            other => Err(Error::invalid(format!(
                "unknown backend {other:?} (expected \"shm\", \"dax\" or, for tests, \"noncoherent-test\")"
            ))),
        }
    }
}

/// Whether the hosts that map the pool see each other's writes without help.
/// Across hosts CXL memory is not cache-coherent before CXL 3 back-invalidate,
/// so every write meant for another host is flushed before it is published
/// and every read of another host's writes is preceded by an invalidation
/// (docs/ARCHITECTURE.md, "Coherence"). One host is always coherent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Coherence {
    /// From the backend: software for DAX devices and the non-coherent test
    /// backend, hardware for shm files (one host).
    #[default]
    Auto,
    /// Nothing is flushed or invalidated: single-host pools pay nothing.
    Hardware,
    /// Flush before publishing, invalidate before reading.
    Software,
}

impl Coherence {
    /// The setting with `Auto` decided by the backend.
    pub fn resolve(self, kind: BackendKind) -> Self {
        match (self, kind) {
            (Coherence::Auto, BackendKind::Shm) => Coherence::Hardware,
            (Coherence::Auto, BackendKind::Dax | BackendKind::NoncoherentTest) => Coherence::Software,
            (c, _) => c,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Coherence::Auto => "auto",
            Coherence::Hardware => "hardware",
            Coherence::Software => "software",
        }
    }
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "hardware" => Ok(Self::Hardware),
            "software" => Ok(Self::Software),
            other => Err(Error::invalid(format!(
                "unknown coherence {other:?} (expected \"auto\", \"hardware\" or \"software\")"
            ))),
        }
    }
}

/// One shared-memory pool backend (iceoryx2-style: one trait, several backends,
/// one conformance suite in `pool::tests`).
pub trait PoolBackend: Send + Sync + std::fmt::Debug {
    fn kind(&self) -> BackendKind;
    fn path(&self) -> &Path;
    /// Bytes available to map.
    fn size(&self) -> u64;
    /// Mapping offsets must be multiples of this.
    fn map_alignment(&self) -> u64;
    fn file(&self) -> &File;
    /// The configured coherence with `Auto` resolved (never `Auto`).
    fn coherence(&self) -> Coherence;
    /// Give `len` bytes at `offset` their storage before any of them is
    /// handed out (`space::back`): false when the filesystem has no room.
    fn back(&self, offset: u64, len: u64) -> Result<bool> {
        super::space::back(self.file(), self.path(), offset, len)
    }
}

#[derive(Debug)]
pub struct ShmBackend {
    path: PathBuf,
    file: File,
    size: u64,
    coherence: Coherence,
}

impl ShmBackend {
    /// Open `path`, creating it with `size` bytes if absent or empty. An
    /// existing file of another size is refused unless `resize` is set.
    pub fn open(path: &Path, size: u64, resize: bool) -> Result<Self> {
        if size == 0 {
            return Err(Error::invalid("pool size must be > 0"));
        }
        if let Some(dir) = path.parent() {
            if !dir.as_os_str().is_empty() && !dir.exists() {
                std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
            }
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o660)
            .open(path)
            .map_err(|e| Error::io(format!("open pool file {}", path.display()), e))?;
        let meta = file.metadata().map_err(|e| Error::io("stat pool file", e))?;
        if !meta.file_type().is_file() {
            return Err(Error::invalid(format!(
                "{} is not a regular file; use backend \"dax\" for devices",
                path.display()
            )));
        }
        let created = meta.len() == 0;
        if meta.len() != size {
            if !created && !resize {
                return Err(Error::precondition(format!(
                    "pool file {} is {} bytes but the configuration asks for {} bytes; \
                     start with the matching --pool-size, or pass --format to recreate it (erases the pool)",
                    path.display(),
                    meta.len(),
                    size
                )));
            }
            if !created {
                super::refuse_if_in_use(&file, path, "resize")?;
            }
            file.set_len(size).map_err(|e| Error::io("size pool file", e))?;
        }
        Ok(Self { path: path.to_owned(), file, size, coherence: Coherence::Auto.resolve(BackendKind::Shm) })
    }

    /// Override the backend's default coherence (`Auto` keeps it).
    pub fn with_coherence(mut self, c: Coherence) -> Self {
        self.coherence = c.resolve(BackendKind::Shm);
        self
    }
}

impl PoolBackend for ShmBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Shm
    }
    fn path(&self) -> &Path {
        &self.path
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn map_alignment(&self) -> u64 {
        4096
    }
    fn file(&self) -> &File {
        &self.file
    }
    fn coherence(&self) -> Coherence {
        self.coherence
    }
}

/// Tests only: an shm-style file that every process maps privately, so its
/// writes reach the file (and other processes) only when flushed and it sees
/// other processes' writes only after invalidating (`CacheMode::Private`).
/// One shm file shared by processes on one host is always coherent and can
/// never show a missing flush; this one does. Not for production: every
/// mapping holds a private copy of what it maps.
#[derive(Debug)]
pub struct NoncoherentTestBackend {
    inner: ShmBackend,
}

impl NoncoherentTestBackend {
    pub fn open(path: &Path, size: u64, resize: bool) -> Result<Self> {
        let mut inner = ShmBackend::open(path, size, resize)?;
        inner.coherence = Coherence::Software;
        Ok(Self { inner })
    }

    /// This memory is not coherent: only `Auto` and `Software` are accepted.
    pub fn with_coherence(self, c: Coherence) -> Result<Self> {
        match c.resolve(BackendKind::NoncoherentTest) {
            Coherence::Software => Ok(self),
            _ => Err(Error::invalid(
                "backend \"noncoherent-test\" is not coherent: coherence must be \"auto\" or \"software\"",
            )),
        }
    }
}

impl PoolBackend for NoncoherentTestBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::NoncoherentTest
    }
    fn path(&self) -> &Path {
        self.inner.path()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn map_alignment(&self) -> u64 {
        self.inner.map_alignment()
    }
    fn file(&self) -> &File {
        self.inner.file()
    }
    fn coherence(&self) -> Coherence {
        self.inner.coherence
    }
}

#[derive(Debug)]
pub struct DaxBackend {
    path: PathBuf,
    file: File,
    size: u64,
    coherence: Coherence,
}

impl DaxBackend {
    /// Open an existing device-DAX node (or, for tests and emulation, a
    /// regular file). Never creates or resizes anything.
    pub fn open(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(format!("open DAX device {}", path.display()), e))?;
        let meta = file.metadata().map_err(|e| Error::io("stat DAX device", e))?;
        let size = if meta.file_type().is_char_device() {
            let rdev = meta.rdev();
            let (major, minor) = (nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev));
            let sys = format!("/sys/dev/char/{major}:{minor}/size");
            let text = std::fs::read_to_string(&sys).map_err(|e| Error::io(format!("read {sys}"), e))?;
            text.trim().parse::<u64>().map_err(|e| Error::io(format!("parse {sys}"), e))?
        } else if meta.file_type().is_file() {
            meta.len()
        } else {
            return Err(Error::invalid(format!("{} is neither a DAX character device nor a file", path.display())));
        };
        if size < 2 * DAX_ALIGN {
            return Err(Error::invalid(format!("DAX device {} is too small ({size} bytes)", path.display())));
        }
        let coherence = Coherence::Auto.resolve(BackendKind::Dax);
        Ok(Self { path: path.to_owned(), file, size: size - size % DAX_ALIGN, coherence })
    }

    /// Override the backend's default coherence (`Auto` keeps it): a device
    /// only one host maps can be `Hardware`.
    pub fn with_coherence(mut self, c: Coherence) -> Self {
        self.coherence = c.resolve(BackendKind::Dax);
        self
    }
}

impl PoolBackend for DaxBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Dax
    }
    fn path(&self) -> &Path {
        &self.path
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn map_alignment(&self) -> u64 {
        DAX_ALIGN
    }
    fn file(&self) -> &File {
        &self.file
    }
    fn coherence(&self) -> Coherence {
        self.coherence
    }
}
