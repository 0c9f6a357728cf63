//! Building the catalog: a parallel walk of SOURCE.
//!
//! Each metadata call to a parallel file system costs a network round trip, so directories
//! are listed and their entries stat'ed by several workers at once; the tree is then laid
//! out breadth-first on one thread so ids, and children ranges, come out deterministic.
//!
//! Each directory is opened beneath SOURCE's root descriptor through no symlink, and its
//! entries are `lstat`ed and their links read relative to its own descriptor: no call is
//! given a full path, so a tree deeper than PATH_MAX is catalogued whole (it was silently
//! missing), and a directory swapped for a link during the scan is not followed out of
//! SOURCE.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{Catalog, Entry, FileId, Kind, ROOT};
use crate::sys;

/// How often the scan reports progress: often enough to show it is alive on a slow file
/// system, rarely enough not to flood a log.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    #[error("cannot read source directory {path}: {source}")]
    Root { path: PathBuf, source: io::Error },
    #[error("source {0} is not a directory")]
    NotADirectory(PathBuf),
    #[error("source has more entries (or longer names in total) than stagefs can index: at most {max} of each", max = u32::MAX)]
    TooManyEntries,
}

/// What one directory listing yields for one child.
pub struct Scanned {
    pub name: OsString,
    pub kind: Kind,
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub mtime_secs: i64,
    pub mtime_nanos: u32,
    /// See [`super::identity`].
    pub identity: u64,
    pub link_target: Option<OsString>,
}

/// Lists directories for a scan. The file system is the real one; the seam lets the scale
/// benchmark build catalogs of 14 M synthetic entries without creating 14 M files.
pub trait Lister: Sync {
    /// The root directory itself.
    fn root(&self) -> Scanned;
    /// The children of `dir` (relative to the root; empty for the root).
    fn list(&self, dir: &Path) -> Vec<Scanned>;
}

/// Lists a real directory tree, beneath its root's descriptor.
struct FsLister<'a> {
    root: &'a Path,
    root_dir: File,
    root_stat: libc::stat,
}

impl Lister for FsLister<'_> {
    fn root(&self) -> Scanned {
        Scanned::from_stat(OsString::new(), &self.root_stat, None)
    }

    fn list(&self, dir: &Path) -> Vec<Scanned> {
        list_directory(self.root_dir.as_fd(), dir, &self.root.join(dir))
    }
}

impl Scanned {
    /// The entry `name` as `lstat` (`st`) describes it.
    pub fn from_stat(name: OsString, st: &libc::stat, link_target: Option<OsString>) -> Self {
        let kind = Kind::of_mode(st.st_mode);
        Scanned {
            name,
            kind,
            perm: (st.st_mode & 0o7777) as u16,
            uid: st.st_uid,
            gid: st.st_gid,
            // What the mount shows and the copy checks: directories' sizes are file-system
            // specific, special files have no content to stage.
            size: if matches!(kind, Kind::File | Kind::Symlink) {
                st.st_size as u64
            } else {
                0
            },
            mtime_secs: st.st_mtime,
            mtime_nanos: st.st_mtime_nsec as u32,
            identity: super::identity_of(st.st_ino, st.st_ctime, st.st_ctime_nsec),
            link_target,
        }
    }
}

struct WorkQueue {
    pending: VecDeque<PathBuf>,
    /// Directories queued or being listed; the walk is over when this reaches zero.
    outstanding: usize,
}

pub(super) fn scan(root: &Path, threads: usize) -> Result<Catalog, ScanError> {
    let root_err = |source| ScanError::Root {
        path: root.to_path_buf(),
        source,
    };
    // SOURCE's path itself may be a link (to the file system's mount, say); nothing below it.
    let root_dir = File::open(root).map_err(root_err)?;
    let root_stat = sys::lstat_at(root_dir.as_fd(), "".as_ref()).map_err(root_err)?;
    if Kind::of_mode(root_stat.st_mode) != Kind::Directory {
        return Err(ScanError::NotADirectory(root.to_path_buf()));
    }
    // Listing the root up front turns "unreadable SOURCE" into an error instead of an empty mount.
    sys::list_names(root_dir.as_fd()).map_err(root_err)?;
    let lister = FsLister {
        root,
        root_dir,
        root_stat,
    };
    scan_with(root, &lister, threads)
}

