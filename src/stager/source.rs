//! How the mount reaches files on SOURCE, and what it accepts as "the file the catalog means".
//!
//! stagefs runs as root between users who may write to SOURCE. Following a path the way a
//! plain `open` does would let such a user swap a dataset file (or a directory above it) for a
//! symlink to a root-only file, a FIFO that blocks the opener forever, or a link back into the
//! mount that re-enters the daemon. So a file is opened (or `lstat`ed) the way the catalog
//! lists it and no other: relative to a descriptor of SOURCE's root, beneath it, through no
//! symlink at all (the catalog resolved its links to the files they name), non-blocking, and
//! then `fstat`ed: it must be of the kind the listing says and, once the mount has seen it,
//! still have the inode, ctime, size and mtime it had then (the first sight is kept: see
//! [`Catalog::observe`]). Anything else is a changed file: the reader gets ENOENT (deleted)
//! or ESTALE (replaced or rewritten) at once, without the retries that a failing file system
//! deserves.
//!
//! [`Source`] is also the seam through which engine tests inject the faults a real parallel
//! file system produces (errors, slowness) without a mount or a broken server.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::RwLock;

use super::OpenError;
use crate::catalog::{Attributes, Catalog, Changed, FileId};
use crate::sys;

/// Opens files of SOURCE by their path relative to its root.
pub trait Source: Send + Sync {
    /// Opens `relative` for reading beneath SOURCE without following any symlink and without
    /// blocking (a FIFO must not hold the opener); what was opened is checked by the caller.
    fn open(&self, relative: &Path) -> io::Result<File>;
    /// What `lstat` says of `relative`, reached as [`Source::open`] reaches it.
    fn lstat(&self, relative: &Path) -> io::Result<Attributes>;
}

/// SOURCE's root directory, held open from mount time: everything the daemon reads on SOURCE
/// (copies, permission checks, attributes, statfs) is reached beneath this descriptor, never
/// through a root swapped later for a link. One per mount, shared by the stager and the FUSE
/// layer.
pub struct SourceRoot {
    path: PathBuf,
    fd: RwLock<Arc<OwnedFd>>,
    /// SOURCE was the root of a file system mounted there (a parallel file system's client).
    mount_root: bool,
}

impl SourceRoot {
    pub fn open(path: &Path) -> io::Result<SourceRoot> {
        let fd = sys::open_directory(path)?;
        Ok(SourceRoot {
            path: path.to_path_buf(),
            mount_root: is_mount_root(path, fd.as_fd()),
            fd: RwLock::new(Arc::new(fd)),
        })
    }

    /// Runs `op` on the root descriptor. If the file system's client was restarted or
    /// remounted (a crashed GlusterFS client, an NFS failover: ENOTCONN / ESTALE), the old
    /// descriptor will never work again but the path may: `op` runs once more on a fresh one.
    /// What is found there is checked like anything else. A SOURCE that was a mount's root is
    /// taken again only as one: between the dead client's unmount and the new mount, the path
    /// shows the empty directory beneath, where every file would look deleted for good.
    pub fn with<T>(&self, op: impl Fn(BorrowedFd<'_>) -> io::Result<T>) -> io::Result<T> {
        let fd = self.fd.read().clone();
        match op(fd.as_fd()) {
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTCONN | libc::ESTALE)) => {
                let fresh = Arc::new(sys::open_directory(&self.path).map_err(|_| e)?);
                if self.mount_root && !is_mount_root(&self.path, fresh.as_fd()) {
                    return Err(io::Error::from_raw_os_error(libc::ENOTCONN));
                }
                *self.fd.write() = fresh.clone();
                op(fresh.as_fd())
            }
            other => other,
        }
    }
}

/// Whether directory `fd` (at `path`) is on another file system than its parent.
fn is_mount_root(path: &Path, fd: BorrowedFd<'_>) -> bool {
    let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) else {
        return false;
    };
    let Ok(dev) = sys::device_of(fd) else {
        return false;
    };
    std::fs::metadata(parent).is_ok_and(|p| {
        use std::os::unix::fs::MetadataExt;
        p.dev() != dev
    })
}

/// The real thing: files opened on the mounted parallel file system, beneath its root.
pub struct LocalSource {
    root: Arc<SourceRoot>,
}

impl LocalSource {
    pub fn new(root: Arc<SourceRoot>) -> LocalSource {
        LocalSource { root }
    }
}

impl Source for LocalSource {
    fn open(&self, relative: &Path) -> io::Result<File> {
        self.root
            .with(|fd| sys::open_beneath(fd, relative, libc::O_RDONLY | libc::O_NONBLOCK))
            .map(File::from)
    }

