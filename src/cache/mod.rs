//! The node-local cache directory: whose it is, what is in it, and how files get there and
//! back out safely.
//!
//! Layout (documented in docs/how-it-works.md):
//! ```text
//! CACHE/                 --cache: created 0700 if missing; otherwise the user's own private
//!                        directory, holding nothing but stagefs/
//!   stagefs/             stagefs's own directory, the only one it ever empties or chmods
//!     manifest.json      format version and the SOURCE this cache holds
//!     lock               flock'ed by the daemon using the cache
//!     index.bin          the catalog of SOURCE, so the next mount need not scan it
//!     stagefs.log        the detached daemon's log (unless --log-file)
//!     tmp/               copies in progress (deleted at start-up)
//!     data/xx/HASH       complete files; HASH = sha256(relative path)[..16] in hex, xx = its
//!                        first byte (see `CacheDir::path_for`)
//! ```
//! CACHE is refused unless nobody but its owner (the daemon's user) could have put anything
//! there or could swap it: stagefs runs as root on shared nodes, and a planted file must never
//! be served nor a planted link followed. Every file inside is opened without following links.
//!
//! A file appears under `data/` only by `rename` after it was copied in full and checked
//! against the catalog (the source file's inode, ctime, size and mtime, after the copy); it
//! carries the source's size and mtime and, in the `user.stagefs.sum` attribute, the checksum
//! of the bytes copied and the source file's identity (inode and ctime). So a crash leaves at
//! worst a temporary file, never a partial file that is served, and a remount reuses a cached
//! file only if, when it is first opened, its source file is still the version it copied (one
//! `lstat` of the source then) and its bytes still match the checksum.

mod manifest;
mod open_copies;
mod root;
mod stage;
#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};

use sha2::{Digest, Sha256};

use crate::catalog::{Catalog, FileId};
use crate::files::open_nofollow;

pub use manifest::Manifest;
use manifest::write_manifest;
use open_copies::OpenCopies;
pub use open_copies::OpenCopy;
use root::mkdir_private;
pub use root::{check_parents, check_root, prepare, remove_if_made_here};

/// stagefs's own directory inside CACHE: everything it writes lives there, so a directory
/// it did not create is never emptied or chmod'ed.
const OWN_DIR: &str = "stagefs";
const MANIFEST: &str = "manifest.json";
/// The manifest of the layout before [`OWN_DIR`], named to tell such a cache's user what to do.
const OLD_MANIFEST: &str = "stagefs-cache.json";
const LOCK: &str = "lock";
/// The catalog a mount keeps for the next one (see `catalog::index`).
const INDEX: &str = "index.bin";
const LOG: &str = "stagefs.log";
const DATA: &str = "data";
const TMP: &str = "tmp";
/// How long to wait for the cache lock: long enough for a previous daemon to finish exiting.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cache directory {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("cache directory {0} is in use by another stagefs; give each mount its own --cache")]
    Locked(PathBuf),
    #[error("cache {0} is a symbolic link; give the directory it points to, if it is yours")]
    Symlink(PathBuf),
    #[error("cache {0} is not a directory; give a new or empty directory")]
    NotADirectory(PathBuf),
    #[error(
        "cache {path} belongs to uid {owner}, not to this stagefs (uid {uid}); use a directory of your own"
    )]
    NotOwned { path: PathBuf, owner: u32, uid: u32 },
    #[error(
        "cache {path} can be written by others (mode {mode:o}); use a private directory (chmod go-w {path}, or a new one)"
    )]
    Shared { path: PathBuf, mode: u32 },
    #[error(
        "cache {path} holds {entry:?}, which is not stagefs's; give an empty or new directory (stagefs keeps its files in {path}/{OWN_DIR})"
    )]
    Foreign { path: PathBuf, entry: OsString },
    #[error(
        "cache {0} has the layout of an older stagefs; remove it (rm -r {0}) or give a new directory"
    )]
    OldLayout(PathBuf),
    #[error(
        "cache {0} is not a valid stagefs cache (no manifest); remove it (rm -r {0}) or give another --cache"
    )]
    NoManifest(PathBuf),
    #[error(
        "cache {cache} is inside {dir}, which others can change (owner uid {owner}, mode {mode:o}) and so swap the cache for their own; put the cache under directories only root or you can write to"
    )]
    UnsafeParent {
        cache: PathBuf,
        dir: PathBuf,
        owner: u32,
        mode: u32,
    },
    #[error("cached copy {0} has no checksum (staged without one)")]
    NoChecksum(PathBuf),
    #[error("cached copy {0} is of another version of its source file")]
    OtherVersion(PathBuf),
    #[error("cached copy {0} does not match the checksum recorded when it was staged")]
    Corrupt(PathBuf),
}

