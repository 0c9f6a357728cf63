//! The benchmark's own directory, where everything it writes lives (the mount's cache, the
//! copy, the list file, the index): made new under `--cache` (or the system's temporary
//! directory) and removed whole at the end.
//!
//! It runs as root on shared nodes, so it holds `--cache` to a mount's cache rules
//! ([`crate::cache::check_parents`]): the directory and every one above it must be root's or
//! the user's and not open to others' renames (a sticky /tmp is fine). Otherwise another user
//! could swap the new directory for a link to their victim's, and the benchmark would copy
//! into it and then delete it. Inside, nobody else can change anything; files are created
//! exclusively, and the directory is removed only while it is still the one made (its device
//! and inode, held open from the start).

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::BenchError;
use crate::cache::{CacheError, check_parents};
use crate::sys;

/// The start of the work directory's name (the rest is random).
const PREFIX: &str = "stagefs-bench.";

/// The directory made for one run, removed when dropped (see the module's note).
pub struct WorkDir {
    path: PathBuf,
    /// Held open from its creation: its file system (to sync) and what it is.
    dir: File,
    /// Its device and inode.
    identity: (u64, u64),
    removed: bool,
}

impl WorkDir {
    /// Makes a new private directory under `cache` (None: the system's temporary directory),
    /// which must be safe to work in (see the module's note) and not inside `source`
    /// (canonical), which is only read.
    pub fn create(cache: Option<&Path>, source: &Path) -> Result<WorkDir, BenchError> {
        let parent = cache.map_or_else(std::env::temp_dir, Path::to_path_buf);
        if fs::canonicalize(&parent).is_ok_and(|p| p.starts_with(source)) {
            return Err(BenchError::CacheInSource(parent));
        }
        let cache_err = |source| BenchError::Cache {
            path: parent.clone(),
            source,
        };
        check_parents(&parent.join(PREFIX)).map_err(|e| match e {
            CacheError::UnsafeParent {
                dir, owner, mode, ..
            } => BenchError::CacheUnsafe {
                path: parent.clone(),
                dir,
                owner,
                mode,
            },
            CacheError::Io { source, .. } => cache_err(source),
            other => cache_err(io::Error::other(other.to_string())),
        })?;
        let made = tempfile::Builder::new()
            .prefix(PREFIX)
            .tempdir_in(&parent)
            .map_err(cache_err)?;
        let dir = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(made.path())
            .map_err(cache_err)?;
        let meta = dir.metadata().map_err(cache_err)?;
        Ok(WorkDir {
            path: made.keep(),
            dir,
            identity: (meta.dev(), meta.ino()),
            removed: false,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes out what was written under it (its file system's dirty data only: a global
    /// sync would wait on every other mount too, a hung network one included).
    pub fn sync(&self) -> io::Result<()> {
        sys::syncfs(self.dir.as_fd())
    }

    /// Removes it and everything in it (see [`WorkDir::remove_once`]).
    pub fn remove(mut self) -> io::Result<()> {
        self.remove_once()
    }

    /// Removes it and everything in it, once, if its path still names the directory made
    /// (links inside are removed, never followed).
    fn remove_once(&mut self) -> io::Result<()> {
        if std::mem::replace(&mut self.removed, true) {
            return Ok(());
        }
        let there = fs::symlink_metadata(&self.path)?;
        if (there.dev(), there.ino()) != self.identity {
            return Err(io::Error::other(
                "it is no longer the directory the benchmark made",
            ));
        }
        fs::remove_dir_all(&self.path)
    }
}

impl Drop for WorkDir {
    /// On an error or an interruption: removed all the same.
    fn drop(&mut self) {
        let _ = self.remove_once();
    }
}