    fn lstat(&self, relative: &Path) -> io::Result<Attributes> {
        let st = self.root.with(|fd| sys::lstat_beneath(fd, relative))?;
        Ok(Attributes::of_stat(&st))
    }
}

/// Why a catalogued file could not be opened on SOURCE.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// Not the file the catalog lists (or the version the mount has seen) any more. Not
    /// retried: it will not come back.
    #[error("{path} {why} on the source; remount to see it as it is now")]
    Changed {
        path: PathBuf,
        why: &'static str,
        /// What the reader gets: [`OpenError::Gone`] or [`OpenError::Changed`].
        error: OpenError,
    },
    /// The file system failed (or refused): worth retrying.
    #[error("reading {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

impl SourceError {
    /// What a reader of the file is answered.
    pub fn open_error(&self) -> OpenError {
        match self {
            SourceError::Changed { error, .. } => *error,
            // A listed file that cannot be read is an I/O problem to the reader (ENOTCONN
            // from a vanished source would only confuse it).
            SourceError::Io { .. } => OpenError::Io,
        }
    }
}

/// Opens catalog file `file` on `source` and checks it is the file the catalog lists, the
/// version the mount has seen if it has; returns it with its attributes (kept from now on if
/// this is the first sight).
pub fn open_verified(
    source: &dyn Source,
    catalog: &Catalog,
    file: FileId,
) -> Result<(File, Attributes), SourceError> {
    let relative = catalog.relative_path(file);
    let opened = source
        .open(&relative)
        .map_err(|e| unreachable_as(catalog, &relative, e))?;
    let meta = opened
        .metadata()
        .map_err(|e| failed(catalog, &relative, e))?;
    let attributes = observed(catalog, file, &relative, Attributes::of_metadata(&meta))?;
    // Opened non-blocking only so a FIFO could not hold us; reads of the regular file it
    // turned out to be should block as usual (a network file system may honour the flag).
    sys::set_status_flags(opened.as_fd(), libc::O_RDONLY)
        .map_err(|e| failed(catalog, &relative, e))?;
    Ok((opened, attributes))
}

/// The attributes of `id`: those the mount keeps if it has seen it, else what `lstat` says on
/// `source` now (the first sight, kept from now on). Asks SOURCE at most once per entry: call
/// it off the threads that must not wait on SOURCE.
pub fn attributes(
    source: &dyn Source,
    catalog: &Catalog,
    id: FileId,
) -> Result<Attributes, SourceError> {
    if let Some(kept) = catalog.attributes(id) {
        return Ok(kept);
    }
    let relative = catalog.relative_path(id);
    let now = source
        .lstat(&relative)
        .map_err(|e| unreachable_as(catalog, &relative, e))?;
    observed(catalog, id, &relative, now)
}

/// `now`, a sight of `id` on SOURCE, checked against what the mount knows of it.
fn observed(
    catalog: &Catalog,
    id: FileId,
    relative: &Path,
    now: Attributes,
) -> Result<Attributes, SourceError> {
    catalog.observe(id, now).map_err(|why| {
        let why = match why {
            Changed::Retyped => "was replaced by another kind of file",
            Changed::Rewritten => "changed since the mount first saw it",
        };
        changed(catalog, relative, why, OpenError::Changed)
    })
}

/// An entry of the catalog that SOURCE cannot reach as listed (`e`): deleted, or a path that
/// is no longer the one listed; else SOURCE failing.
fn unreachable_as(catalog: &Catalog, relative: &Path, e: io::Error) -> SourceError {
    match e.raw_os_error() {
        Some(libc::ENOENT) => changed(catalog, relative, "was deleted", OpenError::Gone),
        // A symlink (ELOOP), a path leaving SOURCE (EXDEV), a file where a directory was
        // (ENOTDIR), a stale handle: all say the tree is not the one listed.
        Some(libc::ELOOP | libc::EXDEV | libc::ENOTDIR | libc::ESTALE | libc::ENXIO) => {
            changed(catalog, relative, "was replaced", OpenError::Changed)
        }
        _ => failed(catalog, relative, e),
    }
}

fn changed(catalog: &Catalog, relative: &Path, why: &'static str, error: OpenError) -> SourceError {
    SourceError::Changed {
        path: catalog.root_path().join(relative),
        why,
        error,
    }
}