/// Why one copy into the cache failed. The stager treats the kinds differently: source
/// errors are retried with backoff, a full cache shrinks capacity, a changed source file is
/// not retried at all.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("reading {path}: {source}")]
    Source { path: PathBuf, source: io::Error },
    /// Deleted on the source since it was catalogued.
    #[error("{0} was deleted on the source since it was mounted")]
    SourceGone(PathBuf),
    /// Not the file that was catalogued any more, before or during the copy.
    #[error("{0} changed on the source since it was mounted")]
    SourceChanged(PathBuf),
    #[error("cache file system is full")]
    NoSpace,
    /// Larger than the cache can make room for: found out only when the copy opened it (its
    /// size was not known before).
    #[error("no room in the cache for it")]
    NoRoom,
    #[error("writing the cache: {0}")]
    Cache(io::Error),
    /// Given up because the mount is stopping.
    #[error("stopped: the mount is shutting down")]
    Stopped,
    /// Put off: the job's node that holds the file has not read it yet (see `peers`).
    #[error("put off until the peer holding it has it")]
    Deferred,
}

pub struct CacheDir {
    root: PathBuf,
    data: PathBuf,
    tmp: PathBuf,
    _lock: File,
    temp_seq: AtomicU64,
    /// Set once the cache file system refused the checksum attribute (warned about once).
    no_xattrs: AtomicBool,
    open_copies: OpenCopies,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CacheError + '_ {
    move |source| CacheError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl CacheDir {
    /// Opens (creating if needed) the cache for `source`. `root` must be missing, or the daemon
    /// user's own directory, not writable by others, below directories nobody else can change,
    /// and empty or holding only a valid stagefs directory (see [`check_root`]). A stagefs
    /// directory that held another source is emptied; leftovers of interrupted copies are
    /// deleted.
    pub fn open(root: &Path, source: &Path) -> Result<CacheDir, CacheError> {
        let own = prepare(root, source)?;
        let lock_path = own.join(LOCK);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&lock_path)
            .map_err(io_err(&lock_path))?;
        // A daemon that was just unmounted may still be exiting: give it a moment.
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        while lock.try_lock().is_err() {
            if std::time::Instant::now() >= deadline {
                return Err(CacheError::Locked(root.to_path_buf()));
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let data = own.join(DATA);
        let tmp = own.join(TMP);
        match Manifest::read(&own) {
            Some(m) if m.holds(source) => {}
            previous => {
                if let Some(m) = previous {
                    log::warn!(
                        "cache {} held {} (format {}); emptying it for {}",
                        root.display(),
                        m.source.display(),
                        m.format,
                        source.display()
                    );
                }
                remove_tree(&data)?;
                let index = own.join(INDEX);
                if let Err(e) = fs::remove_file(&index)
                    && e.kind() != io::ErrorKind::NotFound
                {
                    return Err(io_err(&index)(e));
                }
                write_manifest(&own, source)?;
            }
        }
        remove_tree(&tmp)?;
        mkdir_private(&data)?;
        mkdir_private(&tmp)?;
        for byte in 0..=255u8 {
            mkdir_private(&data.join(format!("{byte:02x}")))?;
        }
        Ok(CacheDir {
            root: root.to_path_buf(),
            data,
            tmp,
            _lock: lock,
            temp_seq: AtomicU64::new(0),
            no_xattrs: AtomicBool::new(false),
            open_copies: OpenCopies::new(),
        })
    }

    /// Where the cached copy of catalog file `file` lives: named by its path, so a remount
    /// finds the copies of its files without asking SOURCE anything. Which version of the file
    /// a copy holds is recorded with it ([`CacheDir::open_verified`] checks it).
    pub fn path_for(&self, catalog: &Catalog, file: FileId) -> PathBuf {
        let digest = Sha256::digest(catalog.relative_path(file).as_os_str().as_encoded_bytes());
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        self.data.join(&hex[..2]).join(hex)
    }

    /// Finds the complete files a previous mount left for files of the catalog, and deletes
    /// everything else under `data/`. Returns (file, size) of those kept; which version of
    /// its file each holds, and whether its content is intact, is still to be checked
    /// ([`CacheDir::open_verified`]).
    pub fn reuse(&self, catalog: &Catalog) -> Vec<(FileId, u64)> {
        let mut present: HashSet<OsString> = HashSet::new();
        for f in self.stored_files() {
            present.insert(f.file_name());
        }
        let mut kept = Vec::new();
        let mut wanted: HashSet<OsString> = HashSet::new();
        if !present.is_empty() {
            for id in catalog.files() {
                let path = self.path_for(catalog, id);
                let name = path.file_name().expect("hash name").to_os_string();
                if !present.contains(&name) {
                    continue;
                }
                match fs::symlink_metadata(&path) {
                    Ok(m) if m.is_file() => {
                        kept.push((id, m.len()));
                        wanted.insert(name);
                    }
                    _ => {}
                }
            }
        }
        let stale = present.len() - wanted.len();
        if stale > 0 {
            for f in self.stored_files() {
                if !wanted.contains(&f.file_name()) {
                    let _ = fs::remove_file(f.path());
                }
            }
            log::info!("cache: removed {stale} files that no longer match the source");
        }
        kept
    }

    /// The cached copy of `file`, staged by this mount: kept open from an earlier open, or
    /// opened now (and kept, room permitting).
    pub fn open_cached(&self, catalog: &Catalog, file: FileId) -> io::Result<Arc<OpenCopy>> {
        if let Some(copy) = self.open_copies.get(file) {
            return Ok(copy);
        }
        let opened = open_nofollow(&self.path_for(catalog, file))?;
        Ok(self.open_copies.keep(file, OpenCopy::new(opened)))
    }

    /// Removes `file`'s copy, and lets go of it if kept open, so its space comes back as soon
    /// as no reader has it open.
    pub fn remove(&self, catalog: &Catalog, file: FileId) {
        let path = self.path_for(catalog, file);
        if let Err(e) = fs::remove_file(&path)
            && e.kind() != io::ErrorKind::NotFound
        {
            log::warn!("cannot remove cached {}: {e}", path.display());
        }
        self.open_copies.forget(file);
    }

    /// Bytes the cache's file system can still take, and its total size.
    pub fn filesystem_space(&self) -> io::Result<(u64, u64)> {
        filesystem_space(&self.root)
    }

    /// Every entry of `data/`'s fan-out directories, whatever it is.
    fn stored_files(&self) -> impl Iterator<Item = fs::DirEntry> + '_ {
        fs::read_dir(&self.data)
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|sub| fs::read_dir(sub.path()).into_iter().flatten().flatten())
    }

    /// Bytes of the copies under `data/` now, before [`CacheDir::reuse`] keeps or deletes
    /// them: room the cache already has on top of the file system's free space.
    pub fn held_bytes(&self) -> u64 {
        self.stored_files()
            .filter_map(|f| f.metadata().ok())
            .filter(|m| m.is_file())
            .map(|m| m.len())
            .sum()
    }
}

/// Bytes the file system holding `path` can still take (for an unprivileged user), and its
/// total size.
pub fn filesystem_space(path: &Path) -> io::Result<(u64, u64)> {
    let st = crate::sys::statvfs(path)?;
    Ok((
        st.f_bavail as u64 * st.f_frsize as u64,
        st.f_blocks as u64 * st.f_frsize as u64,
    ))
}

/// Where a mount keeps its catalog index inside the cache directory `root`.
pub fn index_path(root: &Path) -> PathBuf {
    root.join(OWN_DIR).join(INDEX)
}

/// Where the detached daemon logs when not given --log-file.
pub fn log_path(root: &Path) -> PathBuf {
    root.join(OWN_DIR).join(LOG)
}

fn remove_tree(path: &Path) -> Result<(), CacheError> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(path)(e)),
        _ => Ok(()),
    }
}