/// Scans the tree `lister` describes, with `threads` concurrent listings, as rooted at `root`.
pub fn scan_with(root: &Path, lister: &dyn Lister, threads: usize) -> Result<Catalog, ScanError> {
    let queue = Mutex::new(WorkQueue {
        pending: VecDeque::from([PathBuf::new()]),
        outstanding: 1,
    });
    let wake = Condvar::new();
    let listings: Mutex<HashMap<PathBuf, Vec<Scanned>>> = Mutex::new(HashMap::new());
    let seen = AtomicU64::new(0);
    let started = Instant::now();
    let last_report = Mutex::new(Instant::now());

    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                loop {
                    let dir = {
                        let mut q = queue.lock();
                        loop {
                            if let Some(d) = q.pending.pop_front() {
                                break d;
                            }
                            if q.outstanding == 0 {
                                return;
                            }
                            wake.wait(&mut q);
                        }
                    };
                    let children = lister.list(&dir);
                    let subdirs: Vec<PathBuf> = children
                        .iter()
                        .filter(|c| c.kind == Kind::Directory)
                        .map(|c| dir.join(&c.name))
                        .collect();
                    let total = seen.fetch_add(children.len() as u64, Ordering::Relaxed)
                        + children.len() as u64;
                    listings.lock().insert(dir, children);
                    {
                        let mut q = queue.lock();
                        q.outstanding += subdirs.len();
                        q.outstanding -= 1;
                        q.pending.extend(subdirs);
                    }
                    wake.notify_all();
                    let mut last = last_report.lock();
                    if last.elapsed() >= PROGRESS_INTERVAL {
                        *last = Instant::now();
                        log::info!(
                            "scanning {}: {} entries in {:.0?}",
                            root.display(),
                            total,
                            started.elapsed()
                        );
                    }
                }
            });
        }
    });

    let catalog = assemble(root, lister.root(), listings.into_inner())?;
    log::info!(
        "scanned {}: {} entries, {} files, {} bytes in {:.2?}",
        root.display(),
        catalog.len(),
        catalog.file_count,
        catalog.total_file_bytes,
        started.elapsed()
    );
    Ok(catalog)
}