fn failed(catalog: &Catalog, relative: &Path, source: io::Error) -> SourceError {
    SourceError::Io {
        path: catalog.root_path().join(relative),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn source(root: &Path) -> LocalSource {
        LocalSource::new(Arc::new(SourceRoot::open(root).unwrap()))
    }

    /// `root`'s catalog, with the attributes of every file seen (as a mount that looked them
    /// all up would have).
    fn catalog_of(root: &Path) -> Catalog {
        let catalog = Catalog::scan(root, crate::catalog::Walking::threads(1)).unwrap();
        for id in catalog.files() {
            attributes(&source(root), &catalog, id).unwrap();
        }
        catalog
    }

    fn errno_of(root: &Path, catalog: &Catalog, rel: &str) -> Result<Vec<u8>, i32> {
        let id = catalog.lookup_path(Path::new(rel)).unwrap();
        open_verified(&source(root), catalog, id)
            .map(|(mut f, _)| {
                let mut v = Vec::new();
                io::Read::read_to_end(&mut f, &mut v).unwrap();
                v
            })
            .map_err(|e| e.open_error().errno())
    }

    #[test]
    fn serves_only_the_catalogued_file() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("src");
        std::fs::create_dir_all(root.join("d")).unwrap();
        for name in ["d/a", "d/b", "d/c", "d/e", "d/f"] {
            std::fs::write(root.join(name), b"data").unwrap();
        }
        std::fs::write(tmp.path().join("secret"), b"root only").unwrap();
        let catalog = catalog_of(&root);
        assert_eq!(errno_of(&root, &catalog, "d/a"), Ok(b"data".to_vec()));

        // Swapped for a link to a file outside, with size and mtime made to match.
        std::fs::remove_file(root.join("d/b")).unwrap();
        std::fs::write(tmp.path().join("four"), b"FOUR").unwrap();
        symlink(tmp.path().join("four"), root.join("d/b")).unwrap();
        assert_eq!(errno_of(&root, &catalog, "d/b"), Err(libc::ESTALE));

        // Swapped for a FIFO: refused at once, not waited on.
        std::fs::remove_file(root.join("d/c")).unwrap();
        sys::mkfifo(&root.join("d/c"), 0o644).unwrap();
        assert_eq!(errno_of(&root, &catalog, "d/c"), Err(libc::ESTALE));

        // Deleted.
        std::fs::remove_file(root.join("d/e")).unwrap();
        assert_eq!(errno_of(&root, &catalog, "d/e"), Err(libc::ENOENT));

        // Rewritten at the same size with its mtime put back: the ctime tells.
        let before = std::fs::metadata(root.join("d/f"))
            .unwrap()
            .modified()
            .unwrap();
        std::fs::write(root.join("d/f"), b"DATA").unwrap();
        File::options()
            .write(true)
            .open(root.join("d/f"))
            .unwrap()
            .set_modified(before)
            .unwrap();
        assert_eq!(errno_of(&root, &catalog, "d/f"), Err(libc::ESTALE));

        // The directory above swapped for a link to a look-alike tree.
        std::fs::rename(root.join("d"), tmp.path().join("moved")).unwrap();
        symlink(tmp.path().join("moved"), root.join("d")).unwrap();
        assert_eq!(errno_of(&root, &catalog, "d/a"), Err(libc::ESTALE));
    }

    /// A file the mount has not seen yet is taken as it is when first seen (that is when its
    /// size is shown and its bytes read: never an older version's); it must still be of the
    /// kind listed, and is the version seen from then on.
    #[test]
    fn a_file_is_the_version_first_seen() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("src");
        std::fs::create_dir_all(root.join("d")).unwrap();
        for name in ["d/a", "d/b", "d/c"] {
            std::fs::write(root.join(name), b"data").unwrap();
        }
        let catalog = Catalog::scan(&root, crate::catalog::Walking::threads(1)).unwrap();
        std::fs::write(root.join("d/a"), b"new, longer data").unwrap();
        std::fs::remove_file(root.join("d/b")).unwrap();
        symlink("a", root.join("d/b")).unwrap();
        std::fs::remove_file(root.join("d/c")).unwrap();
        std::fs::create_dir(root.join("d/c")).unwrap();

        let a = catalog.lookup_path(Path::new("d/a")).unwrap();
        assert_eq!(catalog.attributes(a), None);
        assert_eq!(
            errno_of(&root, &catalog, "d/a"),
            Ok(b"new, longer data".to_vec())
        );
        assert_eq!(catalog.size(a), Some(16), "kept as first seen");
        for retyped in ["d/b", "d/c"] {
            let id = catalog.lookup_path(Path::new(retyped)).unwrap();
            let e = attributes(&source(&root), &catalog, id).unwrap_err();
            assert_eq!(e.open_error().errno(), libc::ESTALE, "{retyped}: {e}");
            assert_eq!(
                catalog.attributes(id),
                None,
                "{retyped}: a wrong kind is not kept"
            );
        }
        std::fs::write(root.join("d/a"), b"NEW, LONGER DATA").unwrap();
        assert_eq!(errno_of(&root, &catalog, "d/a"), Err(libc::ESTALE));
    }
}
