//! Pool backends: where the pool's bytes come from. Both are mapped by the
//! same code in `Pool`; they differ in how they are opened, sized and aligned.
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

pub const MIB: u64 = 1 << 20;
pub const DAX_ALIGN: u64 = 2 * MIB;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// A file on tmpfs (e.g. /dev/shm): the embedded default and the test pool.
    Shm,
    /// A device-DAX character device (/dev/daxX.Y), mapped in 2 MiB units.
    Dax,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Shm => "shm",
            BackendKind::Dax => "dax",
        }
    }
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "shm" => Ok(Self::Shm),
            "dax" => Ok(Self::Dax),
            other => Err(Error::invalid(format!("unknown backend {other:?} (expected \"shm\" or \"dax\")"))),
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
}

#[derive(Debug)]
pub struct ShmBackend {
    path: PathBuf,
    file: File,
    size: u64,
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
            file.set_len(size).map_err(|e| Error::io("size pool file", e))?;
        }
        Ok(Self { path: path.to_owned(), file, size })
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
}

#[derive(Debug)]
pub struct DaxBackend {
    path: PathBuf,
    file: File,
    size: u64,
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
        Ok(Self { path: path.to_owned(), file, size: size - size % DAX_ALIGN })
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
}