/// Lists directory `dir` (relative to `root`, shown as `shown`). An unreadable subdirectory
/// shows up empty with a warning: one bad folder should not stop a mount of millions of files.
fn list_directory(root: BorrowedFd<'_>, dir: &Path, shown: &Path) -> Vec<Scanned> {
    let listed = sys::open_beneath(root, dir, libc::O_RDONLY | libc::O_DIRECTORY)
        .and_then(|fd| Ok((sys::list_names(fd.as_fd())?, fd)));
    let (names, fd) = match listed {
        Ok(listed) => listed,
        Err(e) => {
            log::warn!(
                "cannot list {}: {e}; it appears empty in the mount",
                shown.display()
            );
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for name in names {
        let left_out = |what: &str, e: io::Error| {
            log::warn!(
                "cannot {what} {}: {e}; left out of the mount",
                shown.join(&name).display()
            )
        };
        let st = match sys::lstat_at(fd.as_fd(), &name) {
            Ok(st) => st,
            Err(e) => {
                left_out("stat", e);
                continue;
            }
        };
        let target = if Kind::of_mode(st.st_mode) == Kind::Symlink {
            match sys::readlink_at(fd.as_fd(), &name) {
                Ok(t) => Some(t),
                Err(e) => {
                    left_out("read link", e);
                    continue;
                }
            }
        } else {
            None
        };
        out.push(Scanned::from_stat(name, &st, target));
    }
    out
}

/// A catalog of one directory holding files `f000000`, `f000001`, ... of `sizes`, built
/// without touching any file system (for the engine core's tests).
#[cfg(test)]
pub(crate) fn flat(sizes: &[u64]) -> Catalog {
    let entry = |name: String, kind: Kind, size: u64| Scanned {
        name: name.into(),
        kind,
        perm: 0o644,
        uid: 0,
        gid: 0,
        size,
        mtime_secs: 0,
        mtime_nanos: 0,
        identity: 0,
        link_target: None,
    };
    let files = (sizes.iter().enumerate())
        .map(|(i, &size)| entry(format!("f{i:06}"), Kind::File, size))
        .collect();
    let root = entry(String::new(), Kind::Directory, 0);
    let listings = HashMap::from([(PathBuf::new(), files)]);
    assemble(Path::new("/synthetic"), root, listings).expect("a small catalog")
}

/// Lays the listings out breadth-first: the children of each directory get consecutive ids
/// in name order, which is what makes lookup a binary search.
fn assemble(
    root: &Path,
    root_scanned: Scanned,
    mut listings: HashMap<PathBuf, Vec<Scanned>>,
) -> Result<Catalog, ScanError> {
    let total: usize = 1 + listings.values().map(Vec::len).sum::<usize>();
    let name_bytes: usize = listings.values().flatten().map(|s| s.name.len()).sum();
    if total > u32::MAX as usize || name_bytes > u32::MAX as usize {
        return Err(ScanError::TooManyEntries);
    }
    let mut catalog = Catalog {
        root_path: root.to_path_buf(),
        entries: Vec::with_capacity(total),
        names: Vec::new(),
        owners: Vec::new(),
        link_targets: Vec::new(),
        file_count: 0,
        total_file_bytes: 0,
    };
    let mut owner_ids = HashMap::new();
    push_entry(&mut catalog, &mut owner_ids, ROOT, root_scanned);

    // (directory id, its relative path), in id order.
    let mut frontier: VecDeque<(FileId, PathBuf)> = VecDeque::from([(ROOT, PathBuf::new())]);
    while let Some((dir_id, dir_path)) = frontier.pop_front() {
        let mut children = listings.remove(&dir_path).unwrap_or_default();
        children.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
        let first = catalog.entries.len() as FileId;
        catalog.entries[dir_id as usize].first_child = first;
        catalog.entries[dir_id as usize].child_count = children.len() as u32;
        for child in children {
            let id = catalog.entries.len() as FileId;
            if child.kind == Kind::Directory {
                frontier.push_back((id, dir_path.join(&child.name)));
            }
            push_entry(&mut catalog, &mut owner_ids, dir_id, child);
        }
    }
    catalog.link_targets.sort_by_key(|(id, _)| *id);
    catalog.entries.shrink_to_fit();
    catalog.names.shrink_to_fit();
    Ok(catalog)
}

fn push_entry(
    catalog: &mut Catalog,
    owner_ids: &mut HashMap<(u32, u32), u32>,
    parent: FileId,
    s: Scanned,
) {
    let id = catalog.entries.len() as FileId;
    let name = s.name.as_bytes();
    if s.kind == Kind::File {
        catalog.file_count += 1;
        catalog.total_file_bytes += s.size;
    }
    if let Some(target) = s.link_target {
        catalog.link_targets.push((id, target));
    }
    let owner = *owner_ids.entry((s.uid, s.gid)).or_insert_with(|| {
        catalog.owners.push((s.uid, s.gid));
        catalog.owners.len() as u32 - 1
    });
    catalog.entries.push(Entry {
        parent,
        name_offset: catalog.names.len() as u32,
        name_len: name.len() as u8,
        kind: s.kind,
        perm: s.perm,
        owner,
        size: s.size,
        mtime_secs: s.mtime_secs,
        mtime_nanos: s.mtime_nanos,
        identity: s.identity,
        first_child: 0,
        child_count: 0,
    });
    catalog.names.extend_from_slice(name);
}
